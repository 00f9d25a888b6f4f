"""The default generate function, and the context every generate function receives. A custom one
(``rollout.generate``: a ``_target_`` node or a dotted path) has the signature of :func:`generate`::

    async def generate(ctx: GenerateContext, sample: Sample, sampling_params: dict, evaluation: bool) -> Sample

It returns a ``Sample`` (not a list) with ``tokens`` = prompt + response, ``status`` from the engine's finish
reason, and every response token's log-prob; it may call ``ctx.post("/generate", ...)`` several times
(multi-turn, tools: :mod:`slime_hydra.rollout.multiturn`), appending tokens with ``Sample.append_response``.

Aborts: in-flight requests are answered with ``finish_reason.type == "abort"`` and the tokens so far (and,
while the manager aborts, ``ctx.post`` answers so at once). The function must then return the sample
``ABORTED``; with ``rollout.partial_rollout`` it continues from ``sample.tokens`` in a later rollout.
With the default generate function a group goes in one batched request (:func:`generate_group`).
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from slime_hydra.data.sample import Sample, Status, status_from_finish
from slime_hydra.rollout.client import GenerateClient
from slime_hydra.utils.http import EngineError


@dataclass
class GenerateContext:
    cfg: Any  # RunConfig
    tokenizer: Any
    client: GenerateClient
    aborting: bool = False  # set by the manager while it cuts a rollout off
    requests: int = 0  # /generate requests sent to the engines (the manager reads and resets it)
    endpoint: Any = None  # rollout.agent: the sessions' OpenAI-compatible server (rollout/agent.py)

    async def post(self, path: str, payload: Dict[str, Any]) -> Any:
        if self.aborting and path == "/generate":
            return aborted_output(payload)
        self.requests += path == "/generate"
        return await self.client.post(path, payload)

    def encode(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def aborted_output(payload: Dict[str, Any]) -> Any:
    """What an engine answers for a request aborted before its first token (one per prompt)."""
    one = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "rollout aborted"},
                                                       "output_token_logprobs": [], "completion_tokens": 0}}
    ids = payload.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return [dict(one) for _ in ids]
    return one


def apply_output(sample: Sample, out: Dict[str, Any]) -> Sample:
    """Append one /generate answer (with return_logprob) to ``sample`` as model tokens."""
    meta = out["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    ids = [int(p[1]) for p in pairs]
    if not pairs and out.get("output_ids"):
        raise ValueError("the engine returned no output_token_logprobs; generate with return_logprob=true")
    sample.append_response(ids, [float(p[0]) for p in pairs], trainable=True, text=out.get("text", ""))
    sample.status = status_from_finish(meta, sample)  # an unknown or missing finish reason raises
    if "weight_version" in meta:  # not in the manager's own abort answers (no engine ran)
        sample.weight_versions.append(str(meta["weight_version"]))
    return sample


def sampling_seed(run_seed: int, rollout_id: Any, index: int) -> int:
    """The ``sampling_seed`` of one sample: a hash of the run's seed, the rollout that first sampled it and its
    index, below 2**31 (SGLang's older samplers hold seeds as int32)."""
    key = f"{run_seed}:{rollout_id}:{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") >> 1


def seeded(ctx: GenerateContext, sample: Sample, sampling_params: Dict[str, Any], evaluation: bool) -> Dict[str, Any]:
    """``sampling_params`` with this sample's ``sampling_seed`` (unless it has one, is greedy, or there is no run
    config). SGLang honours it with ``--enable-deterministic-inference``; the embedded engine always."""
    if ctx.cfg is None or "sampling_seed" in sampling_params or sampling_params.get("temperature", 1.0) == 0:
        return sampling_params
    rollout_id = "eval" if evaluation else sample.metadata.get("start_rollout_id")
    return {**sampling_params, "sampling_seed": sampling_seed(ctx.cfg.rollout.seed, rollout_id, sample.index)}


def _request_params(ctx: GenerateContext, sample: Sample, sampling_params: Dict[str, Any],
                    evaluation: bool) -> Optional[Dict[str, Any]]:
    """The sample's next request's ``sampling_params`` (seed, budget left); None (TRUNCATED) when none is left."""
    if not sample.tokens:
        sample.tokens = ctx.encode(sample.prompt) if isinstance(sample.prompt, str) else list(sample.prompt)
    remaining = sampling_params["max_new_tokens"] - sample.response_length
    if remaining <= 0:
        sample.status = Status.TRUNCATED
        return None
    return {**seeded(ctx, sample, sampling_params, evaluation), "max_new_tokens": remaining}


async def generate(ctx: GenerateContext, sample: Sample, sampling_params: Dict[str, Any],
                   evaluation: bool = False) -> Sample:
    """One completion for ``sample.prompt``; continues a partial response (aborted earlier)."""
    params = _request_params(ctx, sample, sampling_params, evaluation)
    if params is None:
        return sample
    out = await ctx.post("/generate", {"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True})
    return apply_output(sample, out)


async def generate_group(ctx: GenerateContext, samples: List[Sample], sampling_params: Dict[str, Any],
                         evaluation: bool = False) -> List[Sample]:
    """:func:`generate` for every sample of ``samples`` in ONE /generate request, SGLang's batched form (lists of
    ``input_ids``, ``sampling_params`` and ``rid``; a list of outputs in order). Each sample keeps its own
    ``sampling_seed``, budget and ``rid``."""
    todo = [(s, p) for s in samples if (p := _request_params(ctx, s, sampling_params, evaluation)) is not None]
    if not todo:
        return samples
    batch = uuid.uuid4().hex[:16]
    outs = await ctx.post("/generate", {"input_ids": [s.tokens for s, _ in todo], "return_logprob": True,
                                        "sampling_params": [p for _, p in todo],
                                        "rid": [f"{batch}-{i}" for i in range(len(todo))]})
    if not isinstance(outs, list) or len(outs) != len(todo):
        got = f"{len(outs)} outputs" if isinstance(outs, list) else type(outs).__name__
        raise EngineError(f"a batched /generate of {len(todo)} prompts was answered with {got}; expected a list "
                          f"of {len(todo)} (SGLang's batched form)")
    for (s, _), out in zip(todo, outs):
        apply_output(s, out)
    return samples
