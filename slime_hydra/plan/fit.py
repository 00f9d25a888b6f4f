"""Choices the plan makes so that a run fits its GPUs, where the config leaves them to it: what colocated GPUs
offload, the micro-batch and recompute (docs/memory.md). :func:`suggestion` names settings that fit a config
that does not. On CPU (no estimate) ``auto`` takes ``CPU_DEFAULTS``.
"""

from __future__ import annotations

from dataclasses import replace
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from slime_hydra.plan.activations import rank_step_samples
from slime_hydra.plan.memory import (
    AUTO_OFFLOAD_HEADROOM,
    OFFLOAD_CHOICES,
    PUSH_PHASE,
    TRAINER_MEMORY,
    colocated_peaks,
    estimate,
    resident,
)
from slime_hydra.plan.resources import make_plan

if TYPE_CHECKING:
    from slime_hydra.config.schema import RunConfig

AUTO = "auto"
# tokens a micro-batch should hold before recompute is worth avoiding (fewer leave a GPU's matmuls short of work)
AUTO_TARGET_TOKENS = 4096
# what ``auto`` means where nothing is estimated (CPU, or a backend without a memory function)
CPU_DEFAULTS = {"micro_batch_size": 64, "gradient_checkpointing": False, "max_tokens_per_micro_batch": 16384,
                "recompute": "none"}


def fit(cfg: "RunConfig") -> List[str]:
    """Fill every choice ``cfg`` leaves to the plan, in place; one line per choice made, for the print-out."""
    t = cfg.trainer
    estimated = cfg.parallelism.device == "cuda" and t.backend in TRAINER_MEMORY
    knobs = [k for k in _knob_keys(cfg) if getattr(t, k) == AUTO] if estimated else []
    for k in CPU_DEFAULTS:  # what is not estimated, or not this backend's, takes the CPU default
        if getattr(t, k) == AUTO and k not in knobs:
            setattr(t, k, CPU_DEFAULTS[k])
    if not knobs:
        resolve_offload(cfg)
        resolve_warm_up(cfg)
        return []
    _set(cfg, _knobs(cfg, _target_index(cfg), False, set(knobs)))
    resolve_offload(cfg)  # the offload is chosen for a good micro-batch, then the micro-batch for the offload
    _set(cfg, {k: AUTO for k in knobs})
    choice = _choose_micro_batch(cfg, set(knobs))
    resolve_warm_up(cfg)
    return [choice]


def resolve_warm_up(cfg: "RunConfig") -> None:
    """``trainer.warm_up=auto``: on GPUs, unless colocated with offload (there the warm-up's gradients, beside
    the whole engine at start-up, are memory the plan does not count)."""
    t, p = cfg.trainer, cfg.parallelism
    if t.warm_up == AUTO:
        t.warm_up = p.device == "cuda" and not (p.colocate and (p.offload_train or p.offload_rollout))


def resolve_offload(cfg: "RunConfig") -> "RunConfig":
    """Fill the offload that ``config.resolve`` leaves unset (it needs the plan), in place; returns ``cfg``."""
    p = cfg.parallelism
    if None in (p.offload_train, p.offload_rollout):
        p.offload_train, p.offload_rollout = choose_offload(cfg)
    if p.push_before_offload is None:
        p.push_before_offload = choose_push_before_offload(cfg)
    return cfg


def choose_push_before_offload(cfg: "RunConfig") -> bool:
    """With ``offload_train``: push from the trainer's GPU weights (faster than from the host) where that phase
    leaves ``AUTO_OFFLOAD_HEADROOM`` of the GPU free."""
    p = cfg.parallelism
    if not (p.colocate and p.offload_train):
        return False
    trial = replace(cfg, parallelism=replace(p, push_before_offload=True))
    try:
        phase = estimate(trial, make_plan(trial)).gpus.get(PUSH_PHASE, 0.0)
    except (ArithmeticError, ValueError):  # a layout that validation refuses (and says why)
        return False
    return phase <= _limit(cfg)


def choose_offload(cfg: "RunConfig") -> Tuple[bool, bool]:
    """(offload_train, offload_rollout) for colocated GPUs, keeping a value the config sets: the first of
    ``OFFLOAD_CHOICES`` whose peak leaves ``AUTO_OFFLOAD_HEADROOM`` of the GPU free, else the most offload."""
    p = cfg.parallelism
    fixed = (p.offload_train, p.offload_rollout)
    if resident(cfg):  # nothing takes turns (config.resolve fills these first; suggestion's trials come here)
        return (bool(fixed[0]), bool(fixed[1]))
    allowed = [c for c in OFFLOAD_CHOICES if all(f is None or f == v for f, v in zip(fixed, c))]
    try:
        peaks = colocated_peaks(cfg, make_plan(cfg))
    except (ArithmeticError, ValueError):  # a layout that validation refuses (and says why): offload meanwhile
        return allowed[-1]
    return next((c for c in allowed if peaks[c] <= _limit(cfg)), allowed[-1])


def suggestion(cfg: "RunConfig") -> Optional[str]:
    """For a config that does not fit: the micro-batch, recompute and offload the plan would choose, when they
    fit and differ from the config's (else None). Async on colocated GPUs tries the sync loop second."""
    for mode in (cfg.trainer.mode, "sync") if resident(cfg) else (cfg.trainer.mode,):
        trial = replace(cfg, trainer=replace(cfg.trainer, mode=mode), parallelism=replace(cfg.parallelism))
        for k in CPU_DEFAULTS:
            setattr(trial.trainer, k, AUTO if k in _knob_keys(cfg) else getattr(cfg.trainer, k))
        trial.parallelism.offload_train = trial.parallelism.offload_rollout = None
        if resident(cfg) and not resident(trial):  # what a sync run would choose for it
            trial.parallelism.push_before_offload = None
        fit(trial)
        if _peak(trial) <= _limit(trial):
            break
    else:
        return None
    keys = ["trainer.mode", *(f"trainer.{k}" for k in CPU_DEFAULTS), "parallelism.offload_train",
            "parallelism.offload_rollout"]
    changed = [f"{k}={attrgetter(k)(trial)}" for k in keys if attrgetter(k)(trial) != attrgetter(k)(cfg)]
    why = "" if trial.trainer.mode == cfg.trainer.mode else "; async on colocated GPUs keeps trainer and engine " \
        "resident together"
    return (f"{' '.join(changed)} fits (~{_peak(trial):.0f} GiB{why}; or leave them unset/auto for the plan to "
            "choose)" if changed else None)


def _limit(cfg: "RunConfig") -> float:
    return (1 - AUTO_OFFLOAD_HEADROOM) * cfg.parallelism.gpu_memory_gib


def _peak(cfg: "RunConfig") -> float:
    return estimate(cfg, make_plan(cfg)).peak


def _set(cfg: "RunConfig", knobs: Dict[str, Any]) -> None:
    for k, v in knobs.items():
        setattr(cfg.trainer, k, v)


def _knob_keys(cfg: "RunConfig") -> Tuple[str, str]:
    """The (size, recompute) keys of this backend."""
    if cfg.trainer.backend == "megatron":
        packed = cfg.trainer.max_tokens_per_micro_batch is not None
        return ("max_tokens_per_micro_batch" if packed else "micro_batch_size", "recompute")
    return ("micro_batch_size", "gradient_checkpointing")


def _rank_samples(cfg: "RunConfig") -> int:
    """Samples one data-parallel rank trains in an optimiser step: the largest micro-batch worth trying."""
    p = cfg.parallelism
    return rank_step_samples(cfg, p.trainer_gpus // (p.tensor_parallel * p.pipeline_parallel * p.context_parallel))


def _seq_len(cfg: "RunConfig") -> int:
    return (cfg.rollout.max_prompt_len or 0) + cfg.rollout.max_response_len


def _sizes(cfg: "RunConfig") -> List[int]:
    """Micro-batch sizes to try, largest first, in samples: the rank's whole step, then halves."""
    n = _rank_samples(cfg)
    return [n >> i for i in range(n.bit_length())]


def _target_index(cfg: "RunConfig") -> int:
    """The smallest size that holds ``AUTO_TARGET_TOKENS`` (the whole step when it holds fewer)."""
    sizes = _sizes(cfg)
    return max((i for i, n in enumerate(sizes) if n * _seq_len(cfg) >= AUTO_TARGET_TOKENS), default=0)


def _knobs(cfg: "RunConfig", index: int, recompute: bool, auto: Set[str]) -> Dict[str, Any]:
    """The trainer settings of candidate ``index`` of :func:`_sizes` for the keys in ``auto``."""
    size_key, rec_key = _knob_keys(cfg)
    n = size = _sizes(cfg)[index]
    if size_key == "max_tokens_per_micro_batch":  # unbounded prompts (max_prompt_len unset) need room beyond
        size = max(n * _seq_len(cfg), AUTO_TARGET_TOKENS if cfg.rollout.max_prompt_len is None else 0)
    rec = ("full" if recompute else "none") if rec_key == "recompute" else recompute
    return {k: v for k, v in ((size_key, size), (rec_key, rec)) if k in auto}


def _choose_micro_batch(cfg: "RunConfig", auto: Set[str]) -> str:
    """Set the size and recompute keys named in ``auto`` (docs/memory.md); the line that says what and why."""
    size_key, rec_key = _knob_keys(cfg)
    t, seq = cfg.trainer, _seq_len(cfg)
    tried: Dict[Tuple[int, bool], float] = {}

    def peak(i: int, rec: bool) -> float:
        if (i, rec) not in tried:
            _set(cfg, _knobs(cfg, i, rec, auto))
            try:
                tried[(i, rec)] = _peak(cfg)
            except (ArithmeticError, ValueError):  # a layout that validation refuses, and says why
                tried[(i, rec)] = float("inf")
        return tried[(i, rec)]

    def largest(rec: bool) -> Optional[int]:
        return next((i for i in range(len(_sizes(cfg))) if peak(i, rec) <= _limit(cfg)), None)

    recs = [False, True] if rec_key in auto else [getattr(t, rec_key) not in (False, "none")]
    best, rec = largest(recs[0]), recs[0]
    if len(recs) == 2 and (best is None or _sizes(cfg)[best] * seq < min(AUTO_TARGET_TOKENS, _sizes(cfg)[0] * seq)):
        with_rec = largest(True)
        if with_rec is not None and (best is None or with_rec < best):
            best, rec = with_rec, True
    chosen = best if best is not None else len(_sizes(cfg)) - 1  # nothing fits: validation says by how much
    if best is None and len(recs) == 2:
        rec = True
    _set(cfg, _knobs(cfg, chosen, rec, auto))
    peak(chosen, rec)
    size = getattr(t, size_key)
    kept = None if size_key in auto else (  # a size the user set is kept: its own samples
        size // max(seq, 1) if size_key == "max_tokens_per_micro_batch" else min(size, _rank_samples(cfg)))
    samples = _sizes(cfg)[chosen] if kept is None else kept
    shown = ", ".join(f"{_sizes(cfg)[i] if kept is None else kept}{'+rc' if r else ''} {v:.1f}"
                      for (i, r), v in sorted(tried.items()))
    what = f"{size_key}={size} ({samples} samples of up to {seq} tokens), {rec_key}={getattr(t, rec_key)}"
    why = (f"the largest whose peak fits {_limit(cfg):g} GiB ({1 - AUTO_OFFLOAD_HEADROOM:.0%} of the GPU)"
           if best is not None else f"nothing fits {_limit(cfg):g} GiB: the smallest, refused below")
    return f"micro-batch (auto): {what}: {why}; peak GiB by samples (+rc: recompute): {shown}"
