"""Reward dispatch: ``sample.metadata["rm_type"]`` first, then ``reward.type``; one async ``(cfg, sample) ->
reward`` per entry of :data:`slime_hydra.rewards.REWARD_TYPES`. The caller sets ``sample.reward``.

Failures raise or are counted, never a silent default. A broken hook, config or protocol (it would recur on
every sample) raises with the sample's identity: a custom or remote reward that raises or returns anything but
a finite number or a dict, a group reward of the wrong length, a missing reward or ``reward.key``
(``Sample.reward_value``), an unknown finish reason (``data.sample.finish_type``), a verifier that cannot
check ``1/2 == 0.5``. One sample's content is counted in ``rollout/<what>_count`` (:mod:`.counters`): math_verify
raising or timing out on an answer (reward 0), a sample marked ``Status.FAILED`` (kept out of the loss).
"""

from __future__ import annotations

import asyncio
import json
import math as _math
from typing import Any, Callable, Dict, List, Union

from slime_hydra.data.sample import Sample
from slime_hydra.rewards import REWARD_TYPES, counters
from slime_hydra.rewards.math_pool import math_verdict_async
from slime_hydra.rewards.remote import RewardError, remote_reward
from slime_hydra.rewards.text import exact_reward, f1_reward
from slime_hydra.utils.hooks import call_maybe_async, load_hook

Reward = Union[float, Dict[str, Any]]
drain_counters = counters.drain  # the rollout manager: metrics.update(drain_counters()) once per rollout

_hooks: Dict[Any, Any] = {}


def reward_type(cfg: Any, sample: Sample) -> str:
    return sample.metadata.get("rm_type") or cfg.type


async def compute_reward(cfg: Any, sample: Sample) -> Reward:
    """The reward of one sample (``cfg``: a RewardConfig)."""
    kind = reward_type(cfg, sample)
    if kind not in REWARD_TYPES:
        raise RewardError(f"unknown reward type {kind!r} (from sample.metadata['rm_type'] or reward.type); "
                          f"expected one of {', '.join(REWARD_TYPES)} ({sample.identity()})")
    return await REWARD_TYPES[kind](cfg, sample)


async def exact(cfg: Any, sample: Sample) -> Reward:
    return exact_reward(sample.response, sample.label)


async def f1(cfg: Any, sample: Sample) -> Reward:
    return f1_reward(sample.response, sample.label)


async def math(cfg: Any, sample: Sample) -> Reward:
    score, failure = await math_verdict_async(sample.response, sample.label)
    if failure is not None:
        counters.count(failure[0], f"{sample.identity()}: {failure[1]}")
    return score


async def remote(cfg: Any, sample: Sample) -> Reward:
    if not cfg.url:
        raise RewardError("reward type 'remote' needs reward.url")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label, "metadata": sample.metadata}
    try:
        value = await remote_reward(cfg.url, payload, timeout_s=cfg.timeout_s, max_retries=cfg.max_retries)
    except RewardError as e:
        raise RewardError(f"{e} ({sample.identity()})") from e
    return _check(value, f"remote reward {cfg.url}", sample)


async def custom(cfg: Any, sample: Sample) -> Reward:
    if cfg.group:
        raise RewardError("reward.group=true: the custom reward scores whole groups; use compute_group_reward")
    who = f"custom reward {spec_name(cfg.custom)}"
    return _check(await _call(who, sample, _custom_hook(cfg), cfg, sample), who, sample)


async def compute_group_reward(cfg: Any, samples: List[Sample]) -> List[Reward]:
    """The rewards of a group: one call of the group hook when ``reward.group`` and every sample is
    ``custom``, else ``compute_reward`` on each sample concurrently."""
    if cfg.group and samples and all(reward_type(cfg, s) == "custom" for s in samples):
        who = f"group reward {spec_name(cfg.custom)}"
        out = await _call(who, samples[0], _custom_hook(cfg), cfg, samples)
        if not isinstance(out, (list, tuple)) or len(out) != len(samples):
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
            raise RewardError(f"{who}: expected a list of {len(samples)} rewards, got {got} "
                              f"(group {samples[0].group_index})")
        return [_check(x, who, s) for x, s in zip(out, samples)]
    return list(await asyncio.gather(*(compute_reward(cfg, s) for s in samples)))


async def _call(who: str, sample: Sample, hook: Callable, *args: Any) -> Any:
    """A reward hook's result; its exception is raised again with the sample's identity."""
    try:
        return await call_maybe_async(hook, *args)
    except RewardError:
        raise
    except Exception as e:
        raise RewardError(f"{who} raised {type(e).__name__}: {e} ({sample.identity()})") from e


def _custom_hook(cfg: Any) -> Callable:
    """``reward.custom`` loaded once per distinct spec."""
    from omegaconf import OmegaConf

    spec = cfg.custom
    if spec is None:
        raise RewardError("reward type 'custom' needs reward.custom (a dotted path or a _target_ node)")
    if callable(spec):
        return spec
    plain = OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else spec
    key = spec if isinstance(spec, str) else json.dumps(plain, sort_keys=True, default=repr)
    if key not in _hooks:
        _hooks[key] = load_hook(spec)
    return _hooks[key]


def spec_name(spec: Any) -> str:
    """A hook spec for messages: the dotted path, a ``_target_`` node's target or a callable's name."""
    if isinstance(spec, str):
        return spec
    target = spec.get("_target_") if hasattr(spec, "get") else None
    return str(target or getattr(spec, "__qualname__", spec))


def _check(value: Any, who: str, sample: Sample) -> Reward:
    """A reward as returned by a hook or server: a finite number or a dict, else RewardError."""
    if isinstance(value, dict):
        return value
    if isinstance(value, (int, float)) and _math.isfinite(value):
        return float(value)
    got = repr(value) if isinstance(value, (int, float)) or value is None else type(value).__name__
    raise RewardError(f"{who}: returned {got} for {sample.identity()}; expected a finite number or a dict")
