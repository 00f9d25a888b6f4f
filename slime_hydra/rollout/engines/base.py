"""The interface of a rollout engine backend: how its server is started (command line, environment). Once up,
every engine is a server that speaks SGLang's HTTP protocol; the engine actor owns its process.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    from slime_hydra.config.schema import RunConfig
    from slime_hydra.plan.resources import ResourcePlan


@dataclass
class ServerSpec:
    """Everything one engine's server command needs (built from the config by ``fleet.engine_specs``)."""

    engine: str  # a key of slime_hydra.rollout.engines.ENGINES
    model_path: str
    tokenizer_path: Optional[str]
    dtype: str
    device: str  # cpu | cuda
    gpus: int
    seed: int
    trust_remote_code: bool = False
    memory_saver: bool = False
    max_batch: int = 256  # embedded engine: most sequences decoded together (rollout.embedded_max_batch)
    decode_batch: Optional[int] = None  # most sequences the run decodes at once on this engine (plan.engine_batch)
    kv_tokens: Optional[int] = None  # sglang on a shared GPU: its KV pool's cap (plan.engine_kv_cap)
    num_threads: Optional[int] = None  # embedded engine on CPU: torch threads
    server_args: Dict[str, Any] = field(default_factory=dict)
    fast_start: bool = False  # sglang: its start-up work (rollout.sglang_fast_start; sglang/fast_start.py)
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
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


class Engine(ABC):
    """One kind of rollout engine (``rollout.engine``): a subclass named in ``ENGINES``, plus a ``conf/rollout/``
    preset."""

    # variables removed from the engine actor's environment (which the server inherits) before the server starts
    unset_env: ClassVar[Tuple[str, ...]] = ()

    def __init__(self, spec: ServerSpec):
        self.spec = spec

    @classmethod
    def check(cls, cfg: "RunConfig") -> List[str]:
        """This engine's config rules: problems as ``<dotted.path>: <what is wrong>``."""
        return []

    @abstractmethod
    def command(self, host: str, port: int, base_gpu_id: int = 0, nccl_port: Optional[int] = None) -> List[str]:
        """The server's command line, serving HTTP on ``host:port`` from GPU ``base_gpu_id`` on
        (``nccl_port``: a free port for the server's own NCCL group, where it has one)."""

    def prebuild_command(self, report_path: str) -> Optional[List[str]]:
        """A command run beside the server's first start to prepare what the server would otherwise build itself
        (SGLang: its kernels), writing a JSON report to ``report_path``; None: nothing to prepare."""
        return None

    @classmethod
    def plan_notes(cls, cfg: "RunConfig", plan: "ResourcePlan") -> List[str]:
        """Lines for the plan print-out: what this engine's servers are set to do at start."""
        return []

    @classmethod
    def startup_parts(cls, log_text: str, started: float, ready: float) -> Dict[str, float]:
        """Seconds of each part of the server's start, from its log (``log_text``, written since ``started``; up at
        ``ready``; both ``time.time()``); {}: it does not tell."""
        return {}

    @classmethod
    def log_note(cls, status: str, stood: float) -> Optional[str]:
        """A word on why, for a server whose last log line ``status`` has stood ``stood`` s while the run starts;
        None: nothing to say."""
        return None

    def env(self) -> Dict[str, str]:
        """Environment for the server on top of the actor's (on GPUs NCCL's cuMem off, as the trainer has it)."""
        return {"NCCL_CUMEM_ENABLE": os.environ.get("NCCL_CUMEM_ENABLE", "0")} if self.spec.device == "cuda" else {}

    def common_args(self, host: str, port: int, base_gpu_id: int) -> Dict[str, Any]:
        """The flags every engine takes under SGLang's names."""
        s = self.spec
        return {"model_path": s.model_path, "tokenizer_path": s.tokenizer_path, "host": host, "port": port,
                "random_seed": s.seed, "trust_remote_code": s.trust_remote_code, "base_gpu_id": base_gpu_id}
