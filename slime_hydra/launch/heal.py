"""Healing a run in its own process (``rollout.fault_tolerance``; docs/faults.md).

The driver is the one supervisor: it knows the step, the weight version, the data position and the
newest checkpoint, so it decides what to rebuild. The engine fleet heals engines and the router by
itself (``rollout/fleet.py``); what dies under the driver's feet comes here as :class:`PartDied`:

- a trainer rank (its actor died, or a call missed ``trainer.hang_timeout_s``): the trainer group is
  torn down and built again, the newest complete checkpoint is loaded (the run's initial weights if
  there is none yet) with its data position, the metrics rows after it are dropped, and the run goes
  on from there: what ``trainer.resume=auto`` does across processes, in this one;
- the rollout manager actor (with its engines and router, which die with it): a new one is built,
  given the data position after the last rollout the trainers trained on, and the trainers' current
  weights; the step in progress goes on (its rollout is generated again if it was not trained yet).
  An asynchronous run rewinds to the checkpoint instead (its next rollout was already under way).

Each healing is counted against a budget (``trainer.max_restarts_per_hour``; the fleet has its own
per engine), written to ``<run dir>/heal.jsonl`` (what died, when, at which moment, seconds, steps
redone) and counted in the next metrics row (``heal/*``)."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Dict, List, Optional

import ray

from slime_hydra.utils.proc import tail

log = logging.getLogger("slime_hydra")
WINDOW_S = 3600.0  # trainer.max_restarts_per_hour counts rebuilds within this window


class PartDied(RuntimeError):
    """A part of the run that the driver rebuilds died or hung: ``part`` is "trainer" or "manager"."""

    def __init__(self, part: str, reason: str, rank: Optional[int] = None):
        super().__init__(reason)
        self.part, self.reason, self.rank = part, reason, rank


def actor_log_tail(err: BaseException) -> str:
    """The last lines of a dead Ray actor's worker output: Ray names its pid in the error, and the worker's
    output is in this cluster's session directory (``worker-<id>-<job>-<pid>.err``)."""
    import re

    m = re.search(r"\bpid[:=] ?(\d+)", str(err))
    if not m:
        return "(Ray did not name its process)"
    try:
        session = ray._private.worker._global_node.get_session_dir_path()  # noqa: SLF001 - no public way
        logs = os.path.join(session, "logs")
        for name in sorted(os.listdir(logs)):
            if name.startswith("worker-") and name.endswith(f"-{m[1]}.err"):
                return tail(os.path.join(logs, name), 20)
    except Exception as e:  # noqa: BLE001 - best effort, for an error message
        return f"(its log could not be read: {e!r})"
    return f"(no worker log of pid {m[1]} found)"


class Healer:
    """Budgets, counters and the record of healings of one run (the driver does the rebuilding)."""

    def __init__(self, cfg, run_dir: str):
        self.cfg, self.run_dir = cfg, run_dir
        self.enabled = bool(cfg.rollout.fault_tolerance)
        self.budget = cfg.trainer.max_restarts_per_hour
        self.times: List[float] = []
        self.pending: Dict[str, float] = {}  # heal/* metrics for the next row
        self.path = os.path.join(run_dir, "heal.jsonl")

    def charge(self, death: PartDied) -> None:
        """Count a rebuild; past the budget, stop the run with the reason (rank, log tail)."""
        now = time.monotonic()
        self.times = [t for t in self.times if now - t < WINDOW_S] + [now]
        if len(self.times) > self.budget:
            raise RuntimeError(f"{len(self.times)} rebuilds of the run's parts within an hour, more than "
                               f"trainer.max_restarts_per_hour={self.budget}; the last one: {death.reason}") from death

    def record(self, death: PartDied, step: int, moment: str, seconds: float, steps_redone: int,
               resumed_at: int) -> None:
        self.pending[f"heal/{death.part}_restarts"] = self.pending.get(f"heal/{death.part}_restarts", 0.0) + 1
        self.pending["heal/seconds"] = self.pending.get("heal/seconds", 0.0) + seconds
        self.pending["heal/steps_redone"] = self.pending.get("heal/steps_redone", 0.0) + steps_redone
        row = {"time": time.time(), "part": death.part, "rank": death.rank, "step": step, "moment": moment,
               "seconds": round(seconds, 3), "steps_redone": steps_redone, "resumed_at": resumed_at,
               "reason": death.reason.splitlines()[0][:300]}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        log.warning("healed: %s%s died during the %s of step %d; %.1fs, %d step(s) redone, going on after step %d",
                    death.part, "" if death.rank is None else f" rank {death.rank}", moment, step, seconds,
                    steps_redone, resumed_at)

    def count(self, key: str, n: float = 1.0) -> None:
        self.pending[f"heal/{key}"] = self.pending.get(f"heal/{key}", 0.0) + n

    def take(self) -> Dict[str, float]:
        out, self.pending = self.pending, {}
        return out


def manager_died(err: BaseException, manager) -> bool:
    """Whether ``err`` says that the rollout manager actor is gone."""
    return isinstance(err, ray.exceptions.RayActorError) and getattr(err, "actor_id", None) == manager._actor_id.hex()


def wait_all(refs: List[Any], actors: List[Any], timeout_s: Optional[float], what: str) -> List[Any]:
    """``ray.get(refs)`` for one call fanned out over the trainer ranks, but a rank that died is
    reported as soon as Ray knows (the others may hang in a collective with it), and ranks still busy
    after ``timeout_s`` count as hung: both raise :class:`PartDied`. Other errors are raised as they are."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(1.0, left) if left is not None
                                  else 1.0)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                rank = refs.index(ref)
                raise PartDied("trainer", f"trainer rank {rank} died during {what} ({type(e).__name__}); "
                               f"last lines of its output:\n{actor_log_tail(e)}", rank) from e
            except Exception:  # noqa: BLE001 - a rank's own error: raised below, after the others answer
                pass
        if deadline is not None and time.monotonic() >= deadline and pending:
            ranks = [refs.index(r) for r in pending]
            raise PartDied("trainer", f"trainer rank(s) {ranks} did not finish {what} within "
                           f"trainer.hang_timeout_s={timeout_s:g}s (a hung collective?)", ranks[0])
    return ray.get(refs)
