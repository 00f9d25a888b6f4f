"""SGLang servers (``python -m sglang.launch_server``), slime's production engine.

``rollout.server_args`` is passed through to SGLang's ServerArgs (``mem_fraction_static: 0.7`` ->
``--mem-fraction-static 0.7``) and checked in validation (``args``); slime_hydra adds what the run needs
(``launch``). With ``rollout.sglang_fast_start`` the server starts through ``fast_start`` (docs/startup.md).

The project pins sglang 0.5.17 for GPUs. What it needs:
- ``SGLANG_MEMORY_SAVER_CUDA_GRAPH`` is false: releasing CUDA-graph memory needs torch_memory_saver's
  preload hook mode. The decode graphs' memory stays allocated while the trainer trains; weights and KV
  cache are released.
- ``SGLANG_LOG_MS``: the server log's timestamps have milliseconds, so ``startup_parts`` can say where the
  start went (imports, weights, KV cache, CUDA graphs, HTTP server).
- ``model.dtype=float32``: 0.5.17's native Qwen3 calls ``sgl_kernel``'s ``rmsnorm``, built for fp16 and bf16
  only, and a float32 server dies capturing its decode CUDA graphs. Unless ``rollout.server_args`` sets
  ``model_impl``, float32 servers run the transformers implementation with Triton's float32 dots in IEEE
  precision, not TF32 (``FLOAT32_SERVER_ARGS``, ``FLOAT32_ENV``).
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

# Environment for SGLang servers (slime's defaults but SGLANG_MEMORY_SAVER_CUDA_GRAPH, see above;
# values already set in the environment win).
SGLANG_ENV = {
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "false",
    "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "false",
    "SGLANG_DISABLE_TP_MEMORY_INBALANCE_CHECK": "true",
    "NCCL_CUMEM_ENABLE": "0",
    "SGLANG_LOG_MS": "true",
    # uvicorn closes a connection idle for 5 s by default; training and a weight sync take longer, and the rollout
    # client's pooled connections would be dead at the next rollout. An hour, as the embedded engine's server
    "SGLANG_TIMEOUT_KEEP_ALIVE": "3600",
}

# the server's module: SGLang's own, or with rollout.sglang_fast_start the same with its workers forked
LAUNCH_SERVER, FAST_START = "sglang.launch_server", "slime_hydra.rollout.engines.sglang.fast_start"

# float32 servers (see above); rollout.server_args and the environment win
FLOAT32_SERVER_ARGS = {"model_impl": "transformers"}
FLOAT32_ENV = {"TRITON_F32_DEFAULT": "ieee"}


class SglangEngine(Engine):
    # expandable segments break SGLang's memory saver (torch_memory_saver)
    unset_env = ("PYTORCH_CUDA_ALLOC_CONF",)

    @classmethod
    def check(cls, cfg: "RunConfig") -> List[str]:
        """CUDA only; ``rollout.server_args`` as ``args.server_args_problems`` checks it."""
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
        # tp_size counts the GPUs of all the engine's nodes (SGLang splits them by --nnodes).
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
        """``SGLANG_ENV``, and ``FLOAT32_ENV`` for a float32 server (values already in the environment win)."""
        env = {**SGLANG_ENV, **(FLOAT32_ENV if self.spec.dtype == "float32" else {})}
        return {**super().env(), **{k: os.environ.get(k, v) for k, v in env.items()}}

    @classmethod
    def startup_parts(cls, log_text: str, started: float, ready: float) -> Dict[str, float]:
        """Where the server's start went, from the timestamps of its log (``log_text``: what it wrote
        since it was started at ``started``, up at ``ready``, both ``time.time()``): seconds from the
        start to its first step of model set-up (``process_s``: interpreter, imports, the scheduler's
        process), then torch distributed, the weights, the KV cache, the CUDA graphs (kernel warm-up,
        Triton's compiles and the captures), the HTTP server, and the first answer to
        /health_generate. A part whose lines are missing is left out. ``kv_tokens``: the KV cache's size
        in tokens (SGLang sizes it from the GPU memory free when it measures: on a colocated GPU, the
        trainer's memory at that moment makes it smaller; compare the plan's estimate)."""
        marks: Dict[str, float] = {}
        captured = 0.0
        kv_tokens = None
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
            e = SGLANG_CAPTURE.search(m.group(2))
            if e:
                captured += float(e.group(1))
            k = SGLANG_KV_TOKENS.search(m.group(2))
            if k:
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
SGLANG_CAPTURE = re.compile(r"CUDA graph end\. elapsed=([\d.]+) s")
SGLANG_KV_TOKENS = re.compile(r"\bmax_total_num_tokens=(\d+)")
