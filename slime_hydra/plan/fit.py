"""Choices the plan makes so that a run fits its GPUs: what colocated GPUs offload when the config leaves
it unset. It sits above the estimate (``memory.py``) and the layout (``resources.py``) and uses both."""

from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

from slime_hydra.plan.memory import AUTO_OFFLOAD_HEADROOM, OFFLOAD_CHOICES, colocated_peaks
from slime_hydra.plan.resources import make_plan

if TYPE_CHECKING:
    from slime_hydra.config.schema import RunConfig


def choose_offload(cfg: "RunConfig") -> Tuple[bool, bool]:
    """(offload_train, offload_rollout) for colocated GPUs, keeping a value the config sets: the first of
    ``OFFLOAD_CHOICES`` whose peak leaves ``AUTO_OFFLOAD_HEADROOM`` of the GPU free, else the most offload.
    With nothing offloaded, a step moves no memory and the weight push reads the trainer's GPU tensors."""
    p = cfg.parallelism
    fixed = (p.offload_train, p.offload_rollout)
    allowed = [c for c in OFFLOAD_CHOICES if all(f is None or f == v for f, v in zip(fixed, c))]
    try:
        peaks = colocated_peaks(cfg, make_plan(cfg))
    except (ArithmeticError, ValueError):  # a layout that validation refuses (and says why): offload meanwhile
        return allowed[-1]
    limit = (1 - AUTO_OFFLOAD_HEADROOM) * p.gpu_memory_gib
    return next((c for c in allowed if peaks[c] <= limit), allowed[-1])


def resolve_offload(cfg: "RunConfig") -> "RunConfig":
    """Fill the offload of colocated GPUs that ``config.resolve`` leaves unset (``choose_offload``: it
    needs the resolved config and the plan, which ``config`` may not import). In place; returns ``cfg``."""
    p = cfg.parallelism
    if None in (p.offload_train, p.offload_rollout):
        p.offload_train, p.offload_rollout = choose_offload(cfg)
    return cfg
