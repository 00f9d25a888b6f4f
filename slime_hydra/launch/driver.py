"""The driver loop: generate -> reward -> train -> sync weights, with eval, save and logging on
their intervals. Sync mode trains on the rollout it just generated; async mode generates the next
rollout while training on the current one (one step off-policy), updating the engines' weights
only between rollouts (slime's train.py and train_async.py).

Weight version v = the number of training steps behind the weights; a rollout generated for step
s must carry version s (sync) or the last pushed version (async), else the run stops.

Colocated GPUs take turns on memory as ``parallelism.offload_rollout`` / ``offload_train`` say (``Offload``;
config/resolve.py picks them from the memory estimate when unset): engines that offload release their
memory while the trainer trains and take back their weights, then their KV cache, around the weight
push; a trainer that offloads moves its state to the host for the push and the rollout, and back
before training. Without offload nothing moves: the push reads the trainer's GPU tensors. An async
loop on colocated GPUs offloads nothing (launch/rules.py): the next rollout generates on the GPU
while the trainer trains there, and the push still waits for that rollout to finish.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import ray

from slime_hydra.checkpoint.ckpt import (
    find_checkpoint,
    read_checkpoint,
    remove_partial,
    resumes_in_run_dir,
    save_checkpoint,
)
from slime_hydra.config import ConfigError
from slime_hydra.config.schema import RunConfig
from slime_hydra.launch.cluster import TrainerGroup, create_placement_group, placed, ray_cluster
from slime_hydra.launch.heal import Healer, PartDied, manager_died
from slime_hydra.launch.lease import RunLease
from slime_hydra.launch.startup import StartupClock, StartupWatch
from slime_hydra.logging.metrics import RunLogger
from slime_hydra.model.hf import initial_checkpoint
from slime_hydra.plan.activations import rank_step_samples
from slime_hydra.plan.resources import ResourcePlan
from slime_hydra.sync import WeightSyncError
from slime_hydra.train.backend import WarmUpShape

log = logging.getLogger("slime_hydra")
# Called as hook(step, metrics) after each eval: a sweep's pruner (slime_hydra/sweep/optuna.py) stops a weak
# trial by raising from here.
EVAL_HOOKS: List[Callable[[int, Dict[str, float]], None]] = []


@dataclass(frozen=True)
class Offload:
    """What takes turns on colocated GPUs (``parallelism.offload_train`` / ``offload_rollout``), and whether
    the push reads the trainer's weights before they go to the host (``push_before_offload``)."""

    trainer: bool = False
    engines: bool = False
    push_first: bool = False

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "Offload":
        p = cfg.parallelism
        trainer = bool(p.colocate and p.offload_train)
        return cls(trainer=trainer, engines=bool(p.colocate and p.offload_rollout),
                   push_first=trainer and bool(p.push_before_offload))


def periodic(step: int, interval: int, last: int) -> bool:
    return step == last or (interval > 0 and step % interval == 0)


def warm_up_shape(cfg: RunConfig, plan: ResourcePlan) -> WarmUpShape:
    """The most a trainer rank's step holds, for its warm-up pass (``trainer.warm_up``): its share of an
    optimiser step's samples, each as long as the memory plan counts them (``max_prompt_len + max_response_len``),
    within megatron's packed token budget (a longer row would be refused there)."""
    r, t = cfg.rollout, cfg.trainer
    length = (r.max_prompt_len or 0) + r.max_response_len
    if t.backend == "megatron" and t.max_tokens_per_micro_batch:  # a packed budget holds at least one row
        length = min(length, t.max_tokens_per_micro_batch)
    return WarmUpShape(rank_step_samples(cfg, plan.data_parallel), length, min(r.max_response_len, length - 1))


def train(cfg: RunConfig, plan: ResourcePlan, clock: Optional[StartupClock] = None,
          late_checks: Sequence[Callable[[], List[str]]] = ()) -> Dict[str, Any]:
    """The whole run. A run directory has one driver at a time, and a driver that was killed leaves
    nothing behind for long: the next start in its run directory kills its leftover processes
    (``RunLease``) and removes its half-written checkpoint. ``clock``: the start-up's, begun at launch
    (launch/startup.py). ``late_checks``: validation's checks still running (sglang's parser, in a child
    process), answered while Ray and the engines start; their problems stop the engines and raise ``ConfigError``
    before a trainer starts or a checkpoint is written (a first run with new server arguments would otherwise
    wait 9-15 s for the check on an H200 before its engines start)."""
    clock = clock or StartupClock()
    clock.add("before_train", time.time() - clock.launched)  # the interpreter, Hydra, validation, the plan
    t_start = time.perf_counter()
    with RunLease(cfg.output_dir) as lease, ThreadPoolExecutor(1, thread_name_prefix="initial-checkpoint") as pool:
        partial = remove_partial(cfg.output_dir)
        if partial:
            log.warning("removed the incomplete checkpoint(s) %s of an interrupted save", partial)
        # a random initial checkpoint (no model.path) is built while Ray starts: 8 s of each on a busy 2-core machine
        model_path = pool.submit(initial_checkpoint, cfg.model, cfg.output_dir,
                                 resumes_in_run_dir(cfg.trainer.resume, cfg.output_dir))
        return _train(cfg, plan, model_path, t_start, lease, clock, late_checks)


def _train(cfg: RunConfig, plan: ResourcePlan, model_path: "Future[str]", t_start: float, lease: RunLease,
           clock: StartupClock, late_checks: Sequence[Callable[[], List[str]]]) -> Dict[str, Any]:
    t_ray = time.perf_counter()
    with ray_cluster(cfg, plan) as ray_session_dir:
        clock.add("ray_init", time.perf_counter() - t_ray)
        lease.note_ray_session(ray_session_dir)
        with clock.part("placement_group"):
            pg = create_placement_group(plan)
        with clock.part("initial_checkpoint"):  # what is left of it after Ray's start
            path = model_path.result()
        run = Run(cfg, placed(plan, pg), pg, path, clock)  # the rollout side starts: its engines take the longest
        with clock.part("late_checks"):  # what is left of them while the engines start
            problems = [p for check in late_checks for p in check()]
        if problems:
            run.kill()
            raise ConfigError(problems)
        done = False
        try:
            summary = run.train(t_start)
            done = True
            return summary
        finally:
            run.shutdown() if done else run.kill()


class Run:
    """The loop and its state: the parts (the rollout manager, the trainer group), the last step done,
    the weights the trainers hold and those the engines run, the data position after each rollout.

    A step is two halves: its rollout and training (``_rollout_and_train``), then its publication (the
    weight push, the eval, the metrics row, the checkpoint: ``_publish``). With fault tolerance a part
    that dies (``PartDied``, launch/heal.py) is rebuilt by ``_heal`` and the loop goes on from what is
    still true: a new rollout manager gets the data position after the last trained rollout and the
    current weights, and the step goes on from the half it was in; a new trainer group loads the newest
    checkpoint, and the steps after it are done again (their rows are written again)."""

    def __init__(self, cfg: RunConfig, plan: ResourcePlan, pg, model_path: str, clock: Optional[StartupClock] = None):
        self.cfg, self.plan, self.pg, self.model_path = cfg, plan, pg, model_path
        self.clock = clock or StartupClock()
        self.starting = True  # until the first step's row is written (the start-up's report)
        self.watch: Optional[StartupWatch] = None
        self.manager_report = None  # the manager's startup_report, due once its constructor has finished
        self.manager_created = 0.0
        self.run_dir, self.is_async = cfg.output_dir, cfg.trainer.mode == "async"
        self.offload = Offload.from_config(cfg)
        self.ft = cfg.rollout.fault_tolerance
        self.healer = Healer(cfg, self.run_dir)
        self.moment = "start-up"  # what the loop does now (for the record of a healing)
        self.warming = False  # the trainers' warm-up pass is running (start-up)
        self.manager = self._new_manager()
        self.trainers: Optional[TrainerGroup] = None  # built by _start_up (a rank may die meanwhile)
        self.logger: Optional[RunLogger] = None
        self.num_rollout = 0
        self.start = 0
        self.base_ckpt: Optional[str] = None  # the checkpoint the run started from (trainer.resume)
        self.done = 0  # the last step whose row is written (and checkpoint saved, if due)
        self.pending: Optional[tuple] = None  # (step, metrics, timings): trained, not yet published
        self.pushed = 0  # the weight version the engines run
        self.positions: Dict[int, Dict[str, Any]] = {}  # step -> data position after the rollout it trained on
        self.next_rollout = None  # the rollout under way (an object ref of the manager's generate)
        self.rewind_due = False  # a healing that must go back to the checkpoint, until it has (another death may
        # interrupt it: chaos found a manager killed while a trainer group was rebuilt)
        self.fresh_trainers = False  # the trainers hold the run's initial weights (built, not trained since)

    def _new_manager(self):
        from slime_hydra.rollout.manager import FLEET_GROUP, RolloutManager

        manager = ray.remote(num_cpus=0, concurrency_groups={FLEET_GROUP: 1})(RolloutManager).remote(
            self.cfg, self.plan, self.pg, self.model_path)
        self.manager_created = time.time()
        self.manager_report = manager.startup_report.remote()  # answered once the engines are up
        return manager

    def _new_trainers(self) -> TrainerGroup:
        if self.trainers is not None:
            self.trainers.kill()
        self.trainers = None
        trainers = TrainerGroup(self.cfg, self.plan, self.pg, self.model_path)
        if self.num_rollout:
            trainers.set_num_rollout(self.num_rollout)
        self.fresh_trainers = True
        return trainers

    def kill(self) -> None:
        """After an error or Ctrl-C: kill the actors at once. A polite ``shutdown`` call would wait behind
        the call they are running (a rollout, a training step: a minute on a loaded machine, which is why
        Ctrl-C once took more than 60 s); their servers (engines, router) die with them (PDEATHSIG)."""
        log.warning("stopping: killing the rollout manager (its engines and router go with it) and the trainers")
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

    # ------------------------------------------------------------------------------- the loop
    def train(self, t_start: float) -> Dict[str, Any]:
        self.watch = StartupWatch(self.clock, self._waiting_for, os.path.join(self.run_dir, "logs"))
        with self.watch:  # until the first step is done (_startup_done) or the run stops
            return self._train(t_start)

    def _waiting_for(self) -> str:
        """What the start-up waits for now (StartupWatch's console line)."""
        side = "" if self.manager_report is None or ray.wait([self.manager_report], timeout=0)[0] else \
            "the rollout side (engines, router, data)"
        if self.moment == "start-up":
            trainers = "the trainer group (actors, model load)" if self.trainers is None else \
                "the trainers' warm-up pass (trainer.warm_up)" if self.warming else ""
            return " and ".join(filter(None, [trainers, side])) or "the trainers' set-up"
        what = {"first push": "the first weight push", "eval": "the eval before training"}.get(
            self.moment, f"the first step ({self.moment})")
        return what + (f", and {side}" if side else "")

    def _train(self, t_start: float) -> Dict[str, Any]:
        cfg = self.cfg
        deaths: list = []
        while True:  # start-up: every call here can be made again after a part was rebuilt
            try:
                if deaths and deaths[-1][2]:  # rebuild inside the try: a part may die while it is rebuilt
                    deaths[-1][2] = False
                    self._rebuild(deaths[-1][0])
                self._start_up()
                break
            except Exception as err:  # noqa: BLE001 - a death is healed, anything else raised
                deaths.append([self._as_death(err), time.perf_counter(), True])
        for death, t0, _ in deaths:  # each costs from its rebuild to the end of the start-up
            self.healer.record(death, self.start + 1, "start-up", time.perf_counter() - t0, 0, self.start)
        self.logger = RunLogger(cfg, self.num_rollout, self.start, keep_until=self.start if self.base_ckpt else None)
        try:
            self._steps()
            summary = summarize(self.logger.history, self.num_rollout, time.perf_counter() - t_start, self.run_dir)
            if not self.starting:
                summary["startup"] = {k.removeprefix("startup/"): v for k, v in self.clock.metrics().items()}
            self.logger.finish(summary)
            return summary
        finally:
            self.logger.close()

    def _start_up(self) -> None:
        """The trainer group is built (its actors start and load the model) while the rollout manager,
        created before it, starts the engines: on a colocated GPU both load at once, as the memory plan
        counts them (plan/memory.py), and runs its warm-up pass (``trainer.warm_up``). Then the driver waits for
        the rollout side."""
        cfg = self.cfg
        if self.trainers is None:
            with self.clock.part("trainers"):
                self.trainers = self._new_trainers()
            if cfg.trainer.warm_up:  # the first step's one-off costs, while the engines start
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
            meta = read_checkpoint(ckpt)
            self.trainers.load(ckpt)
            self.fresh_trainers = False
            ray.get(self.manager.load_state_dict.remote(meta["data_state"]))
            self.start = meta["step"]
            carry_history(ckpt, self.run_dir, self.start)
            log.info("resumed from %s at step %d", ckpt, self.start)
        self.base_ckpt = ckpt
        self.done = self.pushed = self.start
        self.positions[self.start] = ray.get(self.manager.state_dict.remote())

    def _steps(self) -> None:
        death: Optional[PartDied] = None
        prepared = False
        while True:
            try:
                if death is not None:
                    self._heal(death)
                    death, prepared = None, False
                if not prepared:
                    self._prepare()
                    prepared = True
                if self.pending is None:
                    if self.done >= self.num_rollout:  # data.num_epoch's count can be below a resumed step
                        return
                    self.pending = self._rollout_and_train(self.done + 1)
                self._publish(*self.pending)
                self.done, self.pending = self.pending[0], None
                # what a healing may need: the run's start (no checkpoint yet) and the last step's position
                self.positions = {k: v for k, v in self.positions.items() if k in (self.start, self.done)}
            except Exception as err:  # noqa: BLE001 - a death is healed, anything else raised
                death = self._as_death(err)

    def _prepare(self) -> None:
        """Connect the trainers to the engines and push the trainers' weights (at the start, and after a
        healing); the eval before training, unless its row is written."""
        cfg = self.cfg
        self.moment = "first push"
        t0 = time.perf_counter()
        if not self.ft:
            self.trainers.connect(ray.get(self.manager.endpoints.remote()))
        if self.offload.engines:  # the engines start awake; push_weights expects them asleep, as after a training step
            ray.get(self.manager.offload.remote())
        version = self.pending[0] if self.pending else self.done
        # with fault tolerance the push connects the trainers to the engines running now (a healed part
        # is a new trainer group or new engines), and connects again if an engine dies meanwhile
        sync = push_weights(self.manager, self.trainers, version, self.offload, self.ft, self.healer, reconnect=True)
        self.pushed = version
        if self.starting:
            self.clock.add("first_push", time.perf_counter() - t0)
        log.info("weights v%d pushed to the engines (%.2fs over %s)", version, sync["seconds"], cfg.sync.transport)
        if cfg.eval.datasets and cfg.eval.before_train and self.done == 0 and not self.logger.history:
            self.moment = "eval"
            with self.clock.part("eval_before_train"):
                self.logger.log(0, self._eval(0))

    def _rollout_and_train(self, step: int) -> tuple:
        cfg, manager = self.cfg, self.manager
        t0 = time.perf_counter()
        self.moment = "rollout"
        if self.next_rollout is None:
            self.next_rollout = manager.generate.remote(step - 1, self.pushed)
        data_refs, metrics = wait_rollout(self.next_rollout, manager, self.trainers, self.pushed,
                                          self.ft and not self.is_async)
        self.next_rollout = None
        self.positions[step] = ray.get(manager.state_dict.remote())  # before the next rollout starts
        metrics.update(position_metrics(self.positions[step]))
        t_rollout = time.perf_counter() - t0
        if self.is_async and step < self.num_rollout:
            self.next_rollout = manager.generate.remote(step, self.pushed)  # overlaps with training below
        self.moment = "offload"
        t_moves = time.perf_counter()
        if self.offload.engines:
            ray.get(manager.offload.remote())
        if self.offload.trainer:
            self.trainers.onload()
        t_moves = time.perf_counter() - t_moves if self.offload.engines or self.offload.trainer else 0.0
        self.moment = "train"
        self.fresh_trainers = False
        t1 = time.perf_counter()
        train_metrics = self.trainers.train(data_refs, cfg.rollout.temperature, cfg.rollout.max_response_len)
        metrics["perf/train_actor_time"] = train_metrics.pop("actor_time")  # a timing, as the other perf/ ones
        metrics.update({f"train/{k}": v for k, v in train_metrics.items()})
        t_train = time.perf_counter() - t1
        check_logprob_gap(cfg, metrics, step)
        check_staleness(cfg, metrics, step)
        return step, metrics, (t0, t_rollout, t_moves, t_train)

    def _publish(self, step: int, metrics: Dict[str, Any], times: tuple) -> None:
        cfg, num_rollout = self.cfg, self.num_rollout
        t0, t_rollout, t_moves, t_train = times
        self.moment = "push"
        t2 = time.perf_counter()
        if step % cfg.trainer.update_weights_interval == 0 or step == num_rollout:
            if self.is_async and step < num_rollout:
                # never change weights under a running rollout
                wait_or_stalled(self.next_rollout, self.manager, self.ft)
            sync = push_weights(self.manager, self.trainers, step, self.offload, self.ft, self.healer)
            self.pushed = step
            metrics["perf/weight_sync_bytes"] = sync["bytes"]
            metrics["perf/weight_push_time"] = sync["seconds"]  # the pushing rank's, of perf/weight_sync_time
            metrics["perf/weight_transfer_time"] = sync["transfer_seconds"]  # the weights alone, of the push
        t_sync = time.perf_counter() - t2
        if cfg.eval.datasets and periodic(step, cfg.eval.interval, num_rollout):
            self.moment = "eval"
            metrics.update(self._eval(step))
        step_time = time.perf_counter() - t0
        metrics.update({"perf/step_time": step_time, "perf/rollout_wait_time": t_rollout, "perf/train_time": t_train,
                        "perf/weight_sync_time": t_sync, "perf/offload_time": t_moves,
                        "perf/tokens_per_s": metrics["rollout/response_tokens"] / max(step_time, 1e-9)})
        metrics.update(self.healer.take())
        if self.starting:
            self._startup_done(metrics)
        self.logger.log(step, metrics)  # before the checkpoint: a complete checkpoint of step s has row s written
        self.logger.progress(metrics)
        for hook in EVAL_HOOKS if any(k.startswith("eval/") for k in metrics) else ():
            hook(step, metrics)  # after the row is written: a pruned trial's curve ends at its last eval
        if periodic(step, cfg.trainer.save_interval, num_rollout if cfg.trainer.save_last else -1):
            self.moment = "save"
            # the data position after rollout `step` (an async run has already started the next one)
            save_checkpoint(self.run_dir, step, lambda d: self.trainers.save(d, self.model_path),
                            self.positions[step], cfg.trainer.keep_checkpoints)

    def _startup_done(self, metrics: Dict[str, Any]) -> None:
        """The first step is done: the start-up's parts go to the console and to this step's row."""
        self.starting = False
        self.clock.add("first_step", metrics["perf/step_time"])
        self.clock.done_at = time.time()
        if self.watch is not None:
            self.watch.__exit__()
        metrics.update(self.clock.metrics())
        log.info("%s", self.clock.line())

    def _eval(self, step: int) -> Dict[str, float]:
        """An eval; in a synchronous run with fault tolerance, an engine restarted meanwhile gets the
        current weights at once (as during a rollout)."""
        ref = self.manager.eval.remote()
        if self.ft and not self.is_async:
            wait_rollout(ref, self.manager, self.trainers, self.pushed, True)
        return _eval(ref, self.logger, step)

    # ------------------------------------------------------------------------------- healing
    def _as_death(self, err: BaseException) -> PartDied:
        """``err`` as the death of a part the driver rebuilds; anything else (and every death without
        fault tolerance) is raised."""
        death = err if isinstance(err, PartDied) else None
        if death is None and manager_died(err, self.manager):
            death = PartDied("manager", f"the rollout manager actor died: {err}")
        if death is None:
            raise err
        if not self.ft:  # a part whose __init__ raised would raise again when rebuilt: no hint then
            hint = "" if getattr(err, "actor_init_failed", False) else "\n(rollout.fault_tolerance=true rebuilds it)"
            raise RuntimeError(f"{death.reason}{hint}") from err
        return death

    def _rebuild(self, death: PartDied) -> None:
        """A new part for the one that died, within the budget."""
        self.healer.charge(death)
        log.warning("%s; rebuilding the %s", death.reason, "trainer group" if death.part == "trainer" else
                    "rollout manager with its engines and router")
        self.next_rollout = None
        if death.part == "manager":
            ray.kill(self.manager)
            self.manager = self._new_manager()
        else:
            self.trainers = self._new_trainers()

    def _heal(self, death: PartDied) -> None:
        """Rebuild the part that died, and put the run back where it can go on (see the class docstring)."""
        t0, step, moment = time.perf_counter(), self.done + 1, self.moment
        self.rewind_due = self.rewind_due or death.part == "trainer" or self.is_async
        self._rebuild(death)
        redone = 0
        if self.rewind_due:
            redone = self._rewind()
            self.rewind_due = False
        else:  # the trainers hold their weights: the data position after the rollout they trained on last
            version = self.pending[0] if self.pending else self.done
            ray.get(self.manager.load_state_dict.remote(self.positions[version]))
        self.healer.record(death, step, moment, time.perf_counter() - t0, redone, self.done)

    def _rewind(self) -> int:
        """In-process ``trainer.resume=auto``: the newest complete checkpoint (or the run's start), its
        data position, and the metrics rows up to it. Returns how many done steps are done again."""
        ckpt = find_checkpoint("auto", self.run_dir) or self.base_ckpt
        if ckpt:
            meta = read_checkpoint(ckpt)
            self.trainers.load(ckpt)
            self.fresh_trainers = False
            step, position = meta["step"], meta["data_state"]
        else:  # no checkpoint yet: the initial weights
            if not self.fresh_trainers:
                self.trainers = self._new_trainers()
            step, position = self.start, self.positions[self.start]
        ray.get(self.manager.load_state_dict.remote(position))
        redone = self.done - step
        self.logger.rewind(step)
        self.done, self.pending, self.positions[step] = step, None, position
        return redone


def position_metrics(state: Dict[str, Any]) -> Dict[str, float]:
    """The data position as metrics (``data/*``): the same run resumed or healed has the same columns."""
    return {f"data/{k}": float(state[k]) for k in ("epoch", "offset", "next_group_index")
            if isinstance(state.get(k), (int, float))}


def push_weights(manager, trainers: TrainerGroup, version: int, offload: Offload = Offload(),
                 fault_tolerance: bool = False, healer: Optional[Healer] = None,
                 reconnect: bool = False) -> Dict[str, float]:
    """Trainer -> engines, weight version ``version``. Engines that offload (asleep, the trainer
    awake): the trainer sleeps if it offloads, else returns its cached activation memory; the engines
    take back memory for their weights only, the push, then the engines' KV cache, so that two copies
    of the weights plus a KV cache never share a GPU. Without offload, only the push. With
    ``push_first``, the trainer's optimizer state goes before the push and its weights after it.

    With fault tolerance, the push goes to the engines running now: when engines have failed or
    restarted since the last push, the trainers reconnect first (a weight-update group has a fixed
    set of members), and afterwards the restarted engines take requests again. A push that fails (an
    engine died or hung past ``sync.push_timeout_s`` during it) is not an error: the engines that do
    not answer are restarted, and the push goes again to the others (at most once per engine)."""
    if offload.trainer:  # push_before_offload: the weights stay for the push (GPU speed), the rest goes now
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
            if healer is not None:
                healer.count("push_retries")
    if offload.trainer and offload.push_first:
        trainers.offload()
    if offload.engines:
        ray.get(manager.onload_kv.remote())
    if fault_tolerance:
        ray.get(manager.weights_pushed.remote(version))
    return sync


def wait_rollout(rollout, manager, trainers: TrainerGroup, version: int, restore_engines: bool):
    """The rollout's result. ``restore_engines`` (fault tolerance in a synchronous run, whose trainers
    are idle meanwhile and hold the rollout's weights): an engine restarted during the rollout gets
    those weights at once and serves the rest of it, instead of waiting for the next step (and a
    rollout whose every engine failed can finish at all)."""
    if not restore_engines:
        return ray.get(rollout)
    while True:
        ready, _ = ray.wait([rollout], timeout=1.0)
        if ready:
            return ray.get(rollout)
        endpoints = ray.get(manager.awaiting_weights.remote())
        if endpoints:
            try:
                trainers.reconnect(endpoints)
                trainers.update_weights(version)
            except WeightSyncError as e:  # an engine failed again: the fleet restarts it, and we come back here
                log.warning("%s; pushing again once the engines are checked", getattr(e, "cause", e))
                continue
            joined = ray.get(manager.weights_pushed.remote(version))
            log.warning("engine(s) %s restarted mid-rollout, got weights v%d and serve again", joined, version)


def summarize(history: List[Dict[str, Any]], num_rollout: int, wall_s: float, run_dir: str) -> Dict[str, Any]:
    """summary.json: the first and last held-out rewards, the first and last training rewards, the
    largest log-prob gap."""
    def has_eval(row: Dict[str, Any]) -> bool:
        return any(k.startswith("eval/") and k.endswith("/reward") for k in row)

    rewards = [r["rollout/reward_mean"] for r in history if "rollout/reward_mean" in r]
    return {
        "steps": num_rollout,
        "wall_s": round(wall_s, 2),
        "eval_reward_initial": _eval_reward(next((r for r in history if has_eval(r)), {})),
        "eval_reward_final": _eval_reward(next((r for r in reversed(history) if has_eval(r)), {})),
        "train_reward_first": rewards[0] if rewards else None,
        "train_reward_last": rewards[-1] if rewards else None,
        "max_logprob_abs_diff": max((r["train/train_rollout_logprob_abs_diff"] for r in history
                                     if "train/train_rollout_logprob_abs_diff" in r), default=None),
        "run_dir": run_dir,
    }


def check_logprob_gap(cfg: RunConfig, metrics: Dict[str, float], step: int) -> None:
    """``sync.max_logprob_diff``: stop when the engines' log-probs drift from the trainer's (stale or
    corrupted weights, a precision mismatch), like slime's CI guard."""
    gap = metrics.get("train/train_rollout_logprob_abs_diff")
    limit = cfg.sync.max_logprob_diff
    on_policy = cfg.trainer.mode == "sync" and not cfg.rollout.partial_rollout  # else older weights made some tokens
    if limit is not None and gap is not None and gap > limit and on_policy:
        raise RuntimeError(f"step {step}: |rollout - trainer| log-prob gap {gap:.3g} > sync.max_logprob_diff={limit}: "
                           "the engines do not run the trainer's weights. Check that the last weight push reached "
                           "every engine (logs/engine_*.log), that the engine's dtype matches model.dtype, and that "
                           "a custom generate function samples at rollout.temperature with no top_p / top_k (the "
                           "trainer scores plain temperature sampling)")


def wait_or_stalled(rollout, manager, fault_tolerance: bool) -> None:
    """Until the rollout is done, or (fault tolerance) it cannot go on without a weight push: every
    engine failed, and the restarted ones wait for weights; the push then brings this step's
    weights, and the manager generates the rollout again with them (``WeightsChanged``)."""
    if not fault_tolerance:
        ray.wait([rollout])
        return
    while not ray.wait([rollout], timeout=1.0)[0]:
        if ray.get(manager.stalled.remote()):
            log.warning("every engine failed during the rollout; pushing the new weights to the restarted ones")
            return


def check_staleness(cfg: RunConfig, metrics: Dict[str, float], step: int) -> None:
    """``trainer.max_staleness`` (async runs): stop when a sample's weights lag the trainer by more
    training steps than allowed."""
    lag = metrics.get("rollout/staleness_max")
    if cfg.trainer.mode == "async" and lag is not None and lag > cfg.trainer.max_staleness:
        raise RuntimeError(f"step {step}: a sample was generated by weights {lag:g} training steps older than the "
                           f"trainer's, more than trainer.max_staleness={cfg.trainer.max_staleness} (raise it, or "
                           "lower trainer.update_weights_interval)")


def carry_history(ckpt: str, run_dir: str, step: int) -> None:
    """Resuming another run's checkpoint in a new run directory: start this run's metrics.jsonl
    with that run's rows up to the checkpoint, so curves and the summary cover the whole run."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(ckpt))), "metrics.jsonl")
    dst = os.path.join(run_dir, "metrics.jsonl")
    if os.path.abspath(src) == os.path.abspath(dst) or not os.path.exists(src) or os.path.exists(dst):
        return
    with open(src) as f:
        rows = [line for line in f if json.loads(line).get("step", 0) <= step]
    with open(dst + ".tmp", "w") as f:
        f.writelines(rows)
    os.replace(dst + ".tmp", dst)


def _eval_reward(metrics: Dict[str, Any]) -> float:
    vals = [v for k, v in metrics.items() if k.startswith("eval/") and k.endswith("/reward")]
    return sum(vals) / len(vals) if vals else math.nan


def _eval(ref, logger: RunLogger, step: int) -> Dict[str, float]:
    """The eval's result (``ref``: the manager's ``eval``), its examples written to the log."""
    out = ray.get(ref)
    parts = []
    for key, v in out.items():
        if key.endswith("/examples"):
            for ex in v:
                logger.write(f"  [{key.split('/')[1]}] {ex['prompt']!r} -> {ex['response']!r} "
                             f"(label {ex['label']!r}, reward {ex['reward']})")
        elif key.endswith("/reward"):
            parts.append(f"{key.removeprefix('eval/')} {v:.3f}")
    logger.write(f"step {step}: eval " + ", ".join(parts))
    return {k: v for k, v in out.items() if not k.endswith("/examples")}
