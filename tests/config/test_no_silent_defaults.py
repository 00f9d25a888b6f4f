"""The failure rule (slime_hydra/rewards/hub.py): a broken hook, verifier or engine protocol raises
with the sample's identity; a verifier that fails on one answer scores 0 and is counted in
``rollout/<what>_count``, logged at WARNING the first time only."""

from __future__ import annotations

import asyncio
import logging

import pytest

from slime_hydra.config.schema import RewardConfig
from slime_hydra.data.sample import FinishReasonError, Sample, Status, finish_type, status_from_finish
from slime_hydra.data.tokenizer import builtin_tokenizer
from slime_hydra.rewards import (
    RewardError,
    compute_group_reward,
    compute_reward,
    drain_counters,
    hub,
    math_answer,
    math_pool,
)
from slime_hydra.rollout.multiturn import ChatRollout

PROMPT = "What is the largest digit of 3815? Answer with one digit, nothing else."


def S(response="7", label="7", group=3, index=2, **meta):
    return Sample(prompt=PROMPT, response=response, label=label, group_index=group, index=index, metadata=meta)


IDENTITY = "group 3, sample 2, prompt 'What is the largest digit of 3815? Answer with one digit, no...'"


@pytest.fixture(autouse=True)
def fresh_counters():
    drain_counters()
    yield
    drain_counters()


def test_identity_names_group_index_and_the_prompts_start():
    assert S().identity() == IDENTITY
    chat = Sample(prompt=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 +\n 2?"}])
    assert chat.identity() == "group 0, sample 0, prompt '2 + 2?'"


# ---------------------------------------------------------------------------- math verifier
def raising_verify(*args, **kwargs):
    raise AttributeError("'Tuple' object has no attribute 'is_zero'")  # what sympy raises on odd input


def test_a_verifier_exception_scores_0_is_counted_and_warned_once(monkeypatch, caplog):
    import math_verify

    monkeypatch.setattr(math_answer, "_verifier_checked", True)
    monkeypatch.setattr(math_verify, "verify", raising_verify)
    monkeypatch.setattr(math_pool, "WORKERS", 0)  # check in this process, where the patch holds
    monkeypatch.setattr(math_pool, "_pool", None)
    cfg = RewardConfig(type="math")
    with caplog.at_level(logging.DEBUG, logger="slime_hydra.rewards"):
        got = asyncio.run(compute_group_reward(cfg, [S(r"\boxed{7}", index=i) for i in range(3)]))
    assert got == [0.0, 0.0, 0.0]
    assert drain_counters() == {"rollout/reward_verifier_error_count": 3.0}
    assert drain_counters() == {}  # drained
    ours = [r for r in caplog.records if r.name == "slime_hydra.rewards"]
    assert [r.levelno for r in ours] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    first = ours[0].getMessage()
    assert first.startswith("group 3, sample ") and "math_verify raised AttributeError: 'Tuple' object" in first
    assert first.endswith("scored 0 (counted in rollout/reward_verifier_error_count; later ones are logged at DEBUG)")


def test_a_verifier_that_cannot_check_one_half_raises_at_first_use(monkeypatch):
    import math_verify

    monkeypatch.setattr(math_answer, "_verifier_checked", False)
    monkeypatch.setattr(math_verify, "verify", lambda *a, **k: False)  # "API change": every answer unequal
    with pytest.raises(RuntimeError, match=r"math_verify .* cannot check 1/2 == 0.5 \(it got them wrong\)"):
        math_answer.math_reward(r"\boxed{7}", "7")
    monkeypatch.setattr(math_verify, "verify", raising_verify)
    with pytest.raises(RuntimeError, match="cannot check 1/2 == 0.5 \\(AttributeError"):
        math_answer.math_reward(r"\boxed{7}", "7")


@pytest.mark.integration
def test_a_killed_verifier_is_counted_as_a_timeout(monkeypatch):
    async def main():
        monkeypatch.setattr(math_pool, "MATH_TIMEOUT_S", 30)
        monkeypatch.setattr(math_pool, "BACKSTOP_S", 0.5)
        return await compute_reward(RewardConfig(type="math"), S(r"\boxed{9^{9^{9^{9}}}}", "1"))

    try:
        assert asyncio.run(main()) == 0.0
    finally:
        math_pool.shutdown()
    assert drain_counters() == {"rollout/reward_verifier_timeout_count": 1.0}


def test_sync_math_reward_counts_a_verifier_timeout(monkeypatch):
    """math_verify's own alarm (main thread), without the worker pool."""
    assert math_answer.math_reward(r"\boxed{9^{9^{9^{9}}}}", "1", timeout_s=1) == 0.0
    assert drain_counters() == {"rollout/reward_verifier_timeout_count": 1.0}


# ---------------------------------------------------------------------------- custom rewards
@pytest.fixture
def rm(tmp_path, monkeypatch):
    (tmp_path / "rm_hooks.py").write_text(
        "def none(cfg, sample):\n    return None\n"
        "def nan(cfg, sample):\n    return float('nan')\n"
        "def boom(cfg, sample):\n    raise KeyError('score')\n"
        "def group_with_none(cfg, samples):\n    return [1.0] + [None] * (len(samples) - 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hub, "_hooks", {})


@pytest.mark.parametrize("hook, got", [("none", "None"), ("nan", "nan")])
def test_a_custom_reward_without_a_number_raises_naming_the_function_and_sample(rm, hook, got):
    with pytest.raises(RewardError) as e:
        asyncio.run(compute_reward(RewardConfig(type="custom", custom=f"rm_hooks.{hook}"), S()))
    assert str(e.value) == (f"custom reward rm_hooks.{hook}: returned {got} for {IDENTITY}; "
                            "expected a finite number or a dict")


def test_a_custom_reward_that_raises_is_raised_again_with_the_sample(rm):
    with pytest.raises(RewardError, match=r"^custom reward rm_hooks.boom raised KeyError: 'score' \(group 3, sample 2"):
        asyncio.run(compute_reward(RewardConfig(type="custom", custom="rm_hooks.boom"), S()))


def test_a_group_reward_with_a_none_names_that_sample(rm):
    group = [S(index=i) for i in range(3)]
    with pytest.raises(RewardError, match=r"rm_hooks.group_with_none: returned None for group 3, sample 1,"):
        asyncio.run(compute_group_reward(RewardConfig(type="custom", custom="rm_hooks.group_with_none", group=True),
                                         group))


def test_a_sample_without_a_reward_cannot_be_trained_on():
    with pytest.raises(ValueError) as e:
        Sample(prompt=PROMPT, group_index=3, index=2, status=Status.COMPLETED).reward_value()
    assert str(e.value).startswith(f"{IDENTITY}: has no reward (status completed)")
    with pytest.raises(ValueError, match=r"reward.key='acc' is not in its reward \['len'\]"):
        Sample(reward={"len": 3}).reward_value("acc")
    with pytest.raises(ValueError, match="its reward 'high' is not a number"):
        Sample(reward="high").reward_value()
    assert Sample(reward={"acc": 1}).reward_value("acc") == 1.0 and Sample(reward=0).reward_value() == 0.0


# ---------------------------------------------------------------------------- finish reasons
@pytest.mark.parametrize("finish, status", [("stop", Status.COMPLETED), ("length", Status.TRUNCATED),
                                            ("abort", Status.ABORTED)])
def test_sglangs_finish_reasons_set_the_status(finish, status):
    assert status_from_finish({"finish_reason": {"type": finish, "matched": 2}}, S()) == status


@pytest.mark.parametrize("meta", [{"finish_reason": {"type": "error"}}, {"finish_reason": None}, {}])
def test_an_unknown_or_missing_finish_reason_raises_with_the_sample(meta):
    with pytest.raises(FinishReasonError) as e:
        finish_type(meta, S())
    assert str(e.value) == (f"{IDENTITY}: the engine answered finish_reason={meta.get('finish_reason')!r}; expected a "
                            "type in stop, length, abort (SGLang's /generate protocol)")


def test_a_multi_turn_rollout_raises_on_an_unknown_finish_reason():
    tok = builtin_tokenizer("builtin:calc")
    five = tok.convert_tokens_to_ids("5")

    class Engine:
        cfg, aborting = None, False

        async def post(self, path, payload):
            return {"text": "5", "output_ids": [five],
                    "meta_info": {"output_token_logprobs": [[-0.5, five, None]], "finish_reason": {"type": "error"}}}

    chat = ChatRollout(tok, Sample(prompt="2*3-1", group_index=3, index=2))
    with pytest.raises(FinishReasonError, match="^group 3, sample 2, prompt '2\\*3-1': the engine answered"):
        asyncio.run(chat.assistant_turn(Engine(), {"max_new_tokens": 4}))
