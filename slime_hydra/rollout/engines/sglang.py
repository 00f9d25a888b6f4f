"""SGLang servers (``python -m sglang.launch_server``), slime's production engine.

``rollout.server_args`` is passed through to SGLang's ServerArgs (``mem_fraction_static: 0.7`` ->
``--mem-fraction-static 0.7``); the fields slime_hydra sets itself (``MANAGED_SERVER_ARGS``) are
refused in validation with the config key to use instead, and where sglang is installed, validation
checks the rest with sglang's own parser (``check_server_args``).

The project pins sglang 0.5.17 for GPUs (the newest release on torch 2.11). What it needs, seen on an
H200 (``../shared/reference/environment.md``):
- With the memory saver (colocated engines), the prefill CUDA graph is turned off unless
  ``rollout.server_args`` says otherwise (``colocated_server_args``): 0.5.17 captures a "breakable"
  prefill graph by default, which refuses the memory saver when graph memory is to be released
  ("Breakable CUDA graph is not compatible with memory saver mode"), and capturing it made the start
  159 s instead of 45 s.
- ``SGLANG_MEMORY_SAVER_CUDA_GRAPH`` is false: releasing CUDA-graph memory needs torch_memory_saver's
  preload hook mode ("Only hook_mode=preload supports pauseable CUDA Graph currently"). The decode
  graphs' memory then stays allocated while the trainer trains; weights and KV cache are released.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from slime_hydra.rollout.engines.base import Engine, to_flags

if TYPE_CHECKING:
    import argparse

    from slime_hydra.config.schema import RunConfig

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
}


# rollout.server_args keys that choose the prefill CUDA graph (sglang 0.5.17's names and deprecated aliases):
# with any of them set, colocated engines keep the user's choice.
PREFILL_GRAPH_KEYS = ("disable_prefill_cuda_graph", "cuda_graph_backend_prefill", "cuda_graph_config",
                      "disable_cuda_graph", "enable_breakable_cuda_graph", "disable_piecewise_cuda_graph",
                      "enforce_piecewise_cuda_graph")


def colocated_server_args(server_args: Dict[str, Any]) -> Dict[str, Any]:
    """What a server with the memory saver adds to ``server_args``: no prefill CUDA graph, unless
    the user chose one (a key of ``PREFILL_GRAPH_KEYS``)."""
    if any(key in server_args for key in PREFILL_GRAPH_KEYS):
        return {}
    return {"disable_prefill_cuda_graph": True}


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
            try:
                errs += [f"rollout.server_args.{key}: {problem}" for key, problem in check_server_args(dict(args))]
            except Exception as e:  # noqa: BLE001 - an sglang that does not import: the server will say more
                logging.getLogger(__name__).warning("rollout.server_args not checked: sglang's ServerArgs did not "
                                                    "import (%s: %s)", type(e).__name__, e)
        return errs

    def command(self, host: str, port: int, base_gpu_id: int = 0, nccl_port: Optional[int] = None) -> List[str]:
        s = self.spec
        multi = s.nnodes > 1
        # tp_size counts the GPUs of all the engine's nodes (SGLang splits them by --nnodes).
        args = {**self.common_args(host, port, base_gpu_id), "tp_size": s.gpus, "enable_memory_saver": s.memory_saver,
                "skip_server_warmup": True, "nccl_port": nccl_port, "nnodes": s.nnodes if multi else None,
                "node_rank": s.node_rank if multi else None, "dist_init_addr": s.dist_init_addr,
                "dtype": s.dtype if s.dtype != "float32" else None,
                **(colocated_server_args(s.server_args) if s.memory_saver else {}), **s.server_args}
        return [sys.executable, "-m", "sglang.launch_server", *to_flags(args)]

    def env(self) -> Dict[str, str]:
        """``SGLANG_ENV`` (values already in the environment win)."""
        return {**super().env(), **{k: os.environ.get(k, v) for k, v in SGLANG_ENV.items()}}


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
    import contextlib
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
    import importlib.util
    import json
    import subprocess

    spec = importlib.util.find_spec("sglang")
    if spec is None:
        raise ImportError("sglang is not installed")
    # the child sees the sglang this process sees, and this slime_hydra
    paths = [os.path.dirname(p) for p in (spec.submodule_search_locations or [])]
    import slime_hydra

    paths.append(os.path.dirname(os.path.dirname(os.path.abspath(slime_hydra.__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-m", "slime_hydra.rollout.engines.sglang"],
                         input=json.dumps(server_args, default=str), capture_output=True, text=True, env=env,
                         timeout=600)
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or [f"exit status {out.returncode}"]
        raise ImportError(f"sglang's parser failed in a child process: {tail[0]}")
    return [tuple(pair) for pair in json.loads(out.stdout.strip().splitlines()[-1])]


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
