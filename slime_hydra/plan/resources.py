"""The resource plan: which actor sits on which bundle of the one placement group, computed without Ray.

Bundles hold one accelerator each (or a CPU "slot"); colocated runs put trainers and engines on the same
bundles (trainers 0.4 of a bundle, engines 0.2), split runs put the engines after the trainers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from slime_hydra.config.schema import RunConfig
from slime_hydra.plan.memory import TRAINER_MEMORY, MemoryEstimate, estimate, kv_cache_hint, offload_summary

TRAINER_SHARE, ENGINE_SHARE = 0.4, 0.2


@dataclass
class TrainerSlot:
    rank: int
    bundle: int


@dataclass
class EngineSlot:
    rank: int
    bundles: List[int]  # the engine's GPUs; its actor(s) sit on the first bundle of each node

    @property
    def lead(self) -> int:
        return self.bundles[0]


@dataclass
class ResourcePlan:
    device: str
    colocate: bool
    gpus_per_node: int
    bundles: List[Dict[str, float]]
    trainers: List[TrainerSlot]
    engines: List[EngineSlot]
    engine_kind: str
    data_parallel: int
    model_parallel: Dict[str, int] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    memory: Optional[MemoryEstimate] = None  # GPUs only
    engine_batch: Optional[int] = None  # most sequences one engine decodes at once in a rollout (None: unknown)
    engine_use: str = "rollout"  # what the engines are for (engine_use)

    @property
    def accelerator(self) -> str:
        return "GPU" if self.device == "cuda" else "CPU"

    @property
    def engine_kv_cap(self) -> Optional[int]:
        """The KV tokens an engine on a GPU shared with a trainer is held to (the estimate's: SGLang sizes its
        pool from the memory free as it starts, which the trainer still moves). None: not colocated, no estimate."""
        return self.memory.kv_cache_tokens if self.colocate and self.memory is not None else None

    def node_of(self, bundle: int) -> int:
        return bundle // self.gpus_per_node

    def describe(self) -> str:
        unit = "GPU" if self.device == "cuda" else "slot"
        mode = "colocated: trainers and engines share the same bundles" if self.colocate else \
            "split: engines on their own bundles"
        res = ", ".join(f"{k}: {v:g}" for k, v in self.bundles[0].items()) if self.bundles else "-"
        lines = [f"Resource plan ({self.device}, {mode})",
                 f"  one placement group (PACK) of {len(self.bundles)} bundles of {{{res}}}",
                 f"  {'bundle':>6}  {'node':>4}  {unit:>4}  actors"]
        for b in range(len(self.bundles)):
            who = [f"trainer {t.rank} ({TRAINER_SHARE:g})" for t in self.trainers if t.bundle == b]
            for e in self.engines:
                if b == e.lead:
                    gpus = f"{len(e.bundles)} {unit}{'s' * (len(e.bundles) > 1)}"
                    who.append(f"{self.engine_kind} engine {e.rank} ({ENGINE_SHARE:g}, {gpus})")
                elif b in e.bundles:
                    who.append(f"(engine {e.rank})")
            lines.append(f"  {b:>6}  {self.node_of(b):>4}  {b % self.gpus_per_node:>4}  {', '.join(who) or '-'}")
        mp = " x ".join(f"{k} {v}" for k, v in self.model_parallel.items())
        lines.append(f"  trainers: {len(self.trainers)} (data parallel {self.data_parallel}; {mp})")
        lines.append(f"  engines: {len(self.engines)} x {len(self.engines[0].bundles) if self.engines else 0} {unit}"
                     + ENGINE_USE_NOTE[self.engine_use])
        lines.append("  rollout manager: 1 actor outside the group (engines' router, data, rewards)")
        lines += [f"  {n}" for n in self.notes]
        if self.memory is not None:
            lines.append(self.memory.describe())
        return "\n".join(lines)


ENGINE_USE_NOTE = {"rollout": "", "eval": " (evaluation only: algo=sft trains on the labels; weights pushed before "
                                            "each eval)", "none": " (algo=sft without eval sets: nothing to sample)"}


def engine_use(cfg: RunConfig) -> str:
    """What the rollout engines are for: ``rollout`` (they sample the training data), ``eval`` (``algo=sft``
    trains on labels, so the engines serve the evaluation only) or ``none`` (SFT without eval sets: none start)."""
    if cfg.algo.advantage_estimator != "sft" or cfg.rollout.rollout_function is not None:
        return "rollout"
    return "eval" if cfg.eval.datasets else "none"


def engine_batch(cfg: RunConfig, engines: int) -> Optional[int]:
    """The most sequences one engine decodes at once in a training rollout (None with a
    ``rollout.rollout_function``): the groups in flight (the batch, with a dynamic filter up to one refill
    more) go round robin to the engines, at most ``rollout.concurrency`` requests of a group each."""
    r = cfg.rollout
    if r.rollout_function is not None or engines < 1:
        return None
    groups = r.batch_size
    if r.dynamic_filter is not None or cfg.algo.dynamic_sampling:
        groups += (r.over_sampling_batch_size or r.batch_size) - 1
    return min(r.concurrency, math.ceil(groups / engines)) * r.n_samples_per_prompt


def make_plan(cfg: RunConfig) -> ResourcePlan:
    """``cfg`` must be resolved and valid."""
    p, r, t = cfg.parallelism, cfg.rollout, cfg.trainer
    use = engine_use(cfg)
    rollout_gpus = 0 if use == "none" else p.rollout_gpus
    colocate = p.colocate and use != "none"
    n_bundles = max(p.trainer_gpus, rollout_gpus) if colocate else p.trainer_gpus + rollout_gpus
    offset = 0 if colocate else p.trainer_gpus
    bundle = {"GPU": 1.0, "CPU": 1.0} if p.device == "cuda" else {"CPU": 1.0}
    trainers = [TrainerSlot(rank=r, bundle=r) for r in range(p.trainer_gpus)]
    engines = [EngineSlot(rank=i, bundles=list(range(offset + i * p.gpus_per_engine,
                                                     offset + (i + 1) * p.gpus_per_engine)))
               for i in range(rollout_gpus // p.gpus_per_engine)]
    mp = {"tp": p.tensor_parallel, "pp": p.pipeline_parallel, "cp": p.context_parallel}
    if p.expert_parallel > 1:  # the experts' own grid: EP x expert TP (x PP), the rest is expert data parallel
        mp.update(ep=p.expert_parallel, etp=p.expert_tensor_parallel or p.tensor_parallel)
    dp = p.trainer_gpus // (p.tensor_parallel * p.pipeline_parallel * p.context_parallel)
    every = "step" if t.update_weights_interval == 1 else f"{t.update_weights_interval} steps"
    notes = [f"batch: {r.batch_size} prompts x {r.n_samples_per_prompt} samples = "
             f"{r.batch_size * r.n_samples_per_prompt} per rollout = {t.num_steps_per_rollout} optimiser step(s) of "
             f"{t.global_batch_size}",
             f"weight sync: {cfg.sync.transport} ({'nccl' if p.device == 'cuda' else 'gloo'} for distributed), "
             + {"eval": "before each eval", "none": "none (no engines)"}.get(use, f"after every {every}"),
             f"offload: train={p.offload_train} rollout={p.offload_rollout}; loop: {t.mode}"
             + ("; the trainers' warm-up pass runs while the engines start" if t.warm_up is True else "")]
    plan = ResourcePlan(device=p.device, colocate=colocate, gpus_per_node=p.gpus_per_node,
                        bundles=[dict(bundle) for _ in range(n_bundles)], trainers=trainers, engines=engines,
                        engine_kind=r.engine, data_parallel=dp, model_parallel=mp, notes=notes,
                        engine_batch=engine_batch(cfg, len(engines)), engine_use=use)
    if p.device == "cuda" and t.backend in TRAINER_MEMORY:
        plan.memory = estimate(cfg, plan)
        if colocate:
            plan.memory.notes.append(offload_summary(cfg, plan))
            if hint := kv_cache_hint(cfg, plan):
                plan.memory.notes.append(hint)
    return plan
