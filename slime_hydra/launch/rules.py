"""Config rules of the launch: placement (``parallelism.*`` slots, nodes and engines; ``cluster.*``), the step
loop (``trainer.mode``, how many rollouts, the intervals) and ``sweep.*``."""

from __future__ import annotations

from typing import List

from slime_hydra.config.rules import choice
from slime_hydra.config.schema import RunConfig

LOOP_MODES = ("sync", "async")  # the driver's two loops
PREEMPT_SIGNALS = ("TERM", "USR1", "USR2", "HUP", "XCPU")  # signals a scheduler sends ahead (launch/preempt.py)
# summary.json's numbers (driver.summarize) that a sweep job can return as its objective (sweep.optimized_metric)
SUMMARY_METRICS = ("eval_reward_final", "eval_reward_initial", "train_reward_last", "train_reward_first", "wall_s")


def check(cfg: RunConfig) -> List[str]:
    return _check_placement(cfg) + _check_loop(cfg) + _check_sweep(cfg)


def _check_sweep(cfg: RunConfig) -> List[str]:
    errs: List[str] = []
    s = cfg.sweep
    choice(errs, "sweep.optimized_metric", s.optimized_metric, SUMMARY_METRICS)
    if s.max_concurrent < 1:
        errs.append(f"sweep.max_concurrent: must be >= 1, got {s.max_concurrent}")
    for name in ("num_cpus", "num_gpus"):
        if getattr(s, name) is not None and getattr(s, name) < (1 if name == "num_cpus" else 0):
            errs.append(f"sweep.{name}: must be >= {1 if name == 'num_cpus' else 0} or null, got {getattr(s, name)}")
    return errs


def _check_placement(cfg: RunConfig) -> List[str]:
    errs: List[str] = []
    p = cfg.parallelism
    choice(errs, "parallelism.device", p.device, ["cpu", "cuda"])
    for name in ("trainer_gpus", "rollout_gpus", "gpus_per_engine", "num_nodes", "gpus_per_node"):
        if getattr(p, name) < 1:
            errs.append(f"parallelism.{name}: must be >= 1, got {getattr(p, name)}")
    if p.num_nodes > 1 and not cfg.cluster.address:
        errs.append(f"cluster.address: required for parallelism.num_nodes={p.num_nodes} (a local Ray cluster has one "
                    "node; join a running one, e.g. cluster.address=auto)")
    if min(p.trainer_gpus, p.rollout_gpus, p.gpus_per_engine, p.gpus_per_node, p.num_nodes) < 1:
        return errs
    total = p.num_nodes * p.gpus_per_node
    need = max(p.trainer_gpus, p.rollout_gpus) if p.colocate else p.trainer_gpus + p.rollout_gpus
    layout = "colocated: max(trainer, rollout)" if p.colocate else "split: trainer + rollout"
    if need > total:
        errs.append(f"parallelism: the plan needs {need} {'GPUs' if p.device == 'cuda' else 'slots'} ({layout}) but "
                    f"num_nodes x gpus_per_node = {p.num_nodes} x {p.gpus_per_node} = {total}")
    if p.rollout_gpus < p.gpus_per_engine:
        errs.append(f"parallelism.rollout_gpus: {p.rollout_gpus} < gpus_per_engine={p.gpus_per_engine} gives 0 rollout "
                    "engines (at least one is needed)")
    elif p.rollout_gpus % p.gpus_per_engine:
        errs.append(f"parallelism.rollout_gpus: {p.rollout_gpus} is not divisible by "
                    f"gpus_per_engine={p.gpus_per_engine}")
    if p.gpus_per_engine > p.gpus_per_node and p.gpus_per_engine % p.gpus_per_node:
        errs.append(f"parallelism.gpus_per_engine: {p.gpus_per_engine} spans nodes, so it must be a multiple of "
                    f"gpus_per_node={p.gpus_per_node}")
    if p.colocate and p.rollout_gpus > p.trainer_gpus:
        errs.append(f"parallelism.rollout_gpus: {p.rollout_gpus} > trainer_gpus={p.trainer_gpus}; colocated engines "
                    "must sit on trainer GPUs")
    for name in ("offload_train", "offload_rollout"):  # colocated: the memory estimate says what fits
        if getattr(p, name) and not p.colocate:
            errs.append(f"parallelism.{name}: true needs parallelism.colocate=true (split, trainers and engines "
                        "have GPUs of their own: nothing takes turns)")
    return errs


def _check_loop(cfg: RunConfig) -> List[str]:
    errs: List[str] = []
    t, p = cfg.trainer, cfg.parallelism
    choice(errs, "trainer.mode", t.mode, LOOP_MODES)
    if t.mode == "async" and p.colocate:  # the GPU cannot take turns: both sides stay resident
        for name in ("offload_train", "offload_rollout"):
            if getattr(p, name):
                errs.append(f"parallelism.{name}: true with trainer.mode=async on colocated GPUs: async (one-step "
                            "off-policy) trains while the next rollout generates on the same GPUs, so the trainer's "
                            "state and the engines' weights and KV cache both stay resident and nothing can be "
                            f"offloaded; set parallelism.{name}=false (or leave it unset), or "
                            "parallelism.colocate=false, or trainer.mode=sync")
    if t.num_rollout is None and cfg.data.num_epoch is None:
        errs.append("trainer.num_rollout: set trainer.num_rollout or data.num_epoch")
    if t.num_rollout is not None and cfg.data.num_epoch is not None:
        errs.append("data.num_epoch: set only one of trainer.num_rollout and data.num_epoch")
    if t.num_rollout is not None and t.num_rollout < 0:
        errs.append(f"trainer.num_rollout: must be >= 0, got {t.num_rollout}")
    if t.update_weights_interval < 1:
        errs.append(f"trainer.update_weights_interval: must be >= 1, got {t.update_weights_interval}")
    if t.update_weights_interval > 1 and t.mode != "async":
        errs.append("trainer.update_weights_interval: > 1 only makes sense with trainer.mode=async")
    if t.max_staleness < 0:
        errs.append(f"trainer.max_staleness: must be >= 0, got {t.max_staleness}")
    elif t.mode == "async" and t.update_weights_interval > t.max_staleness:
        errs.append(f"trainer.max_staleness: {t.max_staleness} < trainer.update_weights_interval="
                    f"{t.update_weights_interval}: an async run's samples lag the trainer by up to "
                    "update_weights_interval steps")
    if t.preempt_signal is not None and t.preempt_signal not in PREEMPT_SIGNALS:
        errs.append(f"trainer.preempt_signal: one of {', '.join(PREEMPT_SIGNALS)} (a signal's name without SIG) "
                    f"or null, got {t.preempt_signal!r}")
    if t.preempt_grace_s <= 0:
        errs.append(f"trainer.preempt_grace_s: must be > 0, got {t.preempt_grace_s}")
    for key, value in (("trainer.save_interval", t.save_interval), ("eval.interval", cfg.eval.interval)):
        if value < 0:
            errs.append(f"{key}: must be >= 0, got {value}")
    return errs
