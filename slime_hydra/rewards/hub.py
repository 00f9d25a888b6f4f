"""Reward dispatch: ``sample.metadata["rm_type"]`` first (one dataset may mix tasks), then
``reward.type``. Rewards are returned, not stored: the caller sets ``sample.reward``.

One function per entry of :data:`slime_hydra.rewards.REWARD_TYPES`, each ``(cfg, sample) -> reward``
with ``cfg`` the RewardConfig: ``exact``, ``math``, ``f1`` (built in, pure), ``remote`` (HTTP reward
server) and ``custom`` (``reward.custom``: a hook ``rm(cfg, sample)``, or ``rm(cfg, samples) -> list``
when ``reward.group``; sync or async).

Failures: raise or count, never a silent default (the rule for rewards and for a rollout's samples).
A failure raises with the sample's identity (``Sample.identity()``) when it means a broken hook, config
or protocol: it would recur on every sample. It is counted in ``rollout/<what>_count`` and logged at
WARNING on its first occurrence (:mod:`slime_hydra.rewards.counters`) when one sample's content caused
it and the run is right to go on.

- A custom or remote reward that raises, or returns None, NaN, or anything but a number or a dict;
  a group reward with the wrong number of values: raise, naming the function and the sample.
- A sample that reaches training without a reward, or whose dict reward lacks ``reward.key``:
  raise (``Sample.reward_value``).
- math_verify raising or running out of time on an answer: reward 0, counted
  (``reward_verifier_error``, ``reward_verifier_timeout``): sympy raises on odd answers the model
  wrote. A verifier that cannot check ``1/2 == 0.5`` (an API change) raises at its first use.
- An engine answer whose finish reason is missing or not one of SGLang's (stop, length, abort):
  raise (``data.sample.finish_type``): it is a protocol change and every sample would have it.
- A sample a generate function marks ``Status.FAILED`` (its environment or tool broke): kept out of
  the loss and counted (``rollout/failed_count``) by the conversion to training data.
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


# ------------------------------------------------------------------------------- the reward types
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
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label,
               "metadata": sample.metadata}
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


# ---------------------------------------------------------------------------------------- groups
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
    from omegaconf import OmegaConf

    if isinstance(spec, str):
        return spec
    spec = OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else spec
    return json.dumps(spec, sort_keys=True, default=repr)


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
