"""Rollout engine backends, by ``rollout.engine``: ``ENGINES`` names each one's class as
``"module:Class"``, imported only when a run uses it (like verl's rollout registry), so naming the
engines costs no import. The interface is ``slime_hydra.rollout.engines.base.Engine``.

A new engine: one module here with an ``Engine`` subclass, its line in ``ENGINES``, and a preset in
``conf/rollout/``.
"""

from __future__ import annotations

import importlib
from typing import Dict, List, Optional, Type

from slime_hydra.rollout.engines.base import Engine, ServerSpec, to_flags

ENGINES: Dict[str, str] = {
    "embedded": "slime_hydra.rollout.engines.embedded:EmbeddedEngine",
    "sglang": "slime_hydra.rollout.engines.sglang:SglangEngine",
}


def engine_class(name: str) -> Type[Engine]:
    """The engine class registered as ``name`` (imported now)."""
    if name not in ENGINES:
        raise ValueError(f"rollout.engine: {name!r} is not one of {sorted(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_engine(spec: ServerSpec) -> Engine:
    return engine_class(spec.engine)(spec)


def server_command(spec: ServerSpec, host: str, port: int, base_gpu_id: int = 0,
                   nccl_port: Optional[int] = None) -> List[str]:
    """The command line of ``spec``'s server (``Engine.command`` of its engine class)."""
    return make_engine(spec).command(host, port, base_gpu_id, nccl_port)


__all__ = ["ENGINES", "Engine", "ServerSpec", "engine_class", "make_engine", "server_command", "to_flags"]
