"""The run's parts (the rollout manager with its engines and router, the trainer group) and the calls the
step loop makes on them (launch/loop.py). ``Healing`` (launch/heal.py) makes the same calls and rebuilds
a part that dies."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Dict, Optional

import ray

from slime_hydra.checkpoint.ckpt import find_checkpoint, read_checkpoint, save_checkpoint
from slime_hydra.config.schema import RunConfig
from slime_hydra.launch import preempt
from slime_hydra.launch.cluster import PartDied, TrainerGroup
from slime_hydra.launch.startup import StartupClock
from slime_hydra.logging.metrics import RunLogger
from slime_hydra.plan.activations import rank_step_samples
from slime_hydra.plan.resources import ResourcePlan
from slime_hydra.sync.push import Offload, push_weights, wait_or_stalled, wait_rollout
from slime_hydra.train.backend import WarmUpShape

log = logging.getLogger("slime_hydra")


class Parts:
    """The actors of a run and where it stands: ``done``, the last step whose row is written (and checkpoint
    saved, if due); ``trained``/``pushed``, the weight versions the trainers hold and the engines run;
    ``positions``, the data position after each rollout still needed. A part that dies stops the run."""

    fault_tolerance = False  # Healing: pushes go to the engines running now, a restarted engine gets weights at once
    on_push_retry = None  # Healing: counts a push that went again

    def __init__(self, cfg: RunConfig, plan: ResourcePlan, pg, model_path: str, clock: Optional[StartupClock] = None):
        self.cfg, self.plan, self.pg, self.model_path = cfg, plan, pg, model_path
        self.clock = clock or StartupClock()
        self.run_dir, self.is_async = cfg.output_dir, cfg.trainer.mode == "async"
        self.moves = Offload.from_config(cfg) if plan.engines else Offload()
        self.engines_awake = True  # colocated offload: a push wakes them, the next step's offload puts them to sleep
        self.moment = "start-up"  # what the run does now (the start-up's console line, a healing's record)
        self.warming = False
        self.trainers: Optional[TrainerGroup] = None
        self.fresh_trainers = False  # they hold the run's initial weights (built, not trained since)
        self.logger: Optional[RunLogger] = None
        self.num_rollout = self.start_step = self.done = self.trained = self.pushed = 0
        self.base_ckpt: Optional[str] = None  # the checkpoint the run started from (trainer.resume)
        self.positions: Dict[int, Dict[str, Any]] = {}
        self.next_rollout = None  # the rollout under way (an object ref of the manager's generate)
        self.manager = self.new_manager()

    def new_manager(self):
        from slime_hydra.rollout.manager import FLEET_GROUP, RolloutManager

        manager = ray.remote(num_cpus=0, concurrency_groups={FLEET_GROUP: 1})(RolloutManager).remote(
            self.cfg, self.plan, self.pg, self.model_path)
        self.manager_created = time.time()
        self.manager_report = manager.startup_report.remote()  # answered once the engines are up
        return manager

    def new_trainers(self) -> TrainerGroup:
        if self.trainers is not None:
            self.trainers.kill()
        self.trainers = None
        trainers = TrainerGroup(self.cfg, self.plan, self.pg, self.model_path)
        if self.num_rollout:
            trainers.set_num_rollout(self.num_rollout)
        self.fresh_trainers = True
        return trainers

    def died(self, err: BaseException) -> Optional[PartDied]:
        """``err`` as the death of a part, or None."""
        if isinstance(err, PartDied):
            return err
        if isinstance(err, ray.exceptions.RayActorError) and getattr(err, "actor_id", None) == \
                self.manager._actor_id.hex():
            return PartDied("manager", f"the rollout manager actor died: {err}")
        return None

    def drive(self, loop) -> None:
        loop(self)

    def start(self) -> None:
        """The trainer group starts and warms up while the manager, created first, starts the engines; then the
        rollout side is waited for and ``trainer.resume``'s checkpoint loaded."""
        cfg = self.cfg
        if self.trainers is None:
            with self.clock.part("trainers"):
                self.trainers = self.new_trainers()
            if cfg.trainer.warm_up:
                with self.clock.part("trainer_warm_up"):
                    self.warming = True
                    try:
                        self.trainers.warm_up(cfg.rollout.temperature, warm_up_shape(cfg, self.plan))
                    finally:
                        self.warming = False
        with self.clock.part("wait_for_rollout_side"):
            report = ray.get(self.manager_report)
        self.clock.add_rollout_side(report, self.manager_created)
        self.num_rollout = cfg.trainer.num_rollout
        if self.num_rollout is None:  # from data.num_epoch
            prompts = ray.get(self.manager.num_train_prompts.remote())
            self.num_rollout = prompts // cfg.rollout.batch_size * cfg.data.num_epoch
        self.trainers.set_num_rollout(self.num_rollout)  # the learning-rate schedule's length
        ckpt = find_checkpoint(cfg.trainer.resume, self.run_dir) if cfg.trainer.resume else None
        if ckpt:
            self.start_step = self.load(ckpt)[0]
            carry_history(ckpt, self.run_dir, self.start_step)
            log.info("resumed from %s at step %d", ckpt, self.start_step)
        self.base_ckpt = ckpt
        self.done = self.trained = self.pushed = self.start_step
        self.positions[self.start_step] = ray.get(self.manager.state_dict.remote())
        self.logger = RunLogger(cfg, self.num_rollout, self.start_step, keep_until=self.start_step if ckpt else None)

    def load(self, ckpt: str) -> tuple:
        """The checkpoint's weights into the trainers and its data position into the manager: (step, position)."""
        meta = read_checkpoint(ckpt)
        self.trainers.load(ckpt)
        self.fresh_trainers = False
        ray.get(self.manager.load_state_dict.remote(meta["data_state"]))
        return meta["step"], meta["data_state"]

    def prepare(self) -> None:
        """Connect the trainers to the engines and push their weights (at the start and after a healing); the
        eval before training, unless its row is written."""
        cfg = self.cfg
        if self.plan.engine_use == "none":  # algo=sft without eval sets: no engine to connect to or push to
            return
        self.moment = "first push"
        with self.clock.part("first_push"):
            if not self.fault_tolerance:  # else the push connects to the engines running now
                self.trainers.connect(ray.get(self.manager.endpoints.remote()))
            if self.moves.engines:  # the engines start awake; the push expects them asleep, as after training
                ray.get(self.manager.offload.remote())
            sync = push_weights(self.manager, self.trainers, self.trained, self.moves, self.fault_tolerance,
                                self.on_push_retry, reconnect=True)
            self.pushed, self.engines_awake = self.trained, True
        log.info("weights v%d pushed to the engines (%.2fs over %s)", self.pushed, sync["seconds"], cfg.sync.transport)
        if cfg.eval.datasets and cfg.eval.before_train and self.done == 0 and not self.logger.history:
            with self.clock.part("eval_before_train"):
                self.logger.log(0, Parts.eval(self, 0))

    def rollout(self, step: int) -> tuple:
        """Step ``step``'s samples and metrics; an async run starts the next rollout, to generate while this trains."""
        self.moment = "rollout"
        if self.next_rollout is None:
            self.next_rollout = self.manager.generate.remote(step - 1, self.pushed)
        data, metrics = wait_rollout(self.next_rollout, self.manager, self.trainers, self.pushed,
                                     self.fault_tolerance and not self.is_async, preempt.check)
        self.next_rollout = None
        # a healing needs the run's start (no checkpoint yet) and the position after the last trained rollout
        self.positions = {k: v for k, v in self.positions.items() if k in (self.start_step, self.done)}
        self.positions[step] = ray.get(self.manager.state_dict.remote())  # before the next rollout starts
        metrics.update(position_metrics(self.positions[step]))
        if self.is_async and step < self.num_rollout:
            self.next_rollout = self.manager.generate.remote(step, self.pushed)
        return data, metrics

    def offload(self) -> Dict[str, float]:
        """Colocated GPUs: the engines sleep, the trainer comes back from the host."""
        self.moment = "offload"
        t0 = time.perf_counter()
        if self.moves.engines and self.engines_awake:
            ray.get(self.manager.offload.remote())
            self.engines_awake = False
        if self.moves.trainer:
            self.trainers.onload()
        moved = self.moves.engines or self.moves.trainer
        return {"perf/offload_time": time.perf_counter() - t0 if moved else 0.0}

    def train(self, step: int, data) -> Dict[str, float]:
        self.moment = "train"
        self.fresh_trainers = False
        out = self.trainers.train(data, self.cfg.rollout.temperature, self.cfg.rollout.max_response_len)
        self.trained = step
        return {"perf/train_actor_time": out.pop("actor_time"), **{f"train/{k}": v for k, v in out.items()}}

    def push_due(self, step: int, evaluates: bool) -> bool:
        """RL pushes every ``trainer.update_weights_interval`` steps; SFT's engines serve only the eval, so they get
        the weights just before one (and without eval sets there are no engines)."""
        use = self.plan.engine_use
        if use == "rollout":
            return periodic(step, self.cfg.trainer.update_weights_interval, self.num_rollout)
        return use == "eval" and evaluates

    def push(self, step: int) -> Dict[str, float]:
        self.moment = "push"
        if self.is_async and step < self.num_rollout:  # never change weights under a running rollout
            wait_or_stalled(self.next_rollout, self.manager, self.fault_tolerance)
        sync = push_weights(self.manager, self.trainers, step, self.moves, self.fault_tolerance, self.on_push_retry)
        self.pushed, self.engines_awake = step, True
        return {"perf/weight_sync_bytes": sync["bytes"],
                "perf/weight_push_time": sync["seconds"],  # the pushing rank's part of perf/weight_sync_time
                "perf/weight_transfer_time": sync["transfer_seconds"]}  # the weights alone, of the push

    def eval(self, step: int) -> Dict[str, float]:
        """The eval's metrics, its examples written to the log (with fault tolerance, as ``wait_rollout`` waits)."""
        self.moment = "eval"
        ref = self.manager.eval.remote()
        if self.fault_tolerance and not self.is_async:
            wait_rollout(ref, self.manager, self.trainers, self.pushed, True)
        out = ray.get(ref)
        parts = []
        for key, v in out.items():
            if key.endswith("/examples"):
                for ex in v:
                    self.logger.write(f"  [{key.split('/')[1]}] {ex['prompt']!r} -> {ex['response']!r} "
                                      f"(label {ex['label']!r}, reward {ex['reward']})")
            elif key.endswith("/reward"):
                parts.append(f"{key.removeprefix('eval/')} {v:.3f}")
        self.logger.write(f"step {step}: eval " + ", ".join(parts))
        return {k: v for k, v in out.items() if not k.endswith("/examples")}

    def log(self, step: int, metrics: Dict[str, Any]) -> None:
        self.clock.first_row(metrics)  # the first step's row carries the start-up's account
        self.logger.log(step, metrics)
        self.logger.progress(metrics)

    def save(self, step: int) -> None:
        self.moment = "save"
        # the data position after rollout `step` (an async run has already started the next one)
        save_checkpoint(self.run_dir, step, lambda d: self.trainers.save(d, self.model_path), self.positions[step],
                        self.cfg.trainer.keep_checkpoints)

    def kill(self) -> None:
        """After an error, Ctrl-C or a preemption: kill the actors at once (their engines and router die with them)."""
        for actor in [self.manager, *(self.trainers.actors if self.trainers else [])]:
            try:
                ray.kill(actor)
            except Exception as e:  # noqa: BLE001 - best effort while tearing down
                log.warning("kill: %s", e)

    def shutdown(self) -> None:
        for shutdown in (lambda: self.trainers and self.trainers.shutdown(),
                         lambda: ray.get(self.manager.shutdown.remote(), timeout=60)):
            try:
                shutdown()
            except Exception as e:  # noqa: BLE001 - best effort while tearing down
                log.warning("shutdown: %s", e)

    def waiting_for(self) -> str:
        """What the start-up waits for now (``StartupWatch``'s console line)."""
        side = "" if ray.wait([self.manager_report], timeout=0)[0] else "the rollout side (engines, router, data)"
        if self.moment == "start-up":
            trainers = "the trainer group (actors, model load)" if self.trainers is None else \
                "the trainers' warm-up pass (trainer.warm_up)" if self.warming else ""
            return " and ".join(filter(None, [trainers, side])) or "the trainers' set-up"
        what = {"first push": "the first weight push", "eval": "the eval before training"}.get(
            self.moment, f"the first step ({self.moment})")
        return what + (f", and {side}" if side else "")


def periodic(step: int, interval: int, last: int) -> bool:
    return step == last or (interval > 0 and step % interval == 0)


def warm_up_shape(cfg: RunConfig, plan: ResourcePlan) -> WarmUpShape:
    """The most a trainer rank's step holds (as the memory plan counts it), for its warm-up pass."""
    r, t = cfg.rollout, cfg.trainer
    length = (r.max_prompt_len or 0) + r.max_response_len
    if t.backend == "megatron" and t.max_tokens_per_micro_batch:  # a packed budget holds at least one row
        length = min(length, t.max_tokens_per_micro_batch)
    return WarmUpShape(rank_step_samples(cfg, plan.data_parallel), length, min(r.max_response_len, length - 1))


def position_metrics(state: Dict[str, Any]) -> Dict[str, float]:
    """The data position as metrics (``data/*``): the same run resumed or healed has the same columns."""
    return {f"data/{k}": float(state[k]) for k in ("epoch", "offset", "next_group_index")
            if isinstance(state.get(k), (int, float))}


def carry_history(ckpt: str, run_dir: str, step: int) -> None:
    """Resuming another run's checkpoint in a new run directory: its metrics.jsonl rows up to the checkpoint first."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(ckpt))), "metrics.jsonl")
    dst = os.path.join(run_dir, "metrics.jsonl")
    if os.path.abspath(src) == os.path.abspath(dst) or not os.path.exists(src) or os.path.exists(dst):
        return
    with open(src) as f:
        rows = [line for line in f if json.loads(line).get("step", 0) <= step]
    with open(dst + ".tmp", "w") as f:
        f.writelines(rows)
    os.replace(dst + ".tmp", dst)
