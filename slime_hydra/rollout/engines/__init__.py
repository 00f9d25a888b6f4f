"""Rollout engines, by ``rollout.engine``: ``ENGINES`` names each one's ``Engine`` subclass, imported only when
a run uses it. A new engine: a module here with an ``Engine`` subclass, its line in ``ENGINES``, a preset in
``conf/rollout/``.
"""

from __future__ import annotations

from typing import List, Optional, Type

from slime_hydra.rollout.engines.base import Engine, ServerSpec, to_flags
from slime_hydra.utils.registry import LazyRegistry

ENGINES = LazyRegistry("engine", {
    "embedded": "slime_hydra.rollout.engines.embedded:EmbeddedEngine",
    "sglang": "slime_hydra.rollout.engines.sglang.engine:SglangEngine",
})


def engine_class(name: str) -> Type[Engine]:
    if name not in ENGINES:
        raise ValueError(f"rollout.engine: {name!r} is not one of {sorted(ENGINES)}")
    return ENGINES[name]


def make_engine(spec: ServerSpec) -> Engine:
    return engine_class(spec.engine)(spec)


def server_command(spec: ServerSpec, host: str, port: int, base_gpu_id: int = 0,
                   nccl_port: Optional[int] = None) -> List[str]:
    """The command line of ``spec``'s server (``Engine.command`` of its engine class)."""
    return make_engine(spec).command(host, port, base_gpu_id, nccl_port)


__all__ = ["ENGINES", "Engine", "ServerSpec", "engine_class", "make_engine", "server_command", "to_flags"]
