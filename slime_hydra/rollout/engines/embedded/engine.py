"""The embedded rollout engine: a Hugging Face causal LM that generates batches with per-token log-probs and
takes weight updates and memory release/resume as an SGLang server does. Its HTTP face is ``server.py``, whose
one worker thread runs all of it.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from slime_hydra.data.tokenizer import load_tokenizer
from slime_hydra.sync import transport

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": None}
# SGLang 0.5.17's sampling parameters that the embedded engine does not implement: accepted at their
# default value (what SGLang does then), refused otherwise rather than silently ignored.
UNSUPPORTED_SAMPLING = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                        "stop_regex": None, "json_schema": None, "regex": None, "ebnf": None,
                        "structural_tag": None, "logit_bias": None}
# SGLang's, with no effect on a whole (non-streamed) answer here
IGNORED_SAMPLING = ("n", "stream_interval", "custom_params")
# On CPU (one torch thread) the logits do not depend on the batch, so a seed samples the same whatever the batching:
# - a product of a few rows takes another kernel, which rounds differently: each linear layer gets at least this
#   many rows (``_batch_invariant``);
CPU_MIN_ROWS = 16
# - attention sums keys in vector lanes: prompts are right-padded to a multiple of this width (an AVX-512
#   register of floats), so each key sits in the same lane in every batch.
CPU_KEY_BLOCK = 16


@dataclass
class SamplingParams:
    """The subset of SGLang's sampling parameters the embedded engine implements, checked as SGLang checks them."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: List[str] = field(default_factory=list)
    stop_token_ids: List[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True
    sampling_seed: Optional[int] = None  # as SGLang: the same seed samples the same tokens, whatever the batch

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "SamplingParams":
        """As SGLang reads ``sampling_params``: null means the default, an unknown key is an error (400)."""
        d = {k: v for k, v in (d or {}).items() if v is not None and k not in IGNORED_SAMPLING}
        unknown = sorted(k for k in d if k not in cls.__dataclass_fields__ and k not in UNSUPPORTED_SAMPLING)
        if unknown:
            raise ValueError(f"unknown sampling params {unknown}")
        unsupported = sorted(k for k, default in UNSUPPORTED_SAMPLING.items() if k in d and d.pop(k) != default)
        if unsupported:
            raise ValueError(f"the embedded engine does not implement the sampling params {unsupported}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        sp = cls(**d)
        if isinstance(sp.sampling_seed, bool) or not isinstance(sp.sampling_seed, (int, type(None))):
            raise ValueError(f"sampling_seed must be an integer, got {sp.sampling_seed!r}")
        sp.verify()
        return sp

    def verify(self) -> None:
        """SGLang's SamplingParams.verify, for the fields here."""
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], got "
                             f"{self.min_new_tokens}.")


def _batch_invariant(model: torch.nn.Module) -> None:
    """Every linear layer of ``model`` multiplies at least CPU_MIN_ROWS rows (zero rows added, outputs dropped)."""

    def forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows >= CPU_MIN_ROWS:
            return torch.nn.functional.linear(x, layer.weight, layer.bias)
        flat = torch.cat([x.reshape(rows, x.shape[-1]), x.new_zeros(CPU_MIN_ROWS - rows, x.shape[-1])])
        return torch.nn.functional.linear(flat, layer.weight, layer.bias)[:rows].reshape(*x.shape[:-1], -1)

    for layer in model.modules():
        if type(layer) is torch.nn.Linear:
            layer.forward = functools.partial(forward, layer)


@dataclass
class Request:
    input_ids: List[int]
    params: SamplingParams
    rid: str
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    logprob_start_len: int = -1  # with return_logprob: the prompt's log-probs from this position (-1: none)
    parent: Optional[str] = None  # the rid of the request with n > 1 (or of the batch) this one belongs to
    epoch: int = 0  # the server's abort epoch when the request arrived (abort_all bumps it)
    aborted: bool = False


# SGLang's FINISH_ABORT().to_json(), what an aborted request's finish_reason reads
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


class MemoryReleased(RuntimeError):
    pass


class EmbeddedModel:
    def __init__(self, model_path: str, tokenizer_path: Optional[str] = None, dtype: str = "auto",
                 device: str = "cpu", seed: int = 0, trust_remote_code: bool = False):
        self.model_path = model_path
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.trust_remote_code = trust_remote_code
        self.tokenizer = load_tokenizer(tokenizer_path or model_path, trust_remote_code)
        self.model = self._load(model_path)
        self.cpu_generator = torch.Generator().manual_seed(seed)  # for requests without sampling_seed
        self.weight_version = "default"
        self.released: set = set()
        self.groups: Dict[str, Any] = {}
        self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
        gen_cfg = getattr(self.model, "generation_config", None) or GenerationConfig()
        eos = gen_cfg.eos_token_id if gen_cfg.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def _load(self, path: str) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype or "auto",
                                                     trust_remote_code=self.trust_remote_code)
        if self.device.type == "cpu":
            _batch_invariant(model)
        return model.to(self.device).eval()

    def named_parameters(self) -> Dict[str, torch.Tensor]:
        return dict(self.model.state_dict())

    def load_weights(self, named: Sequence[tuple], version: Optional[str] = None) -> None:
        """Copy (name, tensor) pairs into the model; names are Hugging Face names."""
        params = self.model.state_dict()
        unknown = [n for n, _ in named if n not in params]
        if unknown:
            raise KeyError(f"unknown parameter names: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        with torch.no_grad():
            for name, tensor in named:
                dst = params[name]
                if dst.shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match {tuple(dst.shape)}")
                dst.copy_(tensor.to(dst.device, dst.dtype))
        if version is not None:
            self.weight_version = str(version)

    def update_from_disk(self, model_path: str, version: Optional[str] = None) -> None:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=self.trust_remote_code)
        if config.model_type != self.model.config.model_type:
            raise ValueError(f"{model_path} is a {config.model_type} model, the engine serves "
                             f"{self.model.config.model_type}")
        fresh = self._load(model_path)
        self.load_weights(list(fresh.state_dict().items()), version)
        self.model_path = model_path

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str) -> None:
        if group_name in self.groups:
            raise ValueError(f"weights-update group {group_name!r} already exists")
        self.groups[group_name] = transport.init_group(master_address, master_port, rank_offset, world_size,
                                                       group_name, backend)

    def update_from_distributed(self, names: List[str], dtypes: List[str], shapes: List[List[int]],
                                group_name: str, version: Optional[str] = None,
                                load_format: Optional[str] = None) -> None:
        """One bucket broadcast by the trainer, tensor by tensor or one flattened buffer (``load_format``)."""
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"unknown load_format {load_format!r} (None or 'flattened_bucket')")
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(f"no weights-update group {group_name!r}; call /init_weights_update_group first")
        bufs = transport.receive_broadcast(group, dtypes, shapes, self.device,
                                           flattened=load_format == "flattened_bucket")
        self.load_weights(list(zip(names, bufs)), version)

    def destroy_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"no weights-update group {group_name!r}")
        transport.destroy_group(group)

    def release(self, tags: Optional[List[str]]) -> None:
        """Free the weights (and the cache, which the embedded engine keeps per batch only)."""
        tags = set(tags or ["weights", "kv_cache", "cuda_graph"])
        if "weights" in tags and "weights" not in self.released:
            # Buffers that are not weights (rotary inv_freq) are not pushed by the trainer: keep them.
            self._kept_buffers = {n: b.detach().to("cpu", copy=True) for n, b in self.model.named_buffers()}
            self.model.to_empty(device="meta")
        self.released |= tags
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self, tags: Optional[List[str]]) -> None:
        """Re-allocate. Resumed weights are uninitialised until the next weight update."""
        tags = set(tags or ["weights", "kv_cache", "cuda_graph"])
        if "weights" in tags and "weights" in self.released:
            self.model.to_empty(device=self.device)
            if hasattr(self.model, "tie_weights"):
                self.model.tie_weights()
            with torch.no_grad():
                for name, buf in self.model.named_buffers():
                    buf.copy_(self._kept_buffers[name])
            self.weight_version = "uninitialized"
        self.released -= tags

    def _uniforms(self, streams: List[Optional[torch.Generator]]) -> torch.Tensor:
        """One float64 uniform in [0, 1) per row, a seeded request's from its own stream."""
        n_free = sum(g is None for g in streams)
        free = iter(torch.rand(n_free, dtype=torch.float64, generator=self.cpu_generator).tolist())
        return torch.tensor([next(free) if g is None else torch.rand(1, dtype=torch.float64, generator=g).item()
                             for g in streams], dtype=torch.float64)

    def _sample(self, logits: torch.Tensor, reqs: List[Request], streams: List[Optional[torch.Generator]]) -> tuple:
        """One token per row and its log-prob under softmax(logits / T) before top-k / top-p / min-p, as SGLang."""
        logits = logits.float()
        temps = torch.tensor([r.params.temperature for r in reqs], device=logits.device)
        greedy = temps == 0
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        logprobs = torch.log_softmax(scaled, dim=-1)
        filtered = scaled
        if any(r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0 for r in reqs):
            vocab = scaled.shape[-1]
            top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in reqs], device=logits.device)
            top_p = torch.tensor([r.params.top_p for r in reqs], device=logits.device)
            min_p = torch.tensor([r.params.min_p for r in reqs], device=logits.device)
            sorted_logits, idx = scaled.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(-1)
            drop = torch.arange(vocab, device=logits.device)[None, :] >= top_k[:, None]
            drop |= probs.cumsum(-1) - probs >= top_p[:, None]
            drop |= probs < min_p[:, None] * probs[:, :1]
            filtered = torch.empty_like(scaled).scatter_(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
        tokens = scaled.argmax(-1)
        if not bool(greedy.all()):
            probs = filtered.double().softmax(-1)
            cdf = probs.cumsum(-1)
            u = self._uniforms(streams).to(logits.device)
            picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
            # rounding may put u * total at the very top: take the last token that can be drawn
            last = (probs > 0).long().cumsum(-1).argmax(-1)
            tokens = torch.where(greedy, tokens, torch.minimum(picked, last))
        return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]

    @staticmethod
    def _stream(r: Request) -> Optional[torch.Generator]:
        """A seeded request's own random stream, mixed with the prompt length (a conversation's turns differ)."""
        if r.params.sampling_seed is None or r.params.temperature == 0:
            return None
        mixed = (int(r.params.sampling_seed) * 1_000_003 + len(r.input_ids)) % (1 << 63)
        return torch.Generator().manual_seed(mixed)

    @torch.no_grad()
    def generate(self, reqs: List[Request],
                 is_aborted: Callable[[Request], bool] = lambda r: r.aborted) -> List[Dict[str, Any]]:
        """SGLang-shaped outputs for a batch of requests, in order; ``is_aborted`` is polled every decode step."""
        if "weights" in self.released:
            raise MemoryReleased("the engine's memory is released; resume it (and update weights) before generating")
        n = len(reqs)
        if n == 0:
            return []
        out_ids: List[List[int]] = [[] for _ in range(n)]
        out_lps: List[List[float]] = [[] for _ in range(n)]
        finish: List[Optional[Dict[str, Any]]] = [{"type": "length", "length": 0} if r.params.max_new_tokens == 0
                                                  else None for r in reqs]
        prompts = [list(r.input_ids) for r in reqs]
        lens = torch.tensor([max(len(p), 1) for p in prompts], device=self.device)
        width = max(len(p) for p in prompts)
        if self.device.type == "cpu":  # batch-invariant logits (CPU_KEY_BLOCK)
            width = -(-width // CPU_KEY_BLOCK) * CPU_KEY_BLOCK
        # right-padded; the new tokens follow every row's padding, each at its own position (its length so far)
        ids = torch.tensor([p + [self.pad_id] * (width - len(p)) for p in prompts], device=self.device)
        mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts], device=self.device)
        pos = torch.minimum(torch.arange(width, device=self.device)[None, :], lens[:, None] - 1)
        last = lens - 1  # where each prompt's last token is: the first logits to sample from
        cache, step_ids, step_pos = None, ids, pos
        streams = [self._stream(r) for r in reqs]
        max_new = max(r.params.max_new_tokens for r in reqs)
        for _ in range(max_new):
            if all(f is not None for f in finish):
                break
            o = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=cache,
                           use_cache=True)
            logits = o.logits[torch.arange(n, device=self.device), last] if cache is None else o.logits[:, -1, :]
            cache = o.past_key_values
            tokens, lps = self._sample(logits, reqs, streams)
            for i, r in enumerate(reqs):
                if finish[i] is not None:
                    continue
                if r.aborted or is_aborted(r):
                    finish[i] = ABORTED
                    continue
                t = int(tokens[i])
                out_ids[i].append(t)
                out_lps[i].append(float(lps[i]))
                finish[i] = self._finished(r, out_ids[i])
            live = torch.tensor([f is None for f in finish], device=self.device)
            mask = torch.cat([mask, live.long()[:, None]], dim=1)
            step_ids = torch.where(live, tokens, torch.full_like(tokens, self.pad_id))[:, None]
            step_pos, lens = lens[:, None], lens + 1
        for i in range(n):
            if finish[i] is None:
                finish[i] = {"type": "length", "length": len(out_ids[i])}
        return [self._output(r, out_ids[i], out_lps[i], finish[i]) for i, r in enumerate(reqs)]

    def _prompt_logprobs(self, r: Request) -> List[Optional[float]]:
        """SGLang's input_token_logprobs values: the log-prob of each prompt token from ``logprob_start_len`` on
        under softmax(logits / T) of the tokens before it (None for the first token, which has none). Each prompt
        is scored alone and unpadded: the numbers of a plain forward pass of the model (a teacher's scores)."""
        ids = torch.tensor([r.input_ids], device=self.device)
        t = r.params.temperature or 1.0
        logits = self.model(input_ids=ids).logits[0, :-1].float()
        lps = torch.log_softmax(logits / t, dim=-1).gather(-1, ids[0, 1:, None])[:, 0].tolist()
        return ([None] + lps)[max(r.logprob_start_len, 0):]

    def _finished(self, r: Request, ids: List[int]) -> Optional[Dict[str, Any]]:
        p, t = r.params, ids[-1]
        if len(ids) >= p.min_new_tokens:
            if (t in self.eos_ids and not p.ignore_eos) or t in p.stop_token_ids:
                return {"type": "stop", "matched": t}
            if p.stop:
                tail = self.tokenizer.decode(ids[-8:], skip_special_tokens=False)
                for s in p.stop:
                    if tail.endswith(s):
                        return {"type": "stop", "matched": s}
        if len(ids) >= p.max_new_tokens:
            return {"type": "length", "length": len(ids)}
        return None

    def _output(self, r: Request, ids: List[int], lps: List[float], finish: Dict[str, Any]) -> Dict[str, Any]:
        p = r.params
        trim = not p.no_stop_trim and finish["type"] == "stop"
        shown = ids[:-1] if trim and isinstance(finish.get("matched"), int) else ids
        text = self.tokenizer.decode(shown, skip_special_tokens=p.skip_special_tokens)
        if trim and isinstance(finish.get("matched"), str):
            text = text[: len(text) - len(finish["matched"])] if text.endswith(finish["matched"]) else text
        meta: Dict[str, Any] = {  # SGLang 0.5.17's meta_info without its timings
            "id": r.rid, "finish_reason": finish, "prompt_tokens": len(r.input_ids),
            "weight_version": self.weight_version, "num_retractions": 0, "reasoning_tokens": 0,
            "completion_tokens": len(ids), "cached_tokens": 0}
        if r.return_logprob:  # (logprob, token id, token text or None); prompt's from logprob_start_len (-1: none)
            texts = [self.tokenizer.decode([t]) for t in ids] if r.return_text_in_logprobs else [None] * len(ids)
            start = r.logprob_start_len
            prompt_ids = r.input_ids[start:] if start >= 0 else []
            prompt_texts = [self.tokenizer.decode([t]) if r.return_text_in_logprobs else None for t in prompt_ids]
            meta["input_token_logprobs"] = [[lp, t, x] for lp, t, x in zip(
                self._prompt_logprobs(r) if start >= 0 else [], prompt_ids, prompt_texts)]
            meta["output_token_logprobs"] = [[lp, t, x] for lp, t, x in zip(lps, ids, texts)]
            meta["output_token_logprobs_length"] = len(ids)
        return {"text": text, "output_ids": ids, "meta_info": meta}
