"""Command lines for rollout servers: SGLang (``python -m sglang.launch_server``) or the embedded
engine, which takes the same flag names. ``rollout.server_args`` is passed through to SGLang's
ServerArgs (``mem_fraction_static: 0.7`` -> ``--mem-fraction-static 0.7``); the fields slime_hydra
sets itself are refused in validation with the config key to use instead."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

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

# Environment for SGLang servers (slime's defaults; values already set in the environment win).
SGLANG_ENV = {
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true",
    "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "false",
    "SGLANG_DISABLE_TP_MEMORY_INBALANCE_CHECK": "true",
    "NCCL_CUMEM_ENABLE": "0",
}


@dataclass
class ServerSpec:
    """Everything one engine's server command needs."""

    engine: str  # embedded | sglang
    model_path: str
    tokenizer_path: Optional[str]
    dtype: str
    device: str  # cpu | cuda
    gpus: int
    seed: int
    trust_remote_code: bool = False
    memory_saver: bool = False
    max_batch: int = 256
    num_threads: Optional[int] = None  # embedded engine on CPU: torch threads
    server_args: Dict[str, Any] = field(default_factory=dict)
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = None


def to_flags(args: Dict[str, Any]) -> List[str]:
    """{"mem_fraction_static": 0.7, "enable_x": True, "stop": [1, 2]} -> ["--mem-fraction-static", "0.7", ...]"""
    out: List[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        elif isinstance(value, dict):
            import json

            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def server_command(spec: ServerSpec, host: str, port: int, base_gpu_id: int = 0, nccl_port: Optional[int] = None) -> List[str]:
    common = {"model_path": spec.model_path, "tokenizer_path": spec.tokenizer_path, "host": host, "port": port,
              "random_seed": spec.seed, "trust_remote_code": spec.trust_remote_code, "base_gpu_id": base_gpu_id}
    if spec.engine == "embedded":
        args = {**common, "dtype": spec.dtype, "device": spec.device, "max_running_requests": spec.max_batch,
                "num_threads": spec.num_threads}
        return [sys.executable, "-m", "slime_hydra.rollout.embedded.server", *to_flags(args)]
    args = {**common, "tp_size": spec.gpus // spec.nnodes if spec.nnodes > 1 else spec.gpus,
            "enable_memory_saver": spec.memory_saver, "skip_server_warmup": True, "nccl_port": nccl_port,
            "nnodes": spec.nnodes if spec.nnodes > 1 else None, "node_rank": spec.node_rank if spec.nnodes > 1 else None,
            "dist_init_addr": spec.dist_init_addr, "dtype": spec.dtype if spec.dtype != "float32" else None,
            **spec.server_args}
    if spec.nnodes > 1:
        args["tp_size"] = spec.gpus
    return [sys.executable, "-m", "sglang.launch_server", *to_flags(args)]


def check_with_sglang(argv: List[str]) -> Optional[str]:
    """Parse a server command line with the installed sglang's own ServerArgs parser.
    Returns None when it parses, an error message when it does not, and raises ImportError when
    sglang is not installed."""
    import argparse
    import contextlib
    import io

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(argv)
        ServerArgs.from_cli_args(ns)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "rejected by sglang"
    except (argparse.ArgumentError, ValueError, TypeError) as e:
        return str(e)
    return None
