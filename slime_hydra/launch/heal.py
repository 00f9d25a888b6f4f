"""The healing layer (``rollout.fault_tolerance``; docs/faults.md): the loop's calls, and a part that dies
in one is rebuilt in this process (the fleet heals engines and the router itself).

- a trainer rank that died or missed ``trainer.hang_timeout_s``: a new group loads the newest complete
  checkpoint (or the initial weights) and its data position, and the loop goes on from there;
- the rollout manager: a new one gets the data position after the last trained rollout and the trainers'
  weights, and the step goes on (an async run rewinds to the checkpoint: its next rollout was under way).

Each rebuild counts against ``trainer.max_restarts_per_hour``, goes to ``<run dir>/heal.jsonl`` and ``heal/*``."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Dict, List

import ray

from slime_hydra.checkpoint.ckpt import find_checkpoint
from slime_hydra.launch.cluster import PartDied
from slime_hydra.launch.parts import Parts

log = logging.getLogger("slime_hydra")
WINDOW_S = 3600.0  # trainer.max_restarts_per_hour counts rebuilds within this window


class StartOver(Exception):
    """The loop starts over from the last step done (after a rewind, or a rebuild before the step was trained)."""


class Healing(Parts):
    """The run's parts, each call of the loop healed."""

    fault_tolerance = True

    def __init__(self, *args, **kwargs):
        self.rebuilds: List[float] = []
        self.counts: Dict[str, float] = {}  # heal/* metrics for the next row
        self.rewind_due = False  # until a healing that must go back to the checkpoint has (a death may interrupt it)
        super().__init__(*args, **kwargs)

    def drive(self, loop) -> None:
        while True:
            try:
                return loop(self)
            except StartOver:
                continue

    def start(self) -> None:
        """The start-up, begun again after each death in it; a death costs from then to the start-up's end."""
        deaths, due = [], None
        while True:
            try:
                if due is not None:
                    self._rebuild(due)
                    due = None
                super().start()
                break
            except Exception as err:  # noqa: BLE001 - a death is healed, anything else raised
                due = self._death(err)
                deaths.append((due, time.perf_counter()))
        for death, t0 in deaths:
            self._record(death, self.start_step + 1, "start-up", time.perf_counter() - t0, 0)

    def prepare(self):
        return self._healed(super().prepare)

    def rollout(self, step):
        return self._healed(super().rollout, step)

    def offload(self):
        return self._healed(super().offload)

    def train(self, step, data):
        return self._healed(super().train, step, data)

    def push(self, step):
        return self._healed(super().push, step)

    def eval(self, step):
        return self._healed(super().eval, step)

    def save(self, step):
        return self._healed(super().save, step)

    def log(self, step, metrics):
        metrics.update(self.counts)
        self.counts = {}
        super().log(step, metrics)

    def on_push_retry(self) -> None:
        self.counts["heal/push_retries"] = self.counts.get("heal/push_retries", 0.0) + 1

    def _healed(self, call, *args):
        """``call(*args)``; after a death the part is rebuilt and the loop starts over from the last step done
        (``StartOver``) or, once the step is trained, the weights are pushed and the call made again."""
        death = None
        while True:
            try:
                if death is not None:
                    self._heal(death)
                    death = None
                    Parts.prepare(self)
                return call(*args)
            except StartOver:
                raise
            except Exception as err:  # noqa: BLE001 - a death is healed, anything else raised
                death = self._death(err)

    def _death(self, err: Exception) -> PartDied:
        death = self.died(err)
        if death is None:
            raise err
        return death

    def _heal(self, death: PartDied) -> None:
        t0, step, moment = time.perf_counter(), self.done + 1, self.moment
        self.rewind_due = self.rewind_due or death.part == "trainer" or self.is_async
        self._rebuild(death)
        redone = 0
        if self.rewind_due:
            redone = self._rewind()
            self.rewind_due = False
        else:  # the trainers hold their weights: the position after the rollout they trained on
            ray.get(self.manager.load_state_dict.remote(self.positions[self.trained]))
        self._record(death, step, moment, time.perf_counter() - t0, redone)
        if self.trained == self.done:  # the step in progress is not trained: it starts again from its rollout
            raise StartOver

    def _rebuild(self, death: PartDied) -> None:
        now = time.monotonic()
        self.rebuilds = [t for t in self.rebuilds if now - t < WINDOW_S] + [now]
        budget = self.cfg.trainer.max_restarts_per_hour
        if len(self.rebuilds) > budget:
            raise RuntimeError(f"{len(self.rebuilds)} rebuilds of the run's parts within an hour, more than "
                               f"trainer.max_restarts_per_hour={budget}; the last one: {death.reason}") from death
        log.warning("%s; rebuilding the %s", death.reason, "trainer group" if death.part == "trainer" else
                    "rollout manager with its engines and router")
        self.next_rollout = None
        if death.part == "manager":
            ray.kill(self.manager)
            self.manager = self.new_manager()
        else:
            self.trainers = self.new_trainers()

    def _rewind(self) -> int:
        """In-process ``trainer.resume=auto`` (or back to the run's start); returns how many steps are redone."""
        ckpt = find_checkpoint("auto", self.run_dir) or self.base_ckpt
        if ckpt:
            step, position = self.load(ckpt)
        else:
            if not self.fresh_trainers:
                self.trainers = self.new_trainers()
            step, position = self.start_step, self.positions[self.start_step]
            ray.get(self.manager.load_state_dict.remote(position))
        redone = self.done - step
        self.logger.rewind(step)
        self.done = self.trained = step
        self.positions[step] = position
        return redone

    def _record(self, death: PartDied, step: int, moment: str, seconds: float, steps_redone: int) -> None:
        for key, n in ((f"{death.part}_restarts", 1), ("seconds", seconds), ("steps_redone", steps_redone)):
            self.counts[f"heal/{key}"] = self.counts.get(f"heal/{key}", 0.0) + n
        row = {"time": time.time(), "part": death.part, "rank": death.rank, "step": step, "moment": moment,
               "seconds": round(seconds, 3), "steps_redone": steps_redone, "resumed_at": self.done,
               "reason": death.reason.splitlines()[0][:300]}
        with open(os.path.join(self.run_dir, "heal.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        log.warning("healed: %s%s died during the %s of step %d; %.1fs, %d step(s) redone, going on after step %d",
                    death.part, "" if death.rank is None else f" rank {death.rank}", moment, step, seconds,
                    steps_redone, self.done)
