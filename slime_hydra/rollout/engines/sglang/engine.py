"""SGLang servers (``python -m sglang.launch_server``, sglang 0.5.17), slime's production engine.

``rollout.server_args`` is passed through to SGLang's ServerArgs (``mem_fraction_static: 0.7`` ->
``--mem-fraction-static 0.7``) and checked in validation (``args``); slime_hydra adds what the run needs
(``launch``); ``rollout.sglang_fast_start`` starts it through ``fast_start``. Notes:
- ``SGLANG_MEMORY_SAVER_CUDA_GRAPH`` is false (releasing graph memory needs torch_memory_saver's preload hook
  mode): the decode graphs' memory stays allocated while the trainer trains.
- ``SGLANG_LOG_MS``: log timestamps in milliseconds, for ``startup_parts``.
- float32: the native Qwen3's ``rmsnorm`` is fp16/bf16 only, so float32 servers run the transformers
  implementation (unless ``rollout.server_args`` sets ``model_impl``) with IEEE float32 Triton dots.
"""

from __future__ import annotations

import os
import re
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Dict, List, Optional

from slime_hydra.rollout.engines.base import Engine, to_flags
from slime_hydra.rollout.engines.sglang.args import server_args_problems
from slime_hydra.rollout.engines.sglang.launch import launch_server_args, startup_note

if TYPE_CHECKING:
    from slime_hydra.config.schema import RunConfig
    from slime_hydra.plan.resources import ResourcePlan

# slime's defaults but SGLANG_MEMORY_SAVER_CUDA_GRAPH (values already in the environment win)
SGLANG_ENV = {
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "false",
    "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "false",
    "SGLANG_DISABLE_TP_MEMORY_INBALANCE_CHECK": "true",
    "NCCL_CUMEM_ENABLE": "0",
    "SGLANG_LOG_MS": "true",
    # uvicorn's default keep-alive (5 s) would close the client's pooled connections while the trainer trains
    "SGLANG_TIMEOUT_KEEP_ALIVE": "3600",
}

LAUNCH_SERVER, FAST_START = "sglang.launch_server", "slime_hydra.rollout.engines.sglang.fast_start"

FLOAT32_SERVER_ARGS = {"model_impl": "transformers"}
FLOAT32_ENV = {"TRITON_F32_DEFAULT": "ieee"}


class SglangEngine(Engine):
    # expandable segments break SGLang's memory saver (torch_memory_saver)
    unset_env = ("PYTORCH_CUDA_ALLOC_CONF",)

    @classmethod
    def check(cls, cfg: "RunConfig") -> List[str]:
        errs = [] if cfg.parallelism.device == "cuda" else [
            "rollout.engine: sglang needs parallelism.device=cuda (use rollout=embedded on CPU)"]
        return errs + server_args_problems(dict(cfg.rollout.server_args), defer=cfg.rollout.sglang_fast_start)

    @classmethod
    def plan_notes(cls, cfg: "RunConfig", plan: "ResourcePlan") -> List[str]:
        return [startup_note(dict(cfg.rollout.server_args), plan.engine_batch, plan.engine_kv_cap,
                             engine_resident=not cfg.parallelism.offload_rollout)]

    def command(self, host: str, port: int, base_gpu_id: int = 0, nccl_port: Optional[int] = None) -> List[str]:
        s = self.spec
        multi = s.nnodes > 1
        # tp_size counts the GPUs of all the engine's nodes (SGLang splits them by --nnodes)
        args = {**self.common_args(host, port, base_gpu_id), "tp_size": s.gpus, "enable_memory_saver": s.memory_saver,
                "skip_server_warmup": True, "nccl_port": nccl_port, "nnodes": s.nnodes if multi else None,
                "node_rank": s.node_rank if multi else None, "dist_init_addr": s.dist_init_addr,
                "dtype": s.dtype,  # float32 too: else SGLang serves the checkpoint's dtype
                **(FLOAT32_SERVER_ARGS if s.dtype == "float32" else {}),
                **launch_server_args(s.server_args, s.decode_batch, s.kv_tokens, engine_resident=not s.memory_saver)}
        return [sys.executable, "-m", FAST_START if s.fast_start else LAUNCH_SERVER, *to_flags(args)]

    def prebuild_command(self, report_path: str) -> Optional[List[str]]:
        s = self.spec
        if not s.fast_start or s.device != "cuda" or s.dtype == "float32":  # float32: other kernels (above)
            return None
        return [sys.executable, "-m", FAST_START, "prebuild", "--model-path", s.model_path, "--dtype", s.dtype,
                "--tp", str(s.gpus), *(["--trust-remote-code"] if s.trust_remote_code else []), "--report", report_path]

    def env(self) -> Dict[str, str]:
        env = {**SGLANG_ENV, **(FLOAT32_ENV if self.spec.dtype == "float32" else {})}
        return {**super().env(), **{k: os.environ.get(k, v) for k, v in env.items()}}

    @classmethod
    def log_note(cls, status: str, stood: float) -> Optional[str]:
        """On a machine's first start SGLang compiles its kernels inside its first CUDA-graph capture."""
        if "Capturing batches" not in status or stood < CAPTURE_NOTE_S:
            return None
        return (f"for {stood:.0f}s: on a machine's first start SGLang compiles its kernels here or waits for those "
                f"built beside it, logs/engine_*_prebuild.log; they are cached in {', '.join(KERNEL_CACHES)}, later "
                "starts reuse them, and docs/startup.md says how to share them")

    @classmethod
    def startup_parts(cls, log_text: str, started: float, ready: float) -> Dict[str, float]:
        """Seconds of each part of the start (``SGLANG_PARTS``; a part whose lines are missing is left out) from
        the log's timestamps, SGLang's own graph-capture seconds and ``kv_tokens``, the KV cache's size."""
        marks: Dict[str, float] = {}
        captured, kv_tokens = 0.0, None
        for line in log_text.splitlines():
            m = SGLANG_LOG_LINE.match(line)
            if not m:
                continue
            try:
                t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f" if "." in m.group(1)
                                      else "%Y-%m-%d %H:%M:%S").timestamp()
            except ValueError:
                continue
            for name, pattern in SGLANG_MILESTONES:
                if pattern in m.group(2) and (name not in marks or name == "graphs"):
                    marks[name] = t  # the first of each, the last graph captured
            if e := SGLANG_CAPTURE.search(m.group(2)):
                captured += float(e.group(1))
            if k := SGLANG_KV_TOKENS.search(m.group(2)):
                kv_tokens = int(k.group(1))
        order = [("start", started), *[(n, marks[n]) for n, _ in SGLANG_MILESTONES if n in marks], ("ready", ready)]
        parts = {f"{SGLANG_PARTS[(a, b)]}_s": round(tb - ta, 2) for (a, ta), (b, tb) in zip(order, order[1:])
                 if (a, b) in SGLANG_PARTS}
        if captured:
            parts["graph_capture_s"] = round(captured, 2)  # SGLang's own count, within cuda_graphs_s
        if kv_tokens is not None:
            parts["kv_tokens"] = kv_tokens
        return parts


# A server log's line: "[2026-12-01 16:15:00.123 TP0] message" (the milliseconds with SGLANG_LOG_MS)
SGLANG_LOG_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)[^\]]*\] (.*)$")
# (milestone, what its line says), in the order a start passes them (sglang 0.5.17's messages)
SGLANG_MILESTONES = (("dist", "Init torch distributed begin"), ("load", "Load weight begin"),
                     ("loaded", "Load weight end"), ("kv", "Memory pool end"), ("graphs", "CUDA graph end"),
                     ("http", "The server is fired up"))
# (from, to) -> the part between them, when both are in the log and nothing between them is missing
SGLANG_PARTS = {("start", "dist"): "process", ("dist", "load"): "distributed_init", ("load", "loaded"): "weights",
                ("loaded", "kv"): "kv_cache", ("kv", "graphs"): "cuda_graphs", ("graphs", "http"): "http_server",
                ("kv", "http"): "http_server", ("http", "ready"): "first_answer"}
CAPTURE_NOTE_S = 20.0  # a log standing this long on the CUDA-graph capture gets log_note's word
KERNEL_CACHES = ("~/.cache/tvm-ffi", "~/.cache/flashinfer", "~/.triton/cache")  # where SGLang's JIT kernels are kept
SGLANG_CAPTURE = re.compile(r"CUDA graph end\. elapsed=([\d.]+) s")
SGLANG_KV_TOKENS = re.compile(r"\bmax_total_num_tokens=(\d+)")
