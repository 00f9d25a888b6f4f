"""The rollout function: one training rollout's groups of samples. The default is :func:`default_rollout`
(slime's over-sampling loop with dynamic filtering, aborts and partial rollout); ``rollout.rollout_function``
(a dotted path or a ``_target_`` node, like slime's ``--rollout-function-path``) replaces it::

    async def my_rollout(ctx: RolloutContext, rollout_id: int, weight_version: Optional[str] = None
                         ) -> Tuple[List[List[Sample]], Dict[str, float]]

It returns ``ctx.cfg.rollout.batch_size`` groups of ``n_samples_per_prompt`` rewarded samples (in data order)
and its ``rollout/...`` metrics, working with ``ctx.source.get_samples(n)`` / ``add_samples(groups)``,
``await ctx.sampler.group(group, ctx.sampling_params, rollout_id=..., weight_version=...)`` (generate and reward
one group, checking the engines ran ``weight_version``), ``await ctx.keep(group)`` (the dynamic filter),
``await ctx.sampler.abort_and_drain(pending)`` and ``ctx.cfg``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Dict, List, Optional, Tuple

from slime_hydra.data.sample import Sample
from slime_hydra.rollout.filters import DynamicFilterOutput, zero_std
from slime_hydra.rollout.sampling import GroupSampler, sampling_params

if TYPE_CHECKING:
    from slime_hydra.config.schema import RunConfig
    from slime_hydra.data.source import DataSource
    from slime_hydra.rollout.client import GenerateClient

log = logging.getLogger(__name__)
Group = List[Sample]
RolloutOutput = Tuple[List[Group], Dict[str, float]]
RolloutFunction = Callable[..., Awaitable[RolloutOutput]]

PROGRESS_LOG_S = 30.0  # how often a long collection loop reports its progress


@dataclass
class RolloutContext:
    """What a rollout function works with (built once per run by :func:`build_rollout_context`)."""

    cfg: "RunConfig"  # the whole config: hooks take it (a dynamic filter's first argument, as in slime)
    source: "DataSource"
    sampler: GroupSampler
    dynamic_filter: Optional[Callable] = None  # None: keep every group
    filter_spec: Any = None  # the filter's hook spec, for messages

    @property
    def sampling_params(self) -> Dict[str, Any]:
        return sampling_params(self.cfg.rollout)

    async def keep(self, group: Group) -> DynamicFilterOutput:
        """The dynamic filter's verdict on a finished group (keep everything without a filter)."""
        from slime_hydra.rewards.hub import spec_name
        from slime_hydra.rollout.filters import as_filter_output
        from slime_hydra.utils.hooks import call_maybe_async

        if self.dynamic_filter is None:
            return DynamicFilterOutput(keep=True)
        out = await call_maybe_async(self.dynamic_filter, self.cfg, group)
        return as_filter_output(out, f"rollout.dynamic_filter {spec_name(self.filter_spec)!r}")


def build_rollout_context(cfg: "RunConfig", tokenizer: Any, client: "GenerateClient",
                          abort_engines: Optional[Callable[[], Awaitable[None]]] = None) -> RolloutContext:
    """The data source, the generate function, the dynamic filter and the sampler, requests going to ``client``
    and aborts to ``abort_engines``."""
    from slime_hydra.data.source import build_data_source
    from slime_hydra.rollout.filters import dynamic_filter_spec
    from slime_hydra.rollout.generate import GenerateContext, generate as default_generate
    from slime_hydra.utils.hooks import load_hook

    r = cfg.rollout
    buffer_filter = load_hook(cfg.data.buffer_filter) if cfg.data.buffer_filter is not None else None
    source = build_data_source(cfg.data, tokenizer, n_samples_per_prompt=r.n_samples_per_prompt,
                               max_prompt_len=r.max_prompt_len, buffer_filter=buffer_filter)
    generate_fn = load_hook(r.generate) if r.generate is not None else default_generate
    filter_spec = dynamic_filter_spec(cfg)
    dynamic_filter = load_hook(filter_spec) if filter_spec is not None else None
    sampler = GroupSampler(generate_fn, GenerateContext(cfg, tokenizer, client), cfg.reward, generate_spec=r.generate,
                           mask_offpolicy=r.mask_offpolicy_in_partial_rollout, abort_engines=abort_engines)
    return RolloutContext(cfg, source, sampler, dynamic_filter, filter_spec)


def load_rollout_function(spec: Any) -> RolloutFunction:
    """``rollout.rollout_function`` -> the callable; None: :func:`default_rollout`."""
    from slime_hydra.utils.hooks import load_hook

    return default_rollout if spec is None else load_hook(spec)


def check_rollout_output(out: Any, batch_size: int, n_samples_per_prompt: int, where: str) -> RolloutOutput:
    """A rollout function's return value, checked: (groups, metrics), ``batch_size`` groups of n samples."""
    expected = (f"expected (groups, metrics) with rollout.batch_size={batch_size} groups of "
                f"rollout.n_samples_per_prompt={n_samples_per_prompt} Samples")
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], list) and isinstance(out[1], dict)):
        raise TypeError(f"{where} returned {type(out).__name__}; {expected}")
    groups, metrics = out
    sizes = [len(g) if isinstance(g, list) else type(g).__name__ for g in groups]
    if len(groups) != batch_size or any(size != n_samples_per_prompt for size in sizes):
        raise ValueError(f"{where} returned {len(groups)} groups (sizes {sizes[:8]}{'...' * (len(sizes) > 8)}); "
                         f"{expected}")
    other = next((type(s).__name__ for g in groups for s in g if not isinstance(s, Sample)), None)
    if other is not None:
        raise TypeError(f"{where} returned a group holding a {other}; {expected}")
    return groups, metrics


def _zero_std(group: Group, key: Optional[str]) -> bool:
    """All rewards of a finished group equal (aborted samples have none: not zero-std)."""
    if len(group) < 2 or any(s.reward is None for s in group):
        return False
    return zero_std([s.reward_value(key) for s in group])


async def default_rollout(ctx: RolloutContext, rollout_id: int, weight_version: Optional[str] = None) -> RolloutOutput:
    """Generate until ``rollout.batch_size`` groups pass the dynamic filter (slime's over-sampling loop).

    While kept plus in-flight groups are fewer than the batch, ``over_sampling_batch_size`` more prompts are
    pulled (buffered partial groups first), each finished group judged as it completes. Once the batch is full,
    the groups in flight are aborted (with ``rollout.partial_rollout`` they go back to the buffer; groups that
    finish after that are not kept). After ``rollout.max_sampled_groups`` groups no more prompts are pulled, and
    rejected groups fill a short batch. Kept groups are returned in data order."""
    r = ctx.cfg.rollout
    reward_key = ctx.cfg.reward.key
    target = r.batch_size
    sp = ctx.sampling_params
    over = r.over_sampling_batch_size or target
    cap = r.max_sampled_groups
    accepted: List[Group] = []
    rejected: List[Group] = []  # only needed to fill the batch when the cap is hit
    surplus: List[Group] = []  # finished after the batch was full
    drops, n, pending = Counter(), Counter(), set()
    next_log = time.monotonic() + PROGRESS_LOG_S
    try:
        while len(accepted) < target:
            if time.monotonic() > next_log:  # dynamic sampling can take many rounds
                next_log = time.monotonic() + PROGRESS_LOG_S
                log.info("rollout %s: %d of %d groups kept after %d sampled (dropped: %s)", rollout_id,
                         len(accepted), target, n["sampled"], dict(drops) or "none")
            if len(accepted) + len(pending) < target and (cap is None or n["sampled"] < cap):
                for g in ctx.source.get_samples(over):
                    pending.add(asyncio.ensure_future(ctx.sampler.group(g, sp, rollout_id=rollout_id,
                                                                        weight_version=weight_version)))
                    n["sampled"] += 1
            if not pending:  # the cap is reached and every sampled group has finished
                fill = rejected[: target - len(accepted)]
                log.warning("rollout %s: only %d of %d groups passed the dynamic filter after %d sampled groups "
                            "(rollout.max_sampled_groups); filling the batch with %d rejected groups",
                            rollout_id, len(accepted), target, n["sampled"], len(fill))
                accepted += fill
                n["fallback"] += len(fill)
                break
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            finished = sorted((f.result() for f in done), key=lambda g: g[0].group_index)
            for i, group in enumerate(finished):
                n["finished"] += 1
                n["zero_std"] += _zero_std(group, reward_key)
                if len(accepted) >= target:
                    surplus.append(group)
                    continue
                verdict = await ctx.keep(group)
                if verdict.keep:
                    accepted.append(group)
                elif verdict.keep_when_insufficient and len(accepted) + len(pending) + len(finished) - i - 1 < target:
                    accepted.append(group)  # dropping it would need another sampling round
                    n["fallback"] += 1
                else:
                    drops[verdict.reason or "filtered"] += 1
                    if cap is not None:
                        rejected.append(group)
    except BaseException:
        await ctx.sampler.cancel(pending)
        raise
    aborted = await ctx.sampler.abort_and_drain(pending) if pending else []
    if r.partial_rollout and aborted:
        ctx.source.add_samples(aborted)
    accepted.sort(key=lambda g: g[0].group_index)
    metrics = {"rollout/sampled_groups": float(n["sampled"]), "rollout/aborted_groups": float(len(aborted)),
               "rollout/unused_groups": float(len(surplus)),
               "rollout/generated_zero_std_ratio": n["zero_std"] / max(n["finished"], 1)}
    if r.partial_rollout:
        metrics["rollout/recycled_groups"] = float(len(aborted))
        metrics["rollout/resumed_samples"] = float(sum(s.metadata.get("start_rollout_id") != rollout_id
                                                       for g in accepted for s in g))
    if ctx.dynamic_filter is not None:
        dropped = sum(drops.values())
        metrics.update({f"rollout/dynamic_filter/drop_{k}": float(v) for k, v in drops.items()})
        metrics["rollout/dynamic_filter/dropped_groups"] = float(dropped)
        metrics["rollout/dynamic_filter/dropped_ratio"] = dropped / max(n["finished"], 1)
        metrics["rollout/dynamic_filter/fallback_groups"] = float(n["fallback"])
    return accepted, metrics
