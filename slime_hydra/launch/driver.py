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
before training. Without offload nothing moves: the push reads the trainer's GPU tensors.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

import ray

from slime_hydra.checkpoint.ckpt import find_checkpoint, read_checkpoint, remove_partial, save_checkpoint
from slime_hydra.checkpoint.hf import initial_checkpoint
from slime_hydra.config.schema import RunConfig
from slime_hydra.launch.cluster import TrainerGroup, create_placement_group, placed, ray_cluster
from slime_hydra.launch.lease import RunLease
from slime_hydra.logging.metrics import RunLogger
from slime_hydra.plan.resources import ResourcePlan

log = logging.getLogger("slime_hydra")
# Called as hook(step, metrics) after each eval: a sweep's pruner (slime_hydra/sweep/optuna.py) stops a weak
# trial by raising from here.
EVAL_HOOKS: List[Callable[[int, Dict[str, float]], None]] = []


@dataclass(frozen=True)
class Offload:
    """What takes turns on colocated GPUs (``parallelism.offload_train`` / ``offload_rollout``)."""

    trainer: bool = False
    engines: bool = False

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "Offload":
        p = cfg.parallelism
        return cls(trainer=bool(p.colocate and p.offload_train), engines=bool(p.colocate and p.offload_rollout))


def periodic(step: int, interval: int, last: int) -> bool:
    return step == last or (interval > 0 and step % interval == 0)


def train(cfg: RunConfig, plan: ResourcePlan) -> Dict[str, Any]:
    """The whole run. A run directory has one driver at a time, and a driver that was killed leaves
    nothing behind for long: the next start in its run directory kills its leftover processes
    (``RunLease``) and removes its half-written checkpoint."""
    t_start = time.perf_counter()
    with RunLease(cfg.output_dir) as lease:
        partial = remove_partial(cfg.output_dir)
        if partial:
            log.warning("removed the incomplete checkpoint(s) %s of an interrupted save", partial)
        model_path = initial_checkpoint(cfg.model, cfg.output_dir)
        return _train(cfg, plan, model_path, t_start, lease)


def _train(cfg: RunConfig, plan: ResourcePlan, model_path: str, t_start: float, lease: RunLease) -> Dict[str, Any]:
    with ray_cluster(cfg, plan) as ray_session_dir:
        lease.note_ray_session(ray_session_dir)
        pg = create_placement_group(plan)
        plan = placed(plan, pg)
        from slime_hydra.rollout.manager import FLEET_GROUP, RolloutManager

        manager = ray.remote(num_cpus=0, concurrency_groups={FLEET_GROUP: 1})(RolloutManager).remote(
            cfg, plan, pg, model_path)
        trainers = TrainerGroup(cfg, plan, pg, model_path)
        try:
            return _loop(cfg, manager, trainers, model_path, t_start)
        finally:
            for shutdown in (lambda: trainers.shutdown(), lambda: ray.get(manager.shutdown.remote(), timeout=60)):
                try:
                    shutdown()
                except Exception as e:  # noqa: BLE001 - best effort while tearing down
                    log.warning("shutdown: %s", e)


def _loop(cfg: RunConfig, manager, trainers: TrainerGroup, model_path: str, t_start: float) -> Dict[str, Any]:
    run_dir = cfg.output_dir
    num_rollout = cfg.trainer.num_rollout
    if num_rollout is None:  # from data.num_epoch
        num_rollout = ray.get(manager.num_train_prompts.remote()) // cfg.rollout.batch_size * cfg.data.num_epoch
    trainers.set_num_rollout(num_rollout)  # the learning-rate schedule's length
    start = 0
    ckpt = find_checkpoint(cfg.trainer.resume, run_dir) if cfg.trainer.resume else None
    if ckpt:
        meta = read_checkpoint(ckpt)
        trainers.load(ckpt)
        ray.get(manager.load_state_dict.remote(meta["data_state"]))
        start = meta["step"]
        carry_history(ckpt, run_dir, start)
        log.info("resumed from %s at step %d", ckpt, start)
    logger = RunLogger(cfg, num_rollout, start, keep_until=start if ckpt else None)
    try:
        return _steps(cfg, manager, trainers, model_path, logger, start, num_rollout, t_start)
    finally:
        logger.close()


def _steps(cfg: RunConfig, manager, trainers: TrainerGroup, model_path: str, logger: RunLogger, start: int,
           num_rollout: int, t_start: float) -> Dict[str, Any]:
    run_dir, is_async = cfg.output_dir, cfg.trainer.mode == "async"
    offload = Offload.from_config(cfg)
    ft = cfg.rollout.fault_tolerance
    trainers.connect(ray.get(manager.endpoints.remote()))
    if offload.engines:  # the engines start awake; push_weights expects them asleep, as after a training step
        ray.get(manager.offload.remote())
    sync = push_weights(manager, trainers, start, offload, ft)
    log.info("weights v%d pushed to the engines (%.2fs over %s)", start, sync["seconds"], cfg.sync.transport)

    evals: Dict[str, float] = {}
    if cfg.eval.datasets and cfg.eval.before_train and start == 0:
        evals = _eval(manager, logger, 0)
        logger.log(0, evals)
    version = start
    next_rollout = manager.generate.remote(start, version) if start < num_rollout else None
    for step in range(start + 1, num_rollout + 1):
        t0 = time.perf_counter()
        data_refs, metrics = wait_rollout(next_rollout, manager, trainers, version, ft and not is_async)
        t_rollout = time.perf_counter() - t0
        if is_async and step < num_rollout:
            next_rollout = manager.generate.remote(step, version)  # overlaps with training below
        t_moves = time.perf_counter()
        if offload.engines:
            ray.get(manager.offload.remote())
        if offload.trainer:
            trainers.onload()
        t_moves = time.perf_counter() - t_moves if offload.engines or offload.trainer else 0.0
        t1 = time.perf_counter()
        train_metrics = trainers.train(data_refs, cfg.rollout.temperature, cfg.rollout.max_response_len)
        metrics.update({f"train/{k}": v for k, v in train_metrics.items()})
        t_train = time.perf_counter() - t1
        check_logprob_gap(cfg, metrics, step)
        check_staleness(cfg, metrics, step)
        t2 = time.perf_counter()
        if step % cfg.trainer.update_weights_interval == 0 or step == num_rollout:
            if is_async and step < num_rollout:
                wait_or_stalled(next_rollout, manager, ft)  # never change weights under a running rollout
            sync = push_weights(manager, trainers, step, offload, ft)
            version = step
            metrics["perf/weight_sync_bytes"] = sync["bytes"]
            metrics["perf/weight_push_time"] = sync["seconds"]  # the pushing rank's, of perf/weight_sync_time
            metrics["perf/weight_transfer_time"] = sync["transfer_seconds"]  # the weights alone, of the push
        t_sync = time.perf_counter() - t2
        if cfg.eval.datasets and periodic(step, cfg.eval.interval, num_rollout):
            evals = _eval(manager, logger, step)
            metrics.update(evals)
        step_time = time.perf_counter() - t0
        metrics.update({"perf/step_time": step_time, "perf/rollout_wait_time": t_rollout, "perf/train_time": t_train,
                        "perf/weight_sync_time": t_sync, "perf/offload_time": t_moves,
                        "perf/tokens_per_s": metrics["rollout/response_tokens"] / max(step_time, 1e-9)})
        logger.log(step, metrics)  # before the checkpoint: a complete checkpoint of step s has row s written
        logger.progress(metrics)
        for hook in EVAL_HOOKS if any(k.startswith("eval/") for k in metrics) else ():
            hook(step, metrics)  # after the row is written: a pruned trial's curve ends at its last eval
        if periodic(step, cfg.trainer.save_interval, num_rollout):
            # the data position after rollout `step` (an async run has already started the next one)
            state = ray.get(manager.state_dict.remote(step))
            save_checkpoint(run_dir, step, lambda d: trainers.save(d, model_path), state, cfg.trainer.keep_checkpoints)
        if not is_async and step < num_rollout:
            next_rollout = manager.generate.remote(step, version)

    summary = summarize(logger.history, num_rollout, time.perf_counter() - t_start, run_dir)
    logger.finish(summary)
    return summary


def push_weights(manager, trainers: TrainerGroup, version: int, offload: Offload = Offload(),
                 fault_tolerance: bool = False) -> Dict[str, float]:
    """Trainer -> engines, weight version ``version``. Engines that offload (asleep, the trainer
    awake): the trainer sleeps if it offloads, else returns its cached activation memory; the engines
    take back memory for their weights only, the push, then the engines' KV cache, so that two copies
    of the weights plus a KV cache never share a GPU. Without offload, only the push.

    With fault tolerance, the push goes to the engines running now: when engines have failed or
    restarted since the last push, the trainers reconnect first (a weight-update group has a fixed
    set of members), and afterwards the restarted engines take requests again."""
    if fault_tolerance:
        endpoints = ray.get(manager.weight_endpoints.remote())
        if [e["url"] for e in endpoints] != trainers.connected:
            trainers.reconnect(endpoints)
    if offload.trainer:
        trainers.offload()
    elif offload.engines:  # the trainer stays: its allocator gives back what training freed
        trainers.free_cache()
    if offload.engines:
        ray.get(manager.onload_weights.remote())
    sync = trainers.update_weights(version)
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
            trainers.reconnect(endpoints)
            trainers.update_weights(version)
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
                           "rollout.temperature / top_p / top_k are what the trainer scores with (the trainer "
                           "assumes plain temperature sampling)")


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


def _eval(manager, logger: RunLogger, step: int) -> Dict[str, float]:
    out = ray.get(manager.eval.remote())
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
