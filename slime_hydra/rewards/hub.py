"""Reward dispatch: ``sample.metadata["rm_type"]`` first (one dataset may mix tasks), then
``reward.type``. Rewards are returned, not stored: the caller sets ``sample.reward``.

One function per entry of :data:`slime_hydra.rewards.REWARD_TYPES`, each ``(cfg, sample) -> reward``
with ``cfg`` the RewardConfig: ``exact``, ``math``, ``f1`` (built in, pure), ``remote`` (HTTP reward
server) and ``custom`` (``reward.custom``: a hook ``rm(cfg, sample)``, or ``rm(cfg, samples) -> list``
when ``reward.group``; sync or async).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable, Dict, List, Union

from slime_hydra.data.sample import Sample
from slime_hydra.rewards import REWARD_TYPES
from slime_hydra.rewards.math_pool import math_reward_async
from slime_hydra.rewards.remote import RewardError, remote_reward
from slime_hydra.rewards.text import exact_reward, f1_reward
from slime_hydra.utils.hooks import call_maybe_async, load_hook

log = logging.getLogger(__name__)

Reward = Union[float, Dict[str, Any]]

_hooks: Dict[Any, Any] = {}


def reward_type(cfg: Any, sample: Sample) -> str:
    return sample.metadata.get("rm_type") or cfg.type


async def compute_reward(cfg: Any, sample: Sample) -> Reward:
    """The reward of one sample (``cfg``: a RewardConfig)."""
    kind = reward_type(cfg, sample)
    if kind not in REWARD_TYPES:
        raise RewardError(f"unknown reward type {kind!r} (from sample.metadata['rm_type'] or reward.type); "
                          f"expected one of {', '.join(REWARD_TYPES)}")
    return await REWARD_TYPES[kind](cfg, sample)


# ------------------------------------------------------------------------------- the reward types
async def exact(cfg: Any, sample: Sample) -> Reward:
    return exact_reward(sample.response, sample.label)


async def f1(cfg: Any, sample: Sample) -> Reward:
    return f1_reward(sample.response, sample.label)


async def math(cfg: Any, sample: Sample) -> Reward:
    return await math_reward_async(sample.response, sample.label)


async def remote(cfg: Any, sample: Sample) -> Reward:
    if not cfg.url:
        raise RewardError("reward type 'remote' needs reward.url")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label,
               "metadata": sample.metadata}
    return await remote_reward(cfg.url, payload, timeout_s=cfg.timeout_s, max_retries=cfg.max_retries)


async def custom(cfg: Any, sample: Sample) -> Reward:
    if cfg.group:
        raise RewardError("reward.group=true: the custom reward scores whole groups; use compute_group_reward")
    return _check(await call_maybe_async(_custom_hook(cfg), cfg, sample), cfg)


# ---------------------------------------------------------------------------------------- groups
async def compute_group_reward(cfg: Any, samples: List[Sample]) -> List[Reward]:
    """The rewards of a group: one call of the group hook when ``reward.group`` and every sample is
    ``custom``, else ``compute_reward`` on each sample concurrently."""
    if cfg.group and samples and all(reward_type(cfg, s) == "custom" for s in samples):
        out = await call_maybe_async(_custom_hook(cfg), cfg, samples)
        if not isinstance(out, (list, tuple)) or len(out) != len(samples):
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
            raise RewardError(f"group reward {spec_name(cfg.custom)}: expected a list of {len(samples)} rewards, "
                              f"got {got}")
        return [_check(x, cfg) for x in out]
    return list(await asyncio.gather(*(compute_reward(cfg, s) for s in samples)))


def _custom_hook(cfg: Any) -> Callable:
    """``reward.custom`` loaded once per distinct spec."""
    spec = cfg.custom
    if spec is None:
        raise RewardError("reward type 'custom' needs reward.custom (a dotted path or a _target_ node)")
    if callable(spec):
        return spec
    key = _spec_key(spec)
    if key not in _hooks:
        _hooks[key] = load_hook(spec)
    return _hooks[key]


def _spec_key(spec: Any) -> Any:
    if isinstance(spec, str):
        return spec
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(spec):
            spec = OmegaConf.to_container(spec, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return json.dumps(spec, sort_keys=True, default=repr)


def spec_name(spec: Any) -> str:
    """A hook spec for messages: the dotted path, a ``_target_`` node's target or a callable's name."""
    if isinstance(spec, str):
        return spec
    target = spec.get("_target_") if hasattr(spec, "get") else None
    return str(target or getattr(spec, "__qualname__", spec))


def _check(value: Any, cfg: Any) -> Reward:
    if isinstance(value, dict):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    raise RewardError(f"custom reward {spec_name(cfg.custom)}: returned {type(value).__name__}, "
                      f"expected a number or a dict")
