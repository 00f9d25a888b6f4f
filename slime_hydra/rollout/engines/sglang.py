"""SGLang servers (``python -m sglang.launch_server``, through ``sglang_launch``, which overlaps its two
processes' imports, unless ``rollout.sglang_fork_workers=false``), slime's production engine.

``rollout.server_args`` is passed through to SGLang's ServerArgs (``mem_fraction_static: 0.7`` ->
``--mem-fraction-static 0.7``); the fields slime_hydra sets itself (``MANAGED_SERVER_ARGS``) are
refused in validation with the config key to use instead, and where sglang is installed, validation
checks the rest with sglang's own parser (``check_server_args``).

The project pins sglang 0.5.17 for GPUs (the newest release on torch 2.11). What it needs, seen on an
H200 (``../shared/reference/environment.md``), and what its start costs:
- No prefill CUDA graph unless ``rollout.server_args`` chooses one (``startup_server_args``): 0.5.17
  captures a "breakable" prefill graph by default for about 60 token counts up to 8192, which made the
  start 159 s instead of 45 s, and it refuses the memory saver of colocated engines when graph memory is
  to be released ("Breakable CUDA graph is not compatible with memory saver mode"). A rollout's prefill
  is a small part of its time.
- Decode CUDA graphs only for the batch sizes the run can send an engine (``ServerSpec.decode_batch``,
  from the plan's ``engine_batch``), rounded up to SGLang's own grid (``decode_graph_max_bs``), unless
  ``rollout.server_args`` sets them: SGLang's default on an H100/H200 captures 36 sizes up to 256.
- ``SGLANG_MEMORY_SAVER_CUDA_GRAPH`` is false: releasing CUDA-graph memory needs torch_memory_saver's
  preload hook mode ("Only hook_mode=preload supports pauseable CUDA Graph currently"). The decode
  graphs' memory then stays allocated while the trainer trains; weights and KV cache are released.
- SGLang's JIT kernels for the model built all at once beside the server's first start (``prebuild_command``,
  ``sglang_kernels``; ``rollout.sglang_prebuild_kernels``): a fresh H200 started in 55.75 s, another without it in
  111.22 s (one run each).
- ``SGLANG_LOG_MS``: the server log's timestamps have milliseconds, so ``startup_parts`` can say where
  the start went (imports, weights, KV cache, CUDA graphs, HTTP server).
- ``model.dtype=float32``: 0.5.17's native Qwen3 calls ``sgl_kernel``'s ``rmsnorm``, built for fp16 and bf16
  only, and a float32 server died capturing its decode CUDA graphs (on the H200; the kernel's dtype dispatch
  read in SGLang's source). Unless ``rollout.server_args`` sets ``model_impl``, float32 servers run the
  transformers implementation (SGLang's RMSNorm in torch for float32) with Triton's float32 dots in IEEE
  precision, not TF32 (``FLOAT32_SERVER_ARGS``, ``FLOAT32_ENV``). On the H200 such a server's log-probs were
  0.000008 from the float32 model's (``bench/measured/h200_logprob_gap.md``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from slime_hydra.config.deferred import defer
from slime_hydra.rollout.engines.base import Engine, to_flags

if TYPE_CHECKING:
    import argparse

    from slime_hydra.config.schema import RunConfig
    from slime_hydra.plan.resources import ResourcePlan

# ServerArgs fields set from the run config or the resource plan -> where they come from.
MANAGED_SERVER_ARGS: Dict[str, str] = {
    "model_path": "model.path",
    "tokenizer_path": "model.tokenizer",
    "trust_remote_code": "model.trust_remote_code",
    "host": "the engine's node address",
    "port": "a free port on the engine's node",
    "tp_size": "parallelism.gpus_per_engine",
    "base_gpu_id": "the placement group",
    "random_seed": "rollout.seed",
    "enable_memory_saver": "parallelism.offload_rollout",
    "nnodes": "parallelism.gpus_per_engine / gpus_per_node",
    "node_rank": "the placement group",
    "dist_init_addr": "the placement group",
    "nccl_port": "a free port on the engine's node",
    "skip_server_warmup": "slime_hydra (always on)",
}

# Environment for SGLang servers (slime's defaults but SGLANG_MEMORY_SAVER_CUDA_GRAPH, see above;
# values already set in the environment win).
SGLANG_ENV = {
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "false",
    "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "false",
    "SGLANG_DISABLE_TP_MEMORY_INBALANCE_CHECK": "true",
    "NCCL_CUMEM_ENABLE": "0",
    "SGLANG_LOG_MS": "true",
    # uvicorn closes a connection idle for 5 s by default; a big model's training and weight sync take longer, so
    # the rollout client's pooled connections were dead at the next rollout: "Server disconnected", a retry, 1.5 s
    # lost (the Qwen3-4B shape on the H200). An hour, as the embedded engine's server
    "SGLANG_TIMEOUT_KEEP_ALIVE": "3600",
}

# the server's module: SGLang's own, or (rollout.sglang_fork_workers) sglang.launch_server with its workers forked
# from a process that imported most of their code while the server imported its own (sglang_launch says how)
LAUNCH_SERVER, FORKING_LAUNCHER = "sglang.launch_server", "slime_hydra.rollout.engines.sglang_launch"
# builds the server's JIT kernels beside its start (rollout.sglang_prebuild_kernels; sglang_kernels says why)
KERNEL_BUILDER = "slime_hydra.rollout.engines.sglang_kernels"

# float32 servers (see above); rollout.server_args and the environment win
FLOAT32_SERVER_ARGS = {"model_impl": "transformers"}
FLOAT32_ENV = {"TRITON_F32_DEFAULT": "ieee"}


# rollout.server_args keys that choose the prefill CUDA graph (sglang 0.5.17's names and deprecated aliases):
# with any of them set, the engines keep the user's choice.
PREFILL_GRAPH_KEYS = ("disable_prefill_cuda_graph", "cuda_graph_backend_prefill", "cuda_graph_config",
                      "disable_cuda_graph", "enable_breakable_cuda_graph", "disable_piecewise_cuda_graph",
                      "enforce_piecewise_cuda_graph")
# ... and the decode CUDA graphs' batch sizes (cuda_graph_max_bs and cuda_graph_bs: 0.5.17's deprecated aliases)
DECODE_GRAPH_KEYS = ("cuda_graph_max_bs_decode", "cuda_graph_bs_decode", "cuda_graph_max_bs", "cuda_graph_bs",
                     "cuda_graph_config", "cuda_graph_backend_decode", "disable_decode_cuda_graph",
                     "disable_cuda_graph", "disable_cuda_graph_padding")
# SGLang's default largest decode graph on a GPU of 90-160 GB (H100, H200) below TP 4 (ServerArgs.
# _handle_gpu_memory_settings); a run that can use as many sequences keeps SGLang's default.
SGLANG_DEFAULT_DECODE_MAX_BS = 256


def decode_graph_sizes(max_bs: int) -> List[int]:
    """The decode batch sizes sglang 0.5.17 captures for ``cuda_graph_max_bs_decode=max_bs``
    (``ServerArgs._generate_decode_cuda_graph_batch_sizes``, no speculative decoding, with padding)."""
    grid = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    sizes = [b for b in grid if b <= max_bs]
    return sizes if max_bs in sizes else [*sizes, max_bs]


def decode_graph_max_bs(batch: int) -> int:
    """The smallest size of SGLang's grid that holds ``batch`` sequences: a batch in between is padded
    up to the next captured size, so capturing up to ``batch`` itself would add a size of its own."""
    grid = decode_graph_sizes(max(batch, 512) + 32)
    return next(b for b in grid if b >= batch)


# The ``mem_fraction_static`` SGLang starts with where the KV pool is held to the plan's count (``max_total_tokens``)
# and the engine keeps its memory while the trainer trains (no ``parallelism.offload_rollout``), so that the plan's
# training phase counts the trainer's peak beside the whole engine. SGLang sizes its pool as the memory free once its
# weights are loaded less (1 - mem_fraction_static) of the memory free before they were. A colocated trainer that grew
# in between (likely its warm-up) takes its growth out of the pool: a megatron run's engine got 64 tokens at 0.3 on the
# H200; one that shrank gave a torch run's engine more than the plan (bench/measured/h200_kv_cap.md). At 0.9 the pool
# reaches the plan's count unless the GPU is nearly full as SGLang starts. With offload_rollout the user's fraction
# stays: the plan counts the engine and the trainer's peak in different phases, not both at once as they are then.
CAPPED_MEM_FRACTION = 0.9


def startup_server_args(server_args: Dict[str, Any], decode_batch: Optional[int],
                        kv_tokens: Optional[int] = None) -> Dict[str, Any]:
    """What slime_hydra adds to ``server_args`` to start a server in less time: no prefill CUDA
    graph, unless the user chose one (a key of ``PREFILL_GRAPH_KEYS``); decode graphs up to
    ``decode_batch`` (the plan's ``engine_batch``) rounded up to SGLang's grid, unless the user chose
    them (``DECODE_GRAPH_KEYS``) or the run can use SGLang's default (or more). And on a GPU shared with a
    trainer, the KV pool held to the plan's ``kv_tokens`` (``max_total_tokens``, unless the user set it: SGLang
    takes the smaller of it and what it finds free; ``launch_server_args`` may raise ``mem_fraction_static`` to
    reach it)."""
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
    """``server_args`` with ``startup_server_args`` added where it sets nothing, and, when the KV pool is held to
    the plan's count and the engine stays resident (``engine_resident``: no ``offload_rollout``),
    ``mem_fraction_static`` at least ``CAPPED_MEM_FRACTION``: the user's fraction has set that count (the plan's pool
    is ``mem_fraction_static`` of the GPU less the weights)."""
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
    """The plan print-out's line on what the servers capture at start and the KV pool's cap
    (``startup_server_args``, ``launch_server_args``)."""
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


class SglangEngine(Engine):
    # expandable segments break SGLang's memory saver (torch_memory_saver)
    unset_env = ("PYTORCH_CUDA_ALLOC_CONF",)

    @classmethod
    def check(cls, cfg: "RunConfig") -> List[str]:
        """CUDA only; ``rollout.server_args`` holds none of the keys slime_hydra sets itself and, where sglang
        is installed, only what its own ServerArgs parser accepts."""
        import importlib.util
        import logging

        errs = [] if cfg.parallelism.device == "cuda" else [
            "rollout.engine: sglang needs parallelism.device=cuda (use rollout=embedded on CPU)"]
        args = cfg.rollout.server_args
        errs += [f"rollout.server_args.{key}: set by slime_hydra from {MANAGED_SERVER_ARGS[key]}; remove it"
                 for key in args if key in MANAGED_SERVER_ARGS]
        if args and importlib.util.find_spec("sglang") is not None:
            if "sglang.srt.server_args" not in sys.modules and defer(lambda: ServerArgsCheck(dict(args))):
                return errs  # answered while the run starts (config/deferred.py)
            try:
                errs += [f"rollout.server_args.{key}: {problem}" for key, problem in check_server_args(dict(args))]
            except Exception as e:  # noqa: BLE001 - an sglang that does not import: the server will say more
                logging.getLogger(__name__).warning("rollout.server_args not checked: sglang's ServerArgs did not "
                                                    "import (%s: %s)", type(e).__name__, e)
        return errs

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
        return [sys.executable, "-m", FORKING_LAUNCHER if s.fork_workers else LAUNCH_SERVER, *to_flags(args)]

    def prebuild_command(self, report_path: str) -> Optional[List[str]]:
        s = self.spec
        if not s.prebuild_kernels or s.device != "cuda" or s.dtype == "float32":  # float32: other kernels (above)
            return None
        return [sys.executable, "-m", KERNEL_BUILDER, "--model-path", s.model_path, "--dtype", s.dtype,
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


@functools.lru_cache(maxsize=1)
def sglang_parser() -> "argparse.ArgumentParser":
    """The installed sglang's server argument parser (its own ``ServerArgs.add_cli_args``), built once.
    Raises ImportError when sglang is not installed."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def sglang_version() -> str:
    import sglang

    return str(getattr(sglang, "__version__", "?"))


def check_with_sglang(argv: List[str]) -> Optional[str]:
    """Parse a server command line (without ``python -m sglang.launch_server``) with the installed
    sglang's own ServerArgs parser. Returns None when it parses, an error message when it does not,
    and raises ImportError when sglang is not installed.

    Only the parser runs: it knows every flag, its type and its choices. The ServerArgs constructor,
    whose cross-field rules would say more, reads the model's config (sglang 0.5.17 asks the Hugging
    Face hub for it: validation failed offline with "couldn't connect to huggingface.co"), so those
    rules are left to the server's start."""
    import argparse
    import io

    parser = sglang_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(argv)
    except SystemExit:  # unrecognized or missing arguments: argparse prints, then exits
        lines = err.getvalue().strip().splitlines()
        return lines[-1].split("error: ", 1)[-1] if lines else "rejected by sglang"
    except argparse.ArgumentError as e:  # bad type or choice (exit_on_error=False)
        return str(e)
    return None


def check_server_args(server_args: Dict[str, Any]) -> List[Tuple[str, str]]:
    """``rollout.server_args`` checked one key at a time by the installed sglang's own parser, as
    ``to_flags`` passes it: [(key, problem)]. Keys of MANAGED_SERVER_ARGS are left to validation's own
    rule. Raises ImportError when sglang is not installed.

    A process that has not imported sglang yet (the driver, validating) checks in a child process:
    importing sglang patches transformers and sets cache variables (TRITON_CACHE_DIR,
    TORCHINDUCTOR_CACHE_DIR, ...) that the Ray workers started from this process would inherit."""
    if "sglang.srt.server_args" in sys.modules:
        return _check_server_args_here(server_args)
    return _check_server_args_in_child(server_args)


def _check_server_args_in_child(server_args: Dict[str, Any]) -> List[Tuple[str, str]]:
    return ServerArgsCheck(server_args).result()


def cache_dir() -> str:
    """Where slime_hydra keeps what it can work out again (``$SLIME_HYDRA_CACHE``, else
    ``$XDG_CACHE_HOME/slime_hydra``, else ``~/.cache/slime_hydra``)."""
    return os.environ.get("SLIME_HYDRA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "slime_hydra")


def _answer_path(sglang_dirs: List[str], server_args: Dict[str, Any]) -> Optional[str]:
    """The cache file of the parser's answer for these arguments, this sglang and this module; None if sglang's
    ``server_args.py`` is not a file (nothing is cached)."""
    import hashlib
    import json

    source = next((f for d in sglang_dirs if os.path.isfile(f := os.path.join(d, "sglang", "srt", "server_args.py"))),
                  None)
    if source is None:
        return None
    # the answer is sglang's parser's, read by this module's rules (MANAGED_SERVER_ARGS, the messages): both files
    files = [(os.path.realpath(f), st.st_size, st.st_mtime_ns) for f in (source, os.path.abspath(__file__))
             for st in [os.stat(f)]]
    key = json.dumps([files, server_args], sort_keys=True, default=str)
    return os.path.join(cache_dir(), "sglang_server_args", hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _read_answer(path: Optional[str]) -> Optional[List[Tuple[str, str]]]:
    import json

    try:
        with open(path) as f:
            return [tuple(pair) for pair in json.load(f)]
    except (TypeError, OSError, ValueError):  # no path, no file, a file from an older layout: ask the parser
        return None


def _write_answer(path: Optional[str], answer: List[Tuple[str, str]]) -> None:
    import json

    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(answer, f)
        os.replace(tmp, path)
    except OSError:  # a read-only home: the next run asks the parser again
        pass


class ServerArgsCheck:
    """``check_server_args`` in a child process, started at once and answered by ``result`` (importing
    sglang's ServerArgs takes 10-25 s: torch, transformers and sglang's own modules).

    An answer is kept in ``cache_dir()`` under the installed sglang (its ``server_args.py``: path, size, mtime),
    this module (which reads the parser's answer) and the arguments: the parser is the same for the same files,
    so the next run with the same ``rollout.server_args`` starts no child and does not wait for one (7-10 s of a
    GPU run's start-up, between Ray's start and the engines')."""

    def __init__(self, server_args: Dict[str, Any]):
        import importlib.util
        import json
        import subprocess
        import tempfile

        spec = importlib.util.find_spec("sglang")
        if spec is None:
            raise ImportError("sglang is not installed")
        # the child sees the sglang this process sees, and this slime_hydra
        paths = [os.path.dirname(p) for p in (spec.submodule_search_locations or [])]
        self.proc: Optional["subprocess.Popen"] = None
        self.cache_path = _answer_path(paths, server_args)
        self.cached = _read_answer(self.cache_path)
        if self.cached is not None:
            return
        import slime_hydra

        paths.append(os.path.dirname(os.path.dirname(os.path.abspath(slime_hydra.__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])}
        # its output to files, not pipes: nobody reads them before ``result``, and a full pipe would stop it
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "slime_hydra.rollout.engines.sglang"],
                                     stdin=subprocess.PIPE, stdout=self.out, stderr=self.err, text=True, env=env)
        self.proc.stdin.write(json.dumps(server_args, default=str))
        self.proc.stdin.close()

    def result(self, timeout: float = 600.0) -> List[Tuple[str, str]]:
        """[(key, problem)]; raises ImportError when sglang's parser did not run."""
        import json

        if self.cached is not None:
            return self.cached
        try:
            self.proc.wait(timeout=timeout)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise
        self.out.seek(0)
        self.err.seek(0)
        out, err = self.out.read(), self.err.read()
        if self.proc.returncode != 0:
            tail = err.strip().splitlines()[-1:] or [f"exit status {self.proc.returncode}"]
            raise ImportError(f"sglang's parser failed in a child process: {tail[0]}")
        self.cached = [tuple(pair) for pair in json.loads(out.strip().splitlines()[-1])]
        _write_answer(self.cache_path, self.cached)
        return self.cached

    def kill(self) -> None:
        """Not needed any more (validation failed anyway)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def problems(self) -> List[str]:
        """``result`` as validation's problems (``rollout.server_args.<key>: ...``); [] with a warning when
        sglang's parser did not run (the server will say more)."""
        try:
            return [f"rollout.server_args.{key}: {problem}" for key, problem in self.result()]
        except ImportError as e:
            import logging

            logging.getLogger(__name__).warning("rollout.server_args not checked: sglang's ServerArgs did not "
                                                "import (%s)", e)
            return []


def _check_server_args_here(server_args: Dict[str, Any]) -> List[Tuple[str, str]]:
    import argparse
    import difflib

    parser = sglang_parser()
    actions = {s: a for a in parser._actions for s in a.option_strings}
    version = sglang_version()
    problems: List[Tuple[str, str]] = []
    for key, value in server_args.items():
        if key in MANAGED_SERVER_ARGS:
            continue
        flag = "--" + key.replace("_", "-")
        action = actions.get(flag)
        if action is None:
            names = sorted({a.dest for a in parser._actions if a.dest != "help"})
            close = difflib.get_close_matches(key, names, n=3, cutoff=0.75)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            problems.append((key, f"not a ServerArgs option of sglang {version} (no {flag}){hint}"))
            continue
        if action.dest in MANAGED_SERVER_ARGS:
            problems.append((key, f"{flag} is sglang's alias of {action.dest}, set by slime_hydra from "
                                  f"{MANAGED_SERVER_ARGS[action.dest]}; remove it"))
            continue
        if value is False and action.nargs != 0:
            problems.append((key, f"false is left off the command line, and {flag} takes a value; "
                                  "give one or remove the key"))
            continue
        if value is False and isinstance(action, argparse.BooleanOptionalAction) and action.default is not False:
            problems.append((key, "false is left off the command line, which keeps sglang's default "
                                  f"({action.default}); write no_{key}: true for --no-{flag[2:]}"))
            continue
        err = check_with_sglang(["--model-path", "model", *to_flags({key: value})])
        if err is not None:
            problems.append((key, f"{err} (sglang {version})"))
    return problems


if __name__ == "__main__":  # check_server_args in a child process: JSON server_args on stdin -> [[key, problem]]
    import json

    _reply, sys.stdout = sys.stdout, sys.stderr  # whatever sglang prints stays off the reply
    _args = json.load(sys.stdin)
    _reply.write(json.dumps(_check_server_args_here(_args)) + "\n")
