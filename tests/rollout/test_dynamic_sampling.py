"""Dynamic sampling (DAPO), over-sampling, abort and partial rollout in the default rollout function
(``rollout_fn.default_rollout``), run without Ray: with scripted generate functions, and against a
real embedded engine (abort_request cuts requests off; partial groups go back into the buffer and
are continued from ``sample.tokens`` with the budget left)."""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List

import pytest

from conftest import resolved
from rollout_harness import make_rollout
from slime_hydra.data.sample import Sample, Status
from slime_hydra.launch.validate import validate
from slime_hydra.rollout.filters import (
    NONZERO_REWARD_STD,
    DynamicFilterOutput,
    as_filter_output,
    dynamic_filter_spec,
    nonzero_reward_std,
    nonzero_reward_std_with_fallback,
)
from slime_hydra.rollout.generate import generate as default_generate


def group(*rewards: float) -> List[Sample]:
    return [Sample(reward=r, status=Status.COMPLETED) for r in rewards]


# ------------------------------------------------------------------------------------ filters
def test_nonzero_reward_std():
    cfg = resolved()
    assert nonzero_reward_std(cfg, group(0, 1, 0, 0)).keep
    out = nonzero_reward_std(cfg, group(0, 0, 0, 0))
    assert not out.keep and out.reason == "zero_std_0.0" and not out.keep_when_insufficient
    assert nonzero_reward_std(cfg, group(1, 1)).reason == "zero_std_1.0"
    assert nonzero_reward_std_with_fallback(cfg, group(1, 1)).keep_when_insufficient
    dict_cfg = resolved(["reward.key=acc"])
    assert nonzero_reward_std(dict_cfg, [Sample(reward={"acc": 1.0}), Sample(reward={"acc": 0.0})]).keep


def test_filter_outputs_and_errors():
    assert as_filter_output(True) == DynamicFilterOutput(True)
    assert as_filter_output(False) == DynamicFilterOutput(False, "filtered")
    import torch

    assert as_filter_output(torch.tensor(0.5) > 0.1).keep  # slime's filters return a tensor

    class SlimeStyle:  # a foreign DynamicFilterOutput
        keep, reason, keep_when_insufficient = False, "too_long", True

    assert as_filter_output(SlimeStyle()) == DynamicFilterOutput(False, "too_long", True)
    for bad in (None, 1, "keep", [True]):
        with pytest.raises(TypeError, match="rollout.dynamic_filter returned .* expected a bool or"):
            as_filter_output(bad)


def test_dapo_switches_dynamic_sampling_on():
    assert dynamic_filter_spec(resolved()) is None
    dapo = resolved(["algo=dapo"])
    assert dapo.algo.dynamic_sampling and dynamic_filter_spec(dapo) == NONZERO_REWARD_STD
    own = "slime_hydra.rollout.filters.nonzero_reward_std_with_fallback"
    assert dynamic_filter_spec(resolved(["algo=dapo", f"rollout.dynamic_filter={own}"])) == own
    assert dynamic_filter_spec(resolved(["algo=dapo", "algo.dynamic_sampling=false"])) is None


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["rollout.partial_rollout=true"], "rollout.partial_rollout: recycles groups cut off"),
        (["algo=dapo", "rollout.n_samples_per_prompt=1"], "algo.dynamic_sampling: nonzero_reward_std drops groups"),
        (
            [f"rollout.dynamic_filter={NONZERO_REWARD_STD}", "rollout.n_samples_per_prompt=1"],
            "rollout.dynamic_filter: nonzero_reward_std drops groups",
        ),
        (["rollout.max_sampled_groups=8"], "rollout.max_sampled_groups: 8 < rollout.batch_size=32"),
        (["rollout.mask_offpolicy_in_partial_rollout=true"], "rollout.mask_offpolicy_in_partial_rollout: masks tokens"),
    ],
)
def test_validation_rules(overrides, needle):
    errs = validate(resolved(overrides))
    assert any(needle in e for e in errs), errs


@pytest.mark.parametrize(
    "overrides",
    [
        ["algo=dapo", "rollout.partial_rollout=true"],
        ["rollout.partial_rollout=true", "rollout.over_sampling_batch_size=48"],
        [
            "algo=dapo",
            "rollout.partial_rollout=true",
            "rollout.mask_offpolicy_in_partial_rollout=true",
            "rollout.max_sampled_groups=320",
        ],
    ],
)
def test_valid_combinations(overrides):
    assert validate(resolved(overrides)) == []


# --------------------------------------------------------------- the collection loop, no engine
def scripted(correct_groups: set, *, version: str = "0", hold: frozenset = frozenset()):
    """A generate function: samples of the groups in ``correct_groups`` alternate right / wrong
    answers (nonzero std), the others are all wrong (zero std). Groups in ``hold`` finish only once
    the rollout is being aborted (as engines answer in-flight requests then)."""

    async def generate(ctx, s: Sample, sp: Dict[str, Any], evaluation: bool = False) -> Sample:
        await asyncio.sleep(0.001 * (s.index % 7))  # finish out of order
        while s.group_index in hold and not ctx.aborting:
            await asyncio.sleep(0.001)
        if s.group_index in hold:
            s.status = Status.ABORTED
            return s
        right = s.group_index in correct_groups and s.index % 2 == 0
        s.tokens = ctx.encode(s.prompt) + [1]
        s.append_response([1], [-0.5], text=s.label if right else "x")
        s.status, s.weight_versions = Status.COMPLETED, [version]
        return s

    return generate


def test_dynamic_filter_over_samples_until_enough_groups_pass():
    m = make_rollout(
        ["algo=dapo", "rollout.batch_size=3", "rollout.n_samples_per_prompt=4", "rollout.over_sampling_batch_size=4"]
    )
    # group indices are handed out 0, 1, 2, ...; group 7 is still generating when 6 fills the batch
    m.set_generate(scripted({1, 4, 6, 9}, hold=frozenset({7})))
    groups, metrics = m.run()
    assert [g[0].group_index for g in groups] == [1, 4, 6]  # in data order
    assert all(len({s.reward for s in g}) == 2 for g in groups)
    assert metrics["rollout/sampled_groups"] == 8  # two pulls of 4
    assert metrics["rollout/dynamic_filter/dropped_groups"] == metrics["rollout/dynamic_filter/drop_zero_std_0.0"] == 4
    assert (
        metrics["rollout/aborted_groups"] == 1 and metrics["rollout/unused_groups"] == 0
    )  # 0 2 3 5 dropped, 7 cut off
    assert metrics["rollout/generated_zero_std_ratio"] == metrics["rollout/dynamic_filter/dropped_ratio"] == 4 / 7
    assert m.source.buffer == []  # no partial rollout: left-overs are discarded


def test_zero_std_groups_fill_the_batch_when_dropping_needs_another_round_or_the_cap_is_hit():
    m = make_rollout(
        [
            "rollout.batch_size=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.dynamic_filter=slime_hydra.rollout.filters.nonzero_reward_std_with_fallback",
        ]
    )
    m.set_generate(scripted(set()))  # every group is zero-std
    groups, metrics = m.run()
    # dropping either group would need another sampling round: both are kept, nothing more is pulled
    assert [g[0].group_index for g in groups] == [0, 1]
    assert metrics["rollout/dynamic_filter/fallback_groups"] == 2 and metrics["rollout/sampled_groups"] == 2
    assert metrics["rollout/dynamic_filter/dropped_groups"] == 0

    m = make_rollout(
        ["algo=dapo", "rollout.batch_size=2", "rollout.n_samples_per_prompt=2", "rollout.max_sampled_groups=6"]
    )
    m.set_generate(scripted({3}))
    groups, metrics = m.run()
    # only group 3 passes; after 6 sampled groups the first rejected one (0) fills the batch
    assert [g[0].group_index for g in groups] == [0, 3]
    assert metrics["rollout/sampled_groups"] == 6 and metrics["rollout/dynamic_filter/dropped_groups"] == 5
    assert metrics["rollout/dynamic_filter/fallback_groups"] == 1


def test_custom_filter_hook_async_with_bound_kwargs(tmp_path, monkeypatch):
    (tmp_path / "my_filters.py").write_text(
        "async def min_reward(cfg, group, at_least=1.0):\n    return max(s.reward for s in group) >= at_least\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    m = make_rollout(
        [
            "rollout.batch_size=2",
            "rollout.n_samples_per_prompt=2",
            "+rollout.dynamic_filter={_target_: my_filters.min_reward, at_least: 1.0}",
        ]
    )
    m.set_generate(scripted({0, 2, 5}))
    groups, metrics = m.run()
    assert [g[0].group_index for g in groups] == [0, 2]
    assert metrics["rollout/dynamic_filter/drop_filtered"] >= 1


def test_an_error_in_one_sample_cancels_every_sample_still_running():
    started, cancelled = [], []

    async def generate(ctx, s: Sample, sp, evaluation=False):
        if s.group_index == 2 and not any(g == 2 for g, _ in started):  # the first of group 2's samples
            started.append((2, "failed"))
            await asyncio.sleep(0.05)  # every other sample has started
            raise RuntimeError("generate failed")
        started.append((s.group_index, s.index))
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append((s.group_index, s.index))
            raise

    m = make_rollout(["rollout.batch_size=4", "rollout.n_samples_per_prompt=2"])
    m.set_generate(generate)
    with pytest.raises(RuntimeError, match="generate failed"):
        asyncio.run(asyncio.wait_for(m.collect(), 30))  # a sample left running would hang the rollout
    started.remove((2, "failed"))
    assert len(started) == 7 and sorted(cancelled) == sorted(started)  # its sibling in group 2 and the other groups


def test_a_stale_weight_version_stops_the_rollout():
    m = make_rollout(["rollout.batch_size=4", "rollout.n_samples_per_prompt=2"])
    m.set_generate(scripted({0, 1, 2, 3}, version="7"))
    with pytest.raises(RuntimeError, match=r"rollout 8: .* weight version\(s\) \['7'\], expected 8"):
        m.run(rollout_id=8, weight_version="8")


def test_generate_must_return_a_sample():
    async def returns_list(ctx, s, sp, evaluation=False):
        return [s, s]

    m = make_rollout(["rollout.batch_size=1", "rollout.n_samples_per_prompt=2"])
    m.set_generate(returns_list)
    with pytest.raises(TypeError, match="returned a list .*fan-out is not supported"):
        m.run()


# ---------------------------------------------------- over-sampling, abort, partial rollout: real
@pytest.mark.integration
@pytest.mark.parametrize("per_group", [True, False], ids=["one request per group", "one request per sample"])
def test_abort_and_partial_rollout_against_the_engine(engine_url, per_group):
    """Over-sampling 6 groups for a batch of 2: the 2 fast groups are kept, the 4 long ones are
    cut off by abort_request in the middle of generating, go back to the buffer with their partial
    tokens, and the next rollout continues them from there with the budget left. With the default
    generate function (one batched request per group) and with a custom one (one request per sample)."""
    from slime_hydra.rollout.client import GenerateClient, is_batch
    from slime_hydra.rollout.generate import sampling_seed

    budget = 1000
    m = make_rollout(
        [
            "rollout.batch_size=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.over_sampling_batch_size=6",
            "rollout.partial_rollout=true",
            f"rollout.max_response_len={budget}",
            "rollout.temperature=1.0",
        ],
        urls=[engine_url],
    )

    async def per_sample(ctx, s: Sample, sp, evaluation=False):  # not the default function: one request per sample
        return await default_generate(ctx, s, sp, evaluation)

    if not per_group:
        m.set_generate(per_sample)
    answer = {"text": "", "output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"},
                                                           "output_token_logprobs": [[-0.1, 1, None]]}}

    class SpyClient(GenerateClient):
        """Answers the fast groups itself, after the long ones started; the long ones never stop early."""

        async def post(self, path, payload):
            batch = is_batch(payload)
            params = payload["sampling_params"] if batch else [payload["sampling_params"]]
            if params[0]["sampling_seed"] in fast:
                await asyncio.sleep(0.5)
                return [dict(answer) for _ in params] if batch else dict(answer)
            requests.append(len(params))
            prompts = payload["input_ids"] if batch else [payload["input_ids"]]
            sent.extend((len(ids), p["max_new_tokens"]) for ids, p in zip(prompts, params))
            for p in params:
                p["ignore_eos"] = True
            return await super().post(path, payload)

    sent: List[tuple] = []  # (tokens, budget) of each sample sent to the engine
    requests: List[int] = []  # samples per request sent to the engine

    async def rollout(rollout_id):
        client = m.ctx.sampler.ctx.client = SpyClient(engine_url, 64)
        try:
            return await m.collect(rollout_id)
        finally:
            await client.aclose()

    fast = {sampling_seed(m.cfg.rollout.seed, 1, i) for i in range(4)}  # groups 0 and 1 (samples 0-3)
    groups, metrics = asyncio.run(rollout(1))
    assert [g[0].group_index for g in groups] == [0, 1]
    assert metrics["rollout/aborted_groups"] == 4 and metrics["rollout/recycled_groups"] == 4
    assert requests == ([2] * 4 if per_group else [1] * 8)
    buffered = [s for g in m.source.buffer for s in g]
    assert len(m.source.buffer) == 4 and all(s.status == Status.ABORTED for s in buffered)
    assert any(0 < s.response_length < budget for s in buffered), [s.response_length for s in buffered]
    for s in buffered:
        assert len(s.rollout_log_probs) == len(s.loss_mask) == s.response_length
        assert s.metadata["start_rollout_id"] == 1
    saved = {s.index: (list(s.tokens), s.response_length) for s in buffered}

    fast, sent[:], requests[:] = set(), [], []
    # a batch of exactly the buffered groups, served first
    m.cfg.rollout.batch_size = m.cfg.rollout.over_sampling_batch_size = 4
    groups, metrics = asyncio.run(rollout(2))
    assert sorted(g[0].group_index for g in groups) == [2, 3, 4, 5] and m.source.buffer == []
    assert metrics["rollout/resumed_samples"] == 8 and metrics["rollout/aborted_groups"] == 0
    assert requests == ([2] * 4 if per_group else [1] * 8)
    done = {s.index: s for g in groups for s in g}
    for idx, s in done.items():
        tokens, length = saved[idx]
        assert s.tokens[: len(tokens)] == tokens  # continued, not restarted
        assert s.response_length == budget and s.status == Status.TRUNCATED
        assert len(s.rollout_log_probs) == budget and s.loss_mask == [1] * budget
    # each sample continued from its tokens (prompt + partial response), its budget reduced
    assert sorted(sent) == sorted((len(t), budget - n) for t, n in saved.values())


def test_mask_offpolicy_in_partial_rollout():
    """A resumed sample's tokens from the earlier rollout get mask 0; the new ones mask 1."""
    m = make_rollout(
        [
            "rollout.batch_size=1",
            "rollout.n_samples_per_prompt=2",
            "rollout.partial_rollout=true",
            "rollout.over_sampling_batch_size=2",
            "rollout.mask_offpolicy_in_partial_rollout=true",
        ]
    )
    s = Sample(prompt="1234=", label="4", status=Status.ABORTED, tokens=[3, 4, 5, 6, 12])
    s.append_response([7, 8], [-0.1, -0.2])
    s.status = Status.ABORTED

    async def resume(ctx, s, sp, evaluation=False):
        s.append_response([1], [-0.3])
        s.status = Status.COMPLETED
        return s

    m.set_generate(resume)
    out = asyncio.run(m.ctx.sampler.sample(s, m.ctx.sampling_params, rollout_id=3))
    assert out.loss_mask == [0, 0, 1] and out.rollout_log_probs == [-0.1, -0.2, -0.3] and out.reward is not None
    assert out.metadata["start_rollout_id"] == 3
