"""Config rules of the weight sync (``sync.*``): which transport carries the trainer's weights to the
engines, and where each one works."""

from __future__ import annotations

from typing import List

from slime_hydra.config.rules import choice
from slime_hydra.config.schema import RunConfig

# NCCL/gloo broadcast | CUDA IPC or shared-memory handles (same device) | safetensors files on a shared disk
TRANSPORTS = ["distributed", "tensor", "disk"]


def check(cfg: RunConfig) -> List[str]:
    errs: List[str] = []
    s, p = cfg.sync, cfg.parallelism
    choice(errs, "sync.transport", s.transport, TRANSPORTS)
    if not s.push_timeout_s > 0:
        errs.append(f"sync.push_timeout_s: must be > 0 seconds, got {s.push_timeout_s}")
    if s.transport == "tensor" and not p.colocate:
        errs.append("sync.transport: 'tensor' shares memory between processes on the same device, so it needs "
                    "parallelism.colocate=true")
    if s.transport == "tensor" and p.colocate and p.num_nodes > 1:  # 'auto' resolves to 'tensor' when colocated
        errs.append(f"sync.transport: 'tensor' (the colocated default) hands the engines CUDA IPC / shared-memory "
                    f"handles, which cannot cross nodes, but parallelism.num_nodes={p.num_nodes}; use "
                    "parallelism.colocate=false or sync.transport=disk (on a filesystem shared by the nodes)")
    return errs
