"""Contracts of every user hook the config exposes, exercised where the run loads and calls them
(``load_hook`` via ``rollout_fn.build_rollout_context`` and the reward hub), from a dotted path and
from a ``_target_`` node with bound keyword arguments, sync and async, with the documented
signature, and the error a user gets for a wrong return value.

| config key                      | signature                                                           |
|---------------------------------|---------------------------------------------------------------------|
| rollout.generate                | [async] generate(ctx, sample, sampling_params, evaluation) -> Sample |
| rollout.dynamic_filter          | [async] f(cfg, group) -> bool | DynamicFilterOutput                 |
| reward.custom                   | [async] rm(reward_cfg, sample) -> float | dict                      |
| reward.custom, reward.group     | [async] rm(reward_cfg, samples) -> list (one per sample)            |
| data.buffer_filter              | f(buffer, n) -> list[group], popping what it returns                |

``rollout.rollout_function`` (async f(ctx, rollout_id, weight_version) -> (groups, metrics)) is
tested in tests/rollout/test_rollout_function.py.
"""

from __future__ import annotations

import asyncio
import copy
import textwrap

import pytest

from rollout_harness import make_rollout
from slime_hydra.config.schema import RewardConfig, RunConfig
from slime_hydra.data.sample import Sample, Status
from slime_hydra.rewards import RewardError, compute_group_reward, compute_reward
from slime_hydra.rollout.generate import GenerateContext
from slime_hydra.rollout.train_data import train_data
from slime_hydra.utils.hooks import HookError

HOOKS = '''
import asyncio
import copy
from slime_hydra.rollout.filters import DynamicFilterOutput
from slime_hydra.rollout.generate import GenerateContext
from slime_hydra.data.sample import Sample, Status

CALLS = []


# rollout.generate ------------------------------------------------------------------------
async def generate(ctx, sample, sampling_params, evaluation=False, answer=None):
    assert isinstance(ctx, GenerateContext) and isinstance(sample, Sample)
    CALLS.append(("generate", evaluation, sampling_params["max_new_tokens"], sampling_params.get("temperature")))
    await asyncio.sleep(0)
    sample.tokens = ctx.encode(sample.prompt)
    text = answer if answer is not None else sample.label
    sample.append_response(ctx.encode(text), [-0.5] * len(text), text=text)
    sample.status = Status.COMPLETED
    return sample


def sync_generate(ctx, sample, sampling_params, evaluation=False):
    sample.tokens = ctx.encode(sample.prompt)
    sample.append_response([1], [-1.0], text="")
    sample.status = Status.COMPLETED
    return sample


async def generate_none(ctx, sample, sampling_params, evaluation=False):
    return None


async def generate_fanout(ctx, sample, sampling_params, evaluation=False):
    return [sample, sample]


# rollout.dynamic_filter -------------------------------------------------------------------
def keep_first_in_group(cfg, group, every=2):
    CALLS.append(("filter", type(cfg).__name__, len(group)))
    keep = group[0].group_index % every == 0
    return DynamicFilterOutput(keep=keep, reason=None if keep else "odd")


async def async_bool_filter(cfg, group):
    return group[0].group_index != 1


def filter_returns_none(cfg, group):
    return None


def filter_returns_str(cfg, group):
    return "keep"


# reward.custom ------------------------------------------------------------------------------
def rm(cfg, sample, bonus=0.0):
    CALLS.append(("rm", type(cfg).__name__))
    return float(sample.response == sample.label) + bonus


async def async_rm(cfg, sample):
    return {"acc": 1.0, "len": len(sample.response)}


def rm_str(cfg, sample):
    return "1.0"


async def group_rm(cfg, samples, scale=1.0):
    CALLS.append(("group_rm", len(samples)))
    return [scale * i for i in range(len(samples))]


def group_rm_short(cfg, samples):
    return [1.0]


def group_rm_scalar(cfg, samples):
    return 1.0


# data.buffer_filter ---------------------------------------------------------------------------
def newest_first(buffer, n, limit=None):
    CALLS.append(("buffer", len(buffer), n))
    k = min(n, limit or n, len(buffer))
    taken = buffer[len(buffer) - k:][::-1]
    del buffer[len(buffer) - k:]
    return taken


def buffer_no_pop(buffer, n):
    return list(buffer[:n])


def buffer_too_many(buffer, n):
    taken = list(buffer)
    buffer.clear()
    return taken


def buffer_none(buffer, n):
    return None
'''


@pytest.fixture
def hooks(tmp_path, monkeypatch):
    (tmp_path / "user_hooks.py").write_text(textwrap.dedent(HOOKS))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    import sys

    sys.modules.pop("user_hooks", None)
    mod = importlib.import_module("user_hooks")
    yield mod
    sys.modules.pop("user_hooks", None)


SMALL = ["rollout.batch_size=2", "rollout.n_samples_per_prompt=2", "data.num_eval=4"]


# ------------------------------------------------------------------------------ rollout.generate
@pytest.mark.parametrize("spec", ["user_hooks.generate", "{_target_: user_hooks.generate, answer: '7'}",
                                  "user_hooks.sync_generate"])
def test_generate_hook(hooks, spec):
    m = make_rollout([*SMALL, f"rollout.generate={spec}", "rollout.max_response_len=3"])
    groups, _ = m.run()
    assert len(groups) == 2 and all(s.status == Status.COMPLETED and s.reward is not None for g in groups for s in g)
    if "answer" in spec:
        assert {s.response for g in groups for s in g} == {"7"}
    if spec == "user_hooks.generate":
        assert all(s.reward == 1.0 for g in groups for s in g)  # the exact reward saw the response
        assert hooks.CALLS[0] == ("generate", False, 3, 1.0)  # training: evaluation=False, rollout params
        hooks.CALLS.clear()
        out = m.eval()
        assert out["eval/heldout/reward"] == 1.0
        assert set(hooks.CALLS) == {("generate", True, 3, 0.0)}  # eval: evaluation=True, greedy


@pytest.mark.parametrize("spec, needle", [
    ("user_hooks.generate_none", "returned NoneType; expected a Sample"),
    ("user_hooks.generate_fanout", "returned a list (fan-out is not supported"),
])
def test_generate_hook_wrong_return(hooks, spec, needle):
    m = make_rollout([*SMALL, f"rollout.generate={spec}"])
    with pytest.raises(TypeError) as e:
        m.run()
    assert needle in str(e.value) and spec in str(e.value)


def test_generate_hook_bad_spec_fails_at_load(hooks):
    with pytest.raises(HookError, match="'user_hooks' has no attribute 'nope'"):
        make_rollout([*SMALL, "rollout.generate=user_hooks.nope"])


# ------------------------------------------------------------------------ rollout.dynamic_filter
@pytest.mark.parametrize("spec, kept", [
    ("user_hooks.keep_first_in_group", [0, 2]),
    ("{_target_: user_hooks.keep_first_in_group, every: 3}", [0, 3]),
    ("user_hooks.async_bool_filter", [0, 2]),
])
def test_dynamic_filter_hook(hooks, spec, kept):
    m = make_rollout([*SMALL, "rollout.generate=user_hooks.generate", f"rollout.dynamic_filter={spec}"])
    groups, metrics = m.run()
    assert [g[0].group_index for g in groups] == kept
    if spec.startswith("user_hooks.keep"):
        assert ("filter", RunConfig.__name__, 2) in hooks.CALLS  # (cfg: RunConfig, group)
        assert metrics["rollout/dynamic_filter/drop_odd"] >= 1
    if spec == "user_hooks.async_bool_filter":
        assert metrics["rollout/dynamic_filter/drop_filtered"] >= 1


@pytest.mark.parametrize("spec", ["user_hooks.filter_returns_none", "user_hooks.filter_returns_str"])
def test_dynamic_filter_wrong_return(hooks, spec):
    m = make_rollout([*SMALL, "rollout.generate=user_hooks.generate", f"rollout.dynamic_filter={spec}"])
    with pytest.raises(TypeError, match=f"rollout.dynamic_filter '{spec}' returned .*expected a bool or"):
        m.run()


# --------------------------------------------------------------------------------- reward.custom
def reward_cfg(custom, **kw) -> RewardConfig:
    return RewardConfig(type="custom", custom=custom, **kw)


def test_custom_reward_per_sample(hooks):
    s = Sample(prompt="1=", label="1", response="1")
    assert asyncio.run(compute_reward(reward_cfg("user_hooks.rm"), s)) == 1.0
    assert ("rm", "RewardConfig") in hooks.CALLS  # rm(reward_cfg, sample)
    assert asyncio.run(compute_reward(reward_cfg({"_target_": "user_hooks.rm", "bonus": 0.5}), s)) == 1.5
    assert asyncio.run(compute_reward(reward_cfg("user_hooks.async_rm", key="acc"), s)) == {"acc": 1.0, "len": 1}
    with pytest.raises(RewardError, match="^custom reward user_hooks.rm_str: returned str for group 0, sample 0, "
                                          "prompt '1='; expected a finite number or a dict$"):
        asyncio.run(compute_reward(reward_cfg("user_hooks.rm_str"), s))


def test_custom_reward_through_the_manager(hooks):
    """reward.custom from the config, called on every generated sample; a dict reward needs reward.key."""
    m = make_rollout([*SMALL, "rollout.generate=user_hooks.generate", "reward.type=custom",
                      "reward.custom={_target_: user_hooks.rm, bonus: 0.25}"])
    groups, _ = m.run()
    assert {s.reward for g in groups for s in g} == {1.25}
    m = make_rollout([*SMALL, "rollout.generate=user_hooks.generate", "reward.type=custom",
                      "reward.custom=user_hooks.async_rm"])
    with pytest.raises(ValueError, match=r"the reward is a dict \['acc', 'len'\]; set reward.key"):
        m.run()
    m = make_rollout([*SMALL, "rollout.generate=user_hooks.generate", "reward.type=custom",
                      "reward.custom=user_hooks.async_rm", "reward.key=acc"])
    groups, _ = m.run()
    _, metrics = train_data([s for g in groups for s in g], m.cfg.algo, 2, m.cfg.reward.key)
    assert metrics["rollout/reward_mean"] == 1.0


def test_custom_group_reward(hooks):
    samples = [Sample(prompt="1=", label="1", response=str(i)) for i in range(3)]
    cfg = reward_cfg({"_target_": "user_hooks.group_rm", "scale": 2.0}, group=True)
    assert asyncio.run(compute_group_reward(cfg, samples)) == [0.0, 2.0, 4.0]
    with pytest.raises(RewardError, match="expected a list of 3 rewards, got 1 values"):
        asyncio.run(compute_group_reward(reward_cfg("user_hooks.group_rm_short", group=True), samples))
    with pytest.raises(RewardError, match="expected a list of 3 rewards, got float"):
        asyncio.run(compute_group_reward(reward_cfg("user_hooks.group_rm_scalar", group=True), samples))
    m = make_rollout([*SMALL, "rollout.generate=user_hooks.generate", "reward.type=custom", "reward.group=true",
                      "reward.custom=user_hooks.group_rm"])
    groups, _ = m.run()
    assert [[s.reward for s in g] for g in groups] == [[0.0, 1.0], [0.0, 1.0]]
    assert ("group_rm", 2) in hooks.CALLS


# ---------------------------------------------------------------------------- data.buffer_filter
@pytest.mark.parametrize("spec, order", [
    ("user_hooks.newest_first", [102, 101]),
    ("{_target_: user_hooks.newest_first, limit: 1}", [102, 0]),
])
def test_buffer_filter_hook(hooks, spec, order):
    m = make_rollout([*SMALL, f"data.buffer_filter={spec}"])
    m.source.add_samples([[Sample(group_index=100 + i) for _ in range(2)] for i in range(3)])
    got = m.source.get_samples(2)
    assert [g[0].group_index for g in got] == order  # buffered groups first, then new prompts
    assert ("buffer", 3, 2) in hooks.CALLS  # f(buffer, n)


@pytest.mark.parametrize("spec, error, needle", [
    ("user_hooks.buffer_no_pop", ValueError, "must remove the groups it returns"),
    ("user_hooks.buffer_too_many", ValueError, "returned 3 groups, more than the 2 asked for"),
    ("user_hooks.buffer_none", TypeError, "NoneType"),
])
def test_buffer_filter_wrong_return(hooks, spec, error, needle):
    m = make_rollout([*SMALL, f"data.buffer_filter={spec}"])
    m.source.add_samples([[Sample(group_index=100 + i) for _ in range(2)] for i in range(3)])
    with pytest.raises(error, match=needle):
        m.source.get_samples(2)


def test_default_generate_sends_plain_tokens_and_continues_a_partial_response_with_the_budget_left():
    """The default generate's own contract: ctx.encode adds no special tokens, log-probs are asked
    for, the answer's finish reason sets the status, and an aborted sample continues from its tokens
    with the budget left."""
    from slime_hydra.data.tokenizer import builtin_tokenizer
    from slime_hydra.rollout.generate import generate

    class Engine:
        async def post(self, path, payload):
            self.payload = copy.deepcopy(payload)  # as sent
            return {"text": "9", "output_ids": [11],
                    "meta_info": {"output_token_logprobs": [[-0.3, 11, None]], "finish_reason": {"type": "stop"},
                                  "weight_version": "2"}}

    engine = Engine()
    ctx = GenerateContext(cfg=None, tokenizer=builtin_tokenizer("builtin:digits"), client=engine)
    s = Sample(prompt="3815=")
    out = asyncio.run(generate(ctx, s, {"max_new_tokens": 4}))
    assert engine.payload["input_ids"] == ctx.encode("3815=") and engine.payload["return_logprob"] is True
    assert out.response == "9" and out.rollout_log_probs == [-0.3] and out.weight_versions == ["2"]
    assert out.status == Status.COMPLETED
    out.status = Status.ABORTED
    asyncio.run(generate(ctx, out, {"max_new_tokens": 4}))
    assert engine.payload["input_ids"] == ctx.encode("3815=") + [11]
    assert engine.payload["sampling_params"]["max_new_tokens"] == 3 and out.response_length == 2
