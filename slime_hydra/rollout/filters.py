"""Dynamic sampling filters (DAPO, arXiv 2503.14476): which finished groups a rollout keeps.

A filter is ``rollout.dynamic_filter`` (a dotted path or a ``_target_`` node; extra keys are bound
as keyword arguments) with slime's signature::

    def my_filter(cfg: RunConfig, group: list[Sample], **kwargs) -> DynamicFilterOutput | bool

It runs (maybe async) on every finished group; a dropped group is replaced by pulling more prompts.
``reason`` names the drop in the metrics (``rollout/dynamic_filter/drop_<reason>``); ``keep_when_insufficient``
keeps a rejected group when dropping it would need another sampling round (slime's ``_with_fallback``).
``algo.dynamic_sampling=true`` means :func:`nonzero_reward_std` unless ``rollout.dynamic_filter`` is set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from slime_hydra.data.sample import Sample

NONZERO_REWARD_STD = "slime_hydra.rollout.filters.nonzero_reward_std"


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: Optional[str] = None  # why the group was dropped (a metric name suffix)
    keep_when_insufficient: bool = False  # keep it anyway rather than sample another round


def zero_std(rewards: Sequence[float], threshold: float = 1e-6) -> bool:
    """The rewards of a group are all equal: their (sample) standard deviation is at most ``threshold``."""
    if len(rewards) < 2:
        return True
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) <= threshold


def nonzero_reward_std(cfg: Any, group: List[Sample], threshold: float = 1e-6) -> DynamicFilterOutput:
    """Keep a group only if its rewards are not all equal (slime's ``check_reward_nonzero_std``): equal rewards
    give zero advantage. Dropped groups count as ``zero_std_<reward>`` (e.g. ``zero_std_0.0``: all wrong)."""
    rewards = [s.reward_value(getattr(getattr(cfg, "reward", None), "key", None)) for s in group]
    if not zero_std(rewards, threshold):
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason=f"zero_std_{round(rewards[0], 1)}")


def nonzero_reward_std_with_fallback(cfg: Any, group: List[Sample], threshold: float = 1e-6) -> DynamicFilterOutput:
    """:func:`nonzero_reward_std`, but a zero-std group is kept when the rollout would otherwise need another
    sampling round."""
    out = nonzero_reward_std(cfg, group, threshold)
    out.keep_when_insufficient = True
    return out


def dynamic_filter_spec(cfg: Any) -> Any:
    """``rollout.dynamic_filter``, else :func:`nonzero_reward_std` with ``algo.dynamic_sampling``, else None."""
    if cfg.rollout.dynamic_filter is not None:
        return cfg.rollout.dynamic_filter
    return NONZERO_REWARD_STD if getattr(cfg.algo, "dynamic_sampling", False) else None


def as_filter_output(out: Any, where: str = "rollout.dynamic_filter") -> DynamicFilterOutput:
    """A filter's return value (a bool, or an object with a ``keep``) -> DynamicFilterOutput; else a TypeError."""
    if isinstance(out, DynamicFilterOutput):
        return out
    if _is_bool(out):
        return DynamicFilterOutput(keep=bool(out), reason=None if out else "filtered")
    if hasattr(out, "keep") and _is_bool(out.keep):
        return DynamicFilterOutput(keep=bool(out.keep), reason=getattr(out, "reason", None),
                                   keep_when_insufficient=bool(getattr(out, "keep_when_insufficient", False)))
    raise TypeError(f"{where} returned {type(out).__name__} ({out!r:.80}); expected a bool or "
                    "slime_hydra.rollout.filters.DynamicFilterOutput(keep, reason)")


def _is_bool(x: Any) -> bool:
    """bool, numpy.bool_, or a one-element boolean tensor (``std() > eps`` in slime's filters)."""
    if isinstance(x, bool) or type(x).__name__ == "bool_":
        return True
    return type(x).__name__ == "Tensor" and x.numel() == 1 and str(x.dtype) == "torch.bool"
