"""The default generate function, and the context every generate function receives.

A custom generate function (``rollout.generate``: a ``_target_`` node or a dotted path) has the
same signature as :func:`generate`::

    async def generate(ctx: GenerateContext, sample: Sample, sampling_params: dict, evaluation: bool) -> Sample

It may call the engines several times (multi-turn, tools) through ``ctx.post("/generate", ...)`` and
must append model tokens with their log-probs and tool tokens masked out, using
``Sample.append_response``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

from slime_hydra.rollout.client import GenerateClient
from slime_hydra.rollout.sample import FINISH_TO_STATUS, Sample, Status


@dataclass
class GenerateContext:
    cfg: Any  # RunConfig
    tokenizer: Any
    client: GenerateClient

    async def post(self, path: str, payload: Dict[str, Any]) -> Any:
        return await self.client.post(path, payload)

    def encode(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def apply_output(sample: Sample, out: Dict[str, Any]) -> Sample:
    """Append one /generate answer (with return_logprob) to ``sample`` as model tokens."""
    meta = out["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    ids = [int(p[1]) for p in pairs]
    if not pairs and out.get("output_ids"):
        raise ValueError("the engine returned no output_token_logprobs; generate with return_logprob=true")
    sample.append_response(ids, [float(p[0]) for p in pairs], trainable=True, text=out.get("text", ""))
    sample.status = FINISH_TO_STATUS.get(meta["finish_reason"]["type"], Status.FAILED) if meta.get("finish_reason") else Status.COMPLETED
    sample.weight_versions.append(str(meta.get("weight_version")))
    return sample


async def generate(ctx: GenerateContext, sample: Sample, sampling_params: Dict[str, Any], evaluation: bool = False) -> Sample:
    """One completion for ``sample.prompt``; continues a partial response (aborted earlier)."""
    if not sample.tokens:
        sample.tokens = ctx.encode(sample.prompt) if isinstance(sample.prompt, str) else list(sample.prompt)
    remaining = sampling_params["max_new_tokens"] - sample.response_length
    if remaining <= 0:
        sample.status = Status.TRUNCATED
        return sample
    out = await ctx.post("/generate", {"input_ids": sample.tokens,
                                       "sampling_params": {**sampling_params, "max_new_tokens": remaining},
                                       "return_logprob": True})
    return apply_output(sample, out)
