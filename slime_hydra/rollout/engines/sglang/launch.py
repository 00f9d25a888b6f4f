"""What slime_hydra adds to ``rollout.server_args`` on an SGLang server's command line: no prefill CUDA graph
(sglang 0.5.17 captures one for many token counts, a much longer start, and refuses the memory saver with it)
and decode graphs only for the batch sizes the run can send an engine, unless ``rollout.server_args`` chooses
them; on a GPU shared with a trainer, the KV pool held to the plan's count.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

# rollout.server_args keys that choose the prefill CUDA graph (sglang 0.5.17's names and deprecated aliases)
PREFILL_GRAPH_KEYS = ("disable_prefill_cuda_graph", "cuda_graph_backend_prefill", "cuda_graph_config",
                      "disable_cuda_graph", "enable_breakable_cuda_graph", "disable_piecewise_cuda_graph",
                      "enforce_piecewise_cuda_graph")
# ... and the decode CUDA graphs' batch sizes (cuda_graph_max_bs and cuda_graph_bs: 0.5.17's deprecated aliases)
DECODE_GRAPH_KEYS = ("cuda_graph_max_bs_decode", "cuda_graph_bs_decode", "cuda_graph_max_bs", "cuda_graph_bs",
                     "cuda_graph_config", "cuda_graph_backend_decode", "disable_decode_cuda_graph",
                     "disable_cuda_graph", "disable_cuda_graph_padding")
# SGLang's default largest decode graph on a GPU of 90-160 GB below TP 4 (a run that uses as many keeps it)
SGLANG_DEFAULT_DECODE_MAX_BS = 256


def decode_graph_sizes(max_bs: int) -> List[int]:
    """The decode batch sizes sglang 0.5.17 captures for ``cuda_graph_max_bs_decode=max_bs``."""
    grid = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    sizes = [b for b in grid if b <= max_bs]
    return sizes if max_bs in sizes else [*sizes, max_bs]


def decode_graph_max_bs(batch: int) -> int:
    """The smallest size of SGLang's grid that holds ``batch`` sequences (a batch in between is padded up)."""
    grid = decode_graph_sizes(max(batch, 512) + 32)
    return next(b for b in grid if b >= batch)


# The least ``mem_fraction_static`` where the KV pool is held to the plan's count and the engine stays resident
# (no ``parallelism.offload_rollout``): SGLang sizes its pool from the memory free before and after its weights
# load, and a colocated trainer that grows in between would leave a low fraction's pool far below the count.
CAPPED_MEM_FRACTION = 0.9


def startup_server_args(server_args: Dict[str, Any], decode_batch: Optional[int],
                        kv_tokens: Optional[int] = None) -> Dict[str, Any]:
    """What slime_hydra adds to ``server_args``: no prefill CUDA graph unless chosen (``PREFILL_GRAPH_KEYS``);
    decode graphs up to ``decode_batch`` on SGLang's grid unless chosen (``DECODE_GRAPH_KEYS``) or SGLang's default
    is no larger; the KV pool held to ``kv_tokens`` (``max_total_tokens``) unless set."""
    out: Dict[str, Any] = {}
    if kv_tokens and "max_total_tokens" not in server_args:
        out["max_total_tokens"] = kv_tokens
    if not any(key in server_args for key in PREFILL_GRAPH_KEYS):
        out["disable_prefill_cuda_graph"] = True
    if decode_batch and not any(key in server_args for key in DECODE_GRAPH_KEYS):
        max_bs = decode_graph_max_bs(decode_batch)
        if max_bs < SGLANG_DEFAULT_DECODE_MAX_BS:
            out["cuda_graph_max_bs_decode"] = max_bs
    return out


def launch_server_args(server_args: Dict[str, Any], decode_batch: Optional[int], kv_tokens: Optional[int] = None,
                       engine_resident: bool = False) -> Dict[str, Any]:
    """``server_args`` with ``startup_server_args`` added where it sets nothing, and ``mem_fraction_static`` at
    least ``CAPPED_MEM_FRACTION`` when the KV pool is held to the plan's count and ``engine_resident``."""
    added = startup_server_args(server_args, decode_batch, kv_tokens)
    args = {**added, **server_args}
    if "max_total_tokens" in added and engine_resident:
        frac = args.get("mem_fraction_static")
        try:
            value = CAPPED_MEM_FRACTION if frac is None else float(frac)  # as the plan reads it
        except (TypeError, ValueError):
            return args  # not a number: SGLang's parser refuses it, and the plan has said so
        args["mem_fraction_static"] = max(value, CAPPED_MEM_FRACTION)
    return args


def startup_note(server_args: Dict[str, Any], decode_batch: Optional[int], kv_tokens: Optional[int] = None,
                 engine_resident: bool = False) -> str:
    """The plan print-out's line on what the servers capture at start and the KV pool's cap."""
    added = startup_server_args(server_args, decode_batch, kv_tokens)
    if "cuda_graph_max_bs_decode" in added:
        n = len(decode_graph_sizes(added["cuda_graph_max_bs_decode"]))
        decode = (f"decode CUDA graphs up to batch {added['cuda_graph_max_bs_decode']} ({n} sizes; at most "
                  f"{decode_batch} sequences decode at once per engine), not SGLang's "
                  f"{len(decode_graph_sizes(SGLANG_DEFAULT_DECODE_MAX_BS))} up to {SGLANG_DEFAULT_DECODE_MAX_BS}")
    elif any(key in server_args for key in DECODE_GRAPH_KEYS):
        decode = "decode CUDA graphs as rollout.server_args sets them"
    else:
        decode = (f"SGLang's default decode CUDA graphs (the run can send an engine "
                  f"{decode_batch if decode_batch else 'an unknown number of'} sequences at once)")
    prefill = "no prefill CUDA graph" if added.get("disable_prefill_cuda_graph") else \
        "the prefill CUDA graph as rollout.server_args sets it"
    kv = ""
    if "max_total_tokens" in added:
        sent = launch_server_args(server_args, decode_batch, kv_tokens, engine_resident).get("mem_fraction_static")
        reach = f"; SGLang starts with mem_fraction_static={sent:g} to reach it" \
            if sent != server_args.get("mem_fraction_static") else ""
        kv = f"; its KV cache held to {added['max_total_tokens']:,} tokens (the estimate's, the GPU being " \
            f"shared{reach})"
    return f"sglang start-up: {decode}; {prefill}{kv}"
