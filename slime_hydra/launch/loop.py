"""The step loop: rollout, offload, train, push, eval, log, save, as slime's train.py. With
``trainer.mode=async`` (its train_async.py) the next rollout generates while this one trains, one step
off-policy, and the weights change only between rollouts. ``train`` starts a run around the loop."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from slime_hydra.checkpoint.ckpt import remove_partial, resumes_in_run_dir
from slime_hydra.config import ConfigError
from slime_hydra.config.deferred import DeferredCheck
from slime_hydra.config.schema import RunConfig
from slime_hydra.launch import preempt
from slime_hydra.launch.cluster import create_placement_group, placed, ray_cluster
from slime_hydra.launch.heal import Healing
from slime_hydra.launch.lease import RunLease
from slime_hydra.launch.parts import Parts, periodic
from slime_hydra.launch.startup import StartupClock, StartupWatch
from slime_hydra.model.hf import initial_checkpoint
from slime_hydra.plan.resources import ResourcePlan
from slime_hydra.rollout.engines import engine_class

log = logging.getLogger("slime_hydra")
# hook(step, metrics) after each row with an eval: a sweep's pruner (sweep/prune.py) stops a weak trial by raising
EVAL_HOOKS: List[Callable[[int, Dict[str, float]], None]] = []


def steps(run: Parts) -> None:
    """Every step from the last one done to the run's last, in a step's order."""
    cfg, last = run.cfg, run.num_rollout
    run.prepare()  # connect the trainers to the engines, push their weights, the eval before training
    while run.done < last:
        preempt.check()  # a preemption stops here, or drops the rollout under way (launch/preempt.py)
        step, t = run.done + 1, {}
        with timed(t, "perf/step_time"):
            with timed(t, "perf/rollout_wait_time"):
                data, m = run.rollout(step)  # async: the one started last step; the next one starts now
            m.update(run.offload())  # colocated GPUs: the engines sleep, the trainer wakes
            with timed(t, "perf/train_time"):
                m.update(run.train(step, data))
            check_logprob_gap(cfg, m, step)
            check_staleness(cfg, m, step)
            evaluates = bool(cfg.eval.datasets) and periodic(step, cfg.eval.interval, last)
            with timed(t, "perf/weight_sync_time"):
                if run.push_due(step, evaluates):
                    m.update(run.push(step))  # async: once the rollout under way is done
            if evaluates:
                m.update(run.eval(step))
        m.update(t, **{"perf/tokens_per_s": m["rollout/response_tokens"] / max(t["perf/step_time"], 1e-9)})
        run.log(step, m)  # before the checkpoint: a complete checkpoint of step s has its row
        for hook in EVAL_HOOKS if any(k.startswith("eval/") for k in m) else ():
            hook(step, m)  # after the row: a pruned trial's curve ends at its last eval
        if periodic(step, cfg.trainer.save_interval, last if cfg.trainer.save_last else -1):
            run.save(step)
        run.done = step


def train(cfg: RunConfig, plan: ResourcePlan, clock: Optional[StartupClock] = None,
          deferred: Sequence[DeferredCheck] = ()) -> Dict[str, Any]:
    """The whole run, one driver per run directory (``RunLease``). ``clock``: the start-up's, begun at launch.
    ``deferred``: validation's checks still running, answered while the engines start (``ConfigError``)."""
    clock = clock or StartupClock()
    clock.add("before_train", time.time() - clock.launched)
    t_start = time.perf_counter()
    with preempt.handling(cfg.trainer), RunLease(cfg.output_dir) as lease, \
            ThreadPoolExecutor(1, thread_name_prefix="initial-checkpoint") as pool:
        if partial := remove_partial(cfg.output_dir):
            log.warning("removed the incomplete checkpoint(s) %s of an interrupted save", partial)
        # a random initial checkpoint (no model.path) is built while Ray starts
        model_path = pool.submit(initial_checkpoint, cfg.model, cfg.output_dir,
                                 resumes_in_run_dir(cfg.trainer.resume, cfg.output_dir))
        t_ray = time.perf_counter()
        with ray_cluster(cfg, plan) as ray_session_dir:
            clock.add("ray_init", time.perf_counter() - t_ray)
            lease.note_ray_session(ray_session_dir)
            preempt.install(cfg.trainer)  # over the native handler ray.init installed
            with clock.part("placement_group"):
                pg = create_placement_group(plan)
            with clock.part("initial_checkpoint"):
                path = model_path.result()
            # the rollout side starts first: its engines take the longest
            run = (Healing if cfg.rollout.fault_tolerance else Parts)(cfg, placed(plan, pg), pg, path, clock)
            preempt.starting(lambda: run.moment in preempt.STARTING)
            try:
                with clock.part("late_checks"):
                    problems = [p for check in deferred for p in check.problems()]
                if problems:
                    raise ConfigError(problems)
                with StartupWatch(clock, run.waiting_for, os.path.join(cfg.output_dir, "logs"),
                                  note=engine_class(cfg.rollout.engine).log_note):
                    summary = _run(run, t_start)
            except BaseException as err:
                if isinstance(err, Exception):  # a stop (Ctrl-C, a preemption) has said its line
                    log.warning("stopping: killing the rollout manager (its engines and router go with it) "
                                "and the trainers")
                run.kill()
                death = run.died(err) if isinstance(err, Exception) and not run.fault_tolerance else None
                if death is not None:
                    raise RuntimeError(f"{death.reason}\n(rollout.fault_tolerance=true rebuilds it)") from err
                raise
            run.shutdown()
            return summary


def _run(run: Parts, t_start: float) -> Dict[str, Any]:
    run.start()
    try:
        run.drive(steps)
        summary = summarize(run.logger.history, run.num_rollout, time.perf_counter() - t_start, run.run_dir)
        if run.clock.done_at is not None:
            summary["startup"] = {k.removeprefix("startup/"): v for k, v in run.clock.metrics().items()}
        run.logger.finish(summary)
        return summary
    except preempt.Preempted as err:
        preempt.wind_down(run, err)
        raise
    finally:
        run.logger.close()


@contextlib.contextmanager
def timed(into: Dict[str, float], key: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    into[key] = time.perf_counter() - t0


def check_logprob_gap(cfg: RunConfig, metrics: Dict[str, float], step: int) -> None:
    """``sync.max_logprob_diff``: stop when the engines' log-probs drift from the trainer's, like slime's CI guard."""
    gap = metrics.get("train/train_rollout_logprob_abs_diff")
    limit = cfg.sync.max_logprob_diff
    on_policy = cfg.trainer.mode == "sync" and not cfg.rollout.partial_rollout  # else older weights made some tokens
    if limit is not None and gap is not None and gap > limit and on_policy:
        raise RuntimeError(f"step {step}: |rollout - trainer| log-prob gap {gap:.3g} > sync.max_logprob_diff={limit}: "
                           "the engines do not run the trainer's weights. Check that the last weight push reached "
                           "every engine (logs/engine_*.log), that the engine's dtype matches model.dtype, and that "
                           "a custom generate function samples at rollout.temperature with no top_p / top_k (the "
                           "trainer scores plain temperature sampling)")


def check_staleness(cfg: RunConfig, metrics: Dict[str, float], step: int) -> None:
    """``trainer.max_staleness`` (async runs): stop when a sample's weights lag the trainer too far."""
    lag = metrics.get("rollout/staleness_max")
    if cfg.trainer.mode == "async" and lag is not None and lag > cfg.trainer.max_staleness:
        raise RuntimeError(f"step {step}: a sample was generated by weights {lag:g} training steps older than the "
                           f"trainer's, more than trainer.max_staleness={cfg.trainer.max_staleness} (raise it, or "
                           "lower trainer.update_weights_interval)")


def summarize(history: List[Dict[str, Any]], num_rollout: int, wall_s: float, run_dir: str) -> Dict[str, Any]:
    """summary.json: the first and last held-out and training rewards, the largest log-prob gap."""
    evals = [r for r in history if any(k.startswith("eval/") and k.endswith("/reward") for k in r)] or [{}]
    rewards = [r["rollout/reward_mean"] for r in history if "rollout/reward_mean" in r] or [None]
    gap = "train/train_rollout_logprob_abs_diff"
    return {"steps": num_rollout, "wall_s": round(wall_s, 2),
            "eval_reward_initial": _eval_reward(evals[0]), "eval_reward_final": _eval_reward(evals[-1]),
            "train_reward_first": rewards[0], "train_reward_last": rewards[-1],
            "max_logprob_abs_diff": max((r[gap] for r in history if gap in r), default=None), "run_dir": run_dir}


def _eval_reward(metrics: Dict[str, Any]) -> float:
    vals = [v for k, v in metrics.items() if k.startswith("eval/") and k.endswith("/reward")]
    return sum(vals) / len(vals) if vals else math.nan
