"""The weight push as the step loop makes it: who takes turns on a colocated GPU around it (``Offload``), the
push to the engines running now, and the waits that keep weights from changing under a rollout."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import ray

from slime_hydra.sync import WeightSyncError

log = logging.getLogger("slime_hydra")


@dataclass(frozen=True)
class Offload:
    """What takes turns on colocated GPUs (``parallelism.offload_train`` / ``offload_rollout``), and whether
    the push reads the trainer's weights before they go to the host (``push_before_offload``)."""

    trainer: bool = False
    engines: bool = False
    push_first: bool = False

    @classmethod
    def from_config(cls, cfg) -> "Offload":
        p = cfg.parallelism
        trainer = bool(p.colocate and p.offload_train)
        return cls(trainer=trainer, engines=bool(p.colocate and p.offload_rollout),
                   push_first=trainer and bool(p.push_before_offload))


def push_weights(manager, trainers, version: int, offload: Offload = Offload(), fault_tolerance: bool = False,
                 on_retry: Optional[Callable[[], None]] = None, reconnect: bool = False) -> Dict[str, float]:
    """Trainer -> engines, weight version ``version``, never two copies of the weights and a KV cache on a GPU:
    the trainer offloads (``push_first``: all but its weights) or frees its cache, the engines take back their
    weights, the push, then the trainer's weights go and the engines take back their KV cache.

    With fault tolerance the push goes to the engines running now (reconnecting when that set changed), and a
    failed push goes again once the fleet has restarted the engines that did not answer."""
    if offload.trainer:
        trainers.offload(keep_weights=offload.push_first)
    elif offload.engines:  # the trainer stays: its allocator gives back what training freed
        trainers.free_cache()
    if offload.engines:
        ray.get(manager.onload_weights.remote())
    tries = 0
    while True:
        try:
            if fault_tolerance:
                endpoints = ray.get(manager.weight_endpoints.remote(tries > 0))  # after a failure: probe them too
                if reconnect or tries > 0 or [e["url"] for e in endpoints] != trainers.connected:
                    trainers.reconnect(endpoints)
            sync = trainers.update_weights(version)
            break
        except WeightSyncError as e:
            tries += 1
            if not fault_tolerance or tries > len(trainers.connected) + 2:
                raise
            log.warning("%s\n-> checking the engines, restarting those that failed, and pushing again",
                        getattr(e, "cause", e))  # the trainer's error, without Ray's traceback
            if on_retry is not None:
                on_retry()
    if offload.trainer and offload.push_first:
        trainers.offload()
    if offload.engines:
        ray.get(manager.onload_kv.remote())
    if fault_tolerance:
        ray.get(manager.weights_pushed.remote(version))
    return sync


def wait_rollout(rollout, manager, trainers, version: int, restore_engines: bool, check=lambda: None):
    """The rollout's result; ``check()`` is called while it runs (a preemption drops it there). ``restore_engines``
    (fault tolerance, sync runs: the idle trainers hold the rollout's weights): an engine restarted during the
    rollout gets those weights at once and serves the rest of it."""
    while not ray.wait([rollout], timeout=1.0 if restore_engines else 0.2)[0]:
        check()
        endpoints = ray.get(manager.awaiting_weights.remote()) if restore_engines else None
        if endpoints:
            try:
                trainers.reconnect(endpoints)
                trainers.update_weights(version)
            except WeightSyncError as e:  # an engine failed again: the fleet restarts it, and we come back here
                log.warning("%s; pushing again once the engines are checked", getattr(e, "cause", e))
                continue
            joined = ray.get(manager.weights_pushed.remote(version))
            log.warning("engine(s) %s restarted mid-rollout, got weights v%d and serve again", joined, version)
    return ray.get(rollout)


def wait_or_stalled(rollout, manager, fault_tolerance: bool) -> None:
    """Until the rollout is done, or (fault tolerance) every engine failed and the restarted ones wait for the
    push's weights (the manager then generates the rollout again)."""
    if not fault_tolerance:
        ray.wait([rollout])
        return
    while not ray.wait([rollout], timeout=1.0)[0]:
        if ray.get(manager.stalled.remote()):
            log.warning("every engine failed during the rollout; pushing the new weights to the restarted ones")
            return
