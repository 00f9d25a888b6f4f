"""Generating and rewarding groups of samples, for training rollouts and evaluation alike.

``GroupSampler`` runs the generate function (``rollout.generate``, or
:func:`slime_hydra.rollout.generate.generate`) on every sample of a group (the default one sends
the whole group in one request), then the reward (per sample, or per group with ``reward.group``),
and cuts in-flight groups off when a rollout has enough (``abort_and_drain``). It knows nothing of
the data source or of which groups a rollout keeps: that is the rollout function's business
(:mod:`slime_hydra.rollout.rollout_fn`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Dict, List, Optional

from slime_hydra.data.sample import Sample, Status
from slime_hydra.rollout.generate import GenerateContext, generate as default_generate, generate_group, seeded
from slime_hydra.utils.hooks import call_maybe_async

if TYPE_CHECKING:
    from slime_hydra.config.schema import EvalDatasetConfig, RewardConfig, RolloutConfig

log = logging.getLogger(__name__)
Group = List[Sample]

ABORT_RETRY_S = 1.0  # abort_all again this often until every aborted group has returned


def sampling_params(rollout: "RolloutConfig", ds: Optional["EvalDatasetConfig"] = None) -> Dict[str, Any]:
    """SGLang sampling parameters for training rollouts, or for eval dataset ``ds``."""
    r = rollout
    sp = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
          "max_new_tokens": r.max_response_len, "stop": list(r.stop) or None,
          "stop_token_ids": list(r.stop_token_ids) or None, "skip_special_tokens": r.skip_special_tokens,
          "no_stop_trim": True, "spaces_between_special_tokens": False}
    if ds is not None:
        sp.update(temperature=ds.temperature, top_p=ds.top_p, max_new_tokens=ds.max_response_len)
    return {k: v for k, v in sp.items() if v is not None}


async def _no_engines() -> None:
    """The abort of a sampler without engines (tests): nothing is in flight anywhere."""


class GroupSampler:
    """``generate_fn(ctx, sample, sampling_params, evaluation) -> Sample`` then the reward.

    ``generate_spec`` names the generate hook in errors; ``mask_offpolicy`` is
    ``rollout.mask_offpolicy_in_partial_rollout``; ``abort_engines`` aborts every request in flight on
    every engine (``EngineFleet.abort``)."""

    def __init__(self, generate_fn: Callable, ctx: GenerateContext, reward: "RewardConfig", *,
                 generate_spec: Any = None, mask_offpolicy: bool = False,
                 abort_engines: Optional[Callable[[], Awaitable[None]]] = None):
        self.generate_fn = generate_fn
        self.ctx = ctx
        self.reward = reward
        self.generate_spec = generate_spec
        self.mask_offpolicy = mask_offpolicy
        self.abort_engines = abort_engines or _no_engines

    async def sample(self, s: Sample, sp: Dict[str, Any], evaluation: bool = False, *,
                     rollout_id: Optional[int] = None, weight_version: Optional[str] = None) -> Sample:
        """One sample generated and rewarded. Training (``evaluation=False``) records the rollout a
        sample started in, masks tokens of an earlier partial rollout with ``mask_offpolicy``, and
        checks that the engines generated with ``weight_version`` (when given)."""
        from slime_hydra.rewards.hub import spec_name

        if not self._starts(s, evaluation, rollout_id):
            return s
        versions_before = len(s.weight_versions)
        # the sample's own sampling_seed for every request it makes, so that a custom (e.g. multi-turn)
        # generate function samples what the run seed says, whatever the batching and timing
        sp = seeded(self.ctx, s, sp, evaluation)
        out = await call_maybe_async(self.generate_fn, self.ctx, s, sp, evaluation)
        if not isinstance(out, Sample):
            what = "a list (fan-out is not supported: a group keeps n_samples_per_prompt samples)" \
                if isinstance(out, (list, tuple)) else type(out).__name__
            raise TypeError(f"rollout.generate {spec_name(self.generate_spec)!r} returned {what}; expected a "
                            "Sample (async def generate(ctx, sample, sampling_params, evaluation) -> Sample)")
        new_versions = out.weight_versions[versions_before:] if out is s else out.weight_versions
        return await self._finish(out, new_versions, evaluation, rollout_id, weight_version)

    def _starts(self, s: Sample, evaluation: bool, rollout_id: Optional[int]) -> bool:
        """Before generating ``s``: False if it finished in an earlier, partial rollout."""
        if s.status in (Status.COMPLETED, Status.TRUNCATED):
            return False
        if not evaluation:
            s.metadata.setdefault("start_rollout_id", rollout_id)
            if s.status == Status.ABORTED and s.response_length and self.mask_offpolicy:
                s.loss_mask = [0] * s.response_length  # generated by older weights: train only what follows
        return True

    async def _finish(self, s: Sample, new_versions: List[str], evaluation: bool, rollout_id: Optional[int],
                      weight_version: Optional[str]) -> Sample:
        """After generating ``s``: the weight-version check, then its reward."""
        from slime_hydra.rewards import compute_reward

        if not evaluation and weight_version is not None:
            stale = sorted(set(new_versions) - {weight_version})
            if stale:
                raise RuntimeError(f"rollout {rollout_id}: engines generated with weight version(s) {stale}, "
                                   f"expected {weight_version}: the last weight update did not arrive")
        if s.status != Status.ABORTED and not self.reward.group and s.reward is None:
            s.reward = await compute_reward(self.reward, s)
        return s

    async def group(self, group: Group, sp: Dict[str, Any], evaluation: bool = False, *,
                    rollout_id: Optional[int] = None, weight_version: Optional[str] = None) -> Group:
        """Every sample of ``group`` (:meth:`sample`), then the group reward. The default generate
        function sends the group in one request (:meth:`_one_request`); others run per sample,
        concurrently."""
        from slime_hydra.rewards import compute_group_reward

        if self.generate_fn is default_generate:
            group = await self._one_request(group, sp, evaluation, rollout_id, weight_version)
        else:
            tasks = [asyncio.ensure_future(self.sample(s, sp, evaluation, rollout_id=rollout_id,
                                                       weight_version=weight_version)) for s in group]
            try:
                group = list(await asyncio.gather(*tasks))
            except BaseException:
                for t in tasks:  # one sample failed: do not leave its siblings running
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        if self.reward.group and not any(s.status == Status.ABORTED for s in group):
            for s, r in zip(group, await compute_group_reward(self.reward, group)):
                s.reward = r
        return group

    async def _one_request(self, group: Group, sp: Dict[str, Any], evaluation: bool, rollout_id: Optional[int],
                           weight_version: Optional[str]) -> Group:
        """:meth:`sample` for every sample of ``group``, generated by one batched /generate
        (:func:`generate_group`): the same samples, one HTTP request instead of one per sample."""
        todo = [s for s in group if self._starts(s, evaluation, rollout_id)]
        before = [len(s.weight_versions) for s in todo]
        await generate_group(self.ctx, todo, sp, evaluation)
        await asyncio.gather(*(self._finish(s, s.weight_versions[n:], evaluation, rollout_id, weight_version)
                               for s, n in zip(todo, before)))
        return group

    async def abort_and_drain(self, pending: set) -> List[Group]:
        """Cut the in-flight groups (futures of :meth:`group`) off and wait for them: ``abort_all`` on
        every engine, repeated until every group has returned (a request still on its way to an engine
        when an abort lands is not aborted by it), while ``ctx.post`` answers new /generate calls as
        aborted at once (multi-turn generate functions stop between turns). Returns the groups in data
        order, partial samples marked ABORTED with the tokens made so far."""
        groups: List[Group] = []
        errors: List[BaseException] = []
        self.ctx.aborting = True
        try:
            while pending:
                await self.abort_engines()
                done, pending = await asyncio.wait(pending, timeout=ABORT_RETRY_S)
                for fut in done:
                    if fut.exception() is not None:
                        errors.append(fut.exception())
                    else:
                        groups.append(fut.result())
        finally:
            self.ctx.aborting = False
        if errors:
            raise errors[0]
        return sorted(groups, key=lambda g: g[0].group_index)

    async def cancel(self, pending: set) -> None:
        """After an error: stop everything in flight, best effort."""
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        try:
            await self.abort_engines()
        except Exception as e:  # noqa: BLE001 - the original error matters more
            log.warning("abort after a failed rollout: %s", e)


def agent_metrics(samples: List[Sample], prefix: str) -> Dict[str, float]:
    """Turns and tool calls per sample, for samples made by a multi-turn generate function
    (slime_hydra.rollout.multiturn records them in the metadata)."""
    turns = [s.metadata["num_turns"] for s in samples if "num_turns" in s.metadata]
    if not turns:
        return {}
    calls = [s.metadata.get("tool_calls", 0) for s in samples if "num_turns" in s.metadata]
    return {f"{prefix}turns_mean": sum(turns) / len(turns), f"{prefix}tool_calls_mean": sum(calls) / len(calls),
            f"{prefix}tool_use_ratio": sum(c > 0 for c in calls) / len(calls)}
