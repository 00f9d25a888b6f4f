"""``rollout.rollout_function`` (slime_hydra/rollout/rollout_fn.py), like slime's
``--rollout-function-path``: None means the over-sampling loop; a dotted path or a ``_target_`` node
names an ``async f(ctx, rollout_id, weight_version) -> (groups, metrics)``, whose output the manager
checks before turning it into training data."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from conftest import resolved
from rollout_harness import make_rollout
from slime_hydra.data.sample import Sample, Status
from slime_hydra.rollout.rollout_fn import check_rollout_output, default_rollout, load_rollout_function
from slime_hydra.utils.hooks import HookError

MY_ROLLOUTS = """
async def first_groups(ctx, rollout_id, weight_version=None, bonus=0.0):
    '''The first batch_size groups the data source gives, with no filter.'''
    groups = ctx.source.get_samples(ctx.cfg.rollout.batch_size)
    done = [await ctx.sampler.group(g, ctx.sampling_params, rollout_id=rollout_id, weight_version=weight_version)
            for g in groups]
    return done, {"rollout/my_metric": rollout_id + bonus}
"""


async def answer(ctx, s: Sample, sp, evaluation=False) -> Sample:
    s.tokens = ctx.encode(s.prompt) + [1]
    s.append_response([1], [-0.5], text=s.label)
    s.status, s.weight_versions = Status.COMPLETED, ["3"]
    return s


@pytest.fixture
def my_rollouts(tmp_path, monkeypatch):
    (tmp_path / "my_rollouts.py").write_text(textwrap.dedent(MY_ROLLOUTS))
    monkeypatch.syspath_prepend(str(tmp_path))


def test_default_is_the_over_sampling_loop():
    assert resolved().rollout.rollout_function is None
    assert load_rollout_function(None) is default_rollout


@pytest.mark.parametrize("spec, metric", [("my_rollouts.first_groups", 5.0),
                                          ("{_target_: my_rollouts.first_groups, bonus: 0.5}", 5.5)])
def test_custom_rollout_function(my_rollouts, spec, metric):
    m = make_rollout(["rollout.batch_size=3", "rollout.n_samples_per_prompt=2", f"rollout.rollout_function={spec}"])
    m.set_generate(answer)
    fn = load_rollout_function(m.cfg.rollout.rollout_function)
    out = asyncio.run(fn(m.ctx, 5, "3"))
    groups, metrics = check_rollout_output(out, 3, 2, "rollout.rollout_function")
    assert metrics == {"rollout/my_metric": metric}
    assert [g[0].group_index for g in groups] == [0, 1, 2]
    assert all(s.reward == 1.0 and s.metadata["start_rollout_id"] == 5 for g in groups for s in g)
    with pytest.raises(RuntimeError, match=r"weight version\(s\) \['3'\], expected 4"):
        asyncio.run(fn(m.ctx, 6, "4"))  # the sampler's check holds for custom functions too


def test_bad_spec_fails_at_load():
    with pytest.raises(HookError, match="'slime_hydra.rollout.rollout_fn' has no attribute 'nope'"):
        load_rollout_function("slime_hydra.rollout.rollout_fn.nope")


def test_output_is_checked():
    group = [Sample(), Sample()]
    assert check_rollout_output(([group, group], {}), 2, 2, "f") == ([group, group], {})
    with pytest.raises(TypeError, match=r"f returned list; expected \(groups, metrics\) with rollout.batch_size=2"):
        check_rollout_output([group, group], 2, 2, "f")
    with pytest.raises(ValueError, match=r"f returned 1 groups \(sizes \[2\]\); expected"):
        check_rollout_output(([group], {}), 2, 2, "f")
    with pytest.raises(ValueError, match=r"f returned 2 groups \(sizes \[2, 1\]\); expected .* "
                                         r"rollout.n_samples_per_prompt=2 Samples"):
        check_rollout_output(([group, group[:1]], {}), 2, 2, "f")
    with pytest.raises(ValueError, match=r"sizes \[2, 'tuple'\]"):
        check_rollout_output(([group, tuple(group)], {}), 2, 2, "f")
    with pytest.raises(TypeError, match="f returned a group holding a str; expected"):
        check_rollout_output(([["not a sample", Sample()]], {}), 1, 2, "f")
