"""Built-in rewards (exact, f1, math with tricky answers), dispatch, custom hooks."""

import asyncio
import textwrap
import threading

import pytest
from omegaconf import OmegaConf

from slime_hydra.config.schema import RewardConfig
from slime_hydra.data.sample import Sample
from slime_hydra.rewards import (
    RewardError,
    compute_group_reward,
    compute_reward,
    exact_reward,
    extract_answer,
    f1_reward,
    hub,
    math_pool,
    math_reward,
)


def S(response, label, **meta):
    return Sample(prompt="p", response=response, label=label, metadata=meta)


# ----------------------------------------------------------------------------------- exact, f1
@pytest.mark.parametrize("resp, label, want", [
    ("Paris", "Paris", 1.0), ("  Paris.\n", "Paris", 1.0), ("Paris", "Paris.", 1.0), ("paris", "Paris", 0.0),
    ("8", 8, 1.0), ("Paris is", "Paris", 0.0),
])
def test_exact(resp, label, want):
    assert exact_reward(resp, label) == want


def test_f1():
    assert f1_reward("The Eiffel Tower!", "eiffel tower") == 1.0
    assert f1_reward("tower in Paris", "Eiffel tower") == pytest.approx(0.4)  # p=1/3, r=1/2
    assert f1_reward("nothing", "Eiffel tower") == 0.0
    assert f1_reward("", "") == 1.0 and f1_reward("a", "x") == 0.0
    assert f1_reward("eiffel", ["louvre", "eiffel"]) == 1.0  # best of several answers


# ------------------------------------------------------------------------------------ math
@pytest.mark.parametrize("resp, label", [
    (r"So the answer is \boxed{\frac{1}{2}}.", "0.5"),
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    (r"\boxed{\dfrac{1}{2}}", "1/2"),
    (r"\boxed{\frac{\sqrt{3}}{\sqrt{4}}}", r"\frac{\sqrt3}{2}"),          # nested braces
    (r"<think>maybe \boxed{3}</think> The answer is $\boxed{5}$", "5"),  # after </think>
    ("The length is 5 cm", "5"),
    (r"\boxed{5\text{ cm}}", "5"),
    ("There are 1,000 apples.", "1000"),
    (r"\boxed{1\,000}", "1000"),
    ("x = -3", "-3"),
    (r"\boxed{-\frac{3}{4}}", "-0.75"),
    ("5-3 = 2", "2"),
    (r"The answer is $\frac{1}{2}$.", "0.5"),                          # last number sits in $...$
    ("The answer is 7", r"\boxed{7}"),                                  # boxed / $ labels
    ("The answer is 7", "$7$"),
    (r"\boxed{x+1}", "1+x"),
    ("final: 12.", 12),                                                 # numeric label
])
def test_math_equivalent(resp, label):
    assert math_reward(resp, label) == 1.0


@pytest.mark.parametrize("resp, label", [
    (r"\boxed{3}", "-3"),
    ("The length is 5 cm", "6"),
    (r"<think>the answer is 5", "5"),       # never left <think>: no answer
    (r"\boxed{{{", "1"),                   # unbalanced, no number
    ("no idea", "1"),
    (r"\boxed{\frac{1}{3}}", "0.33"),
    ("", "1"),
    (r"\boxed{" + "1+" * 2000 + "1}", "2001"),  # oversized answers score 0, fast
])
def test_math_not_equivalent_never_raises(resp, label):
    assert math_reward(resp, label) == 0.0


def test_extract_answer():
    assert extract_answer(r"a \boxed{1} then \boxed{\frac{2}{3}} end") == r"\frac{2}{3}"
    assert extract_answer(r"\fbox{4}") == "4"
    assert extract_answer("costs 12.50 dollars, or 13") == "13"
    assert extract_answer("nothing here") is None


def test_math_in_a_thread():
    """math_verify's signal timeouts raise outside the main thread; ours must not."""
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward(r"\boxed{\frac{1}{2}}", "0.5")))
    t.start()
    t.join()
    assert out == [1.0]


@pytest.mark.integration
def test_math_async_in_worker_processes_with_limits(monkeypatch):
    async def main():
        cfg = RewardConfig(type="math")
        got = await compute_group_reward(cfg, [S(r"\boxed{\frac12}", "0.5"), S("7", "8")])
        assert got == [1.0, 0.0]
        # math_verify's own alarm stops a hostile comparison inside the worker
        monkeypatch.setattr(math_pool, "MATH_TIMEOUT_S", 1)
        assert await compute_reward(cfg, S(r"\boxed{9^{9^{9^{9}}}}", "1")) == 0.0
        # the backstop kills a worker that runs over, and the next answer gets a fresh pool
        monkeypatch.setattr(math_pool, "MATH_TIMEOUT_S", 30)
        monkeypatch.setattr(math_pool, "BACKSTOP_S", 0.5)
        assert await compute_reward(cfg, S(r"\boxed{9^{9^{9^{9}}}}", "1")) == 0.0
        monkeypatch.setattr(math_pool, "BACKSTOP_S", 30.0)
        assert await compute_reward(cfg, S("it is 0.5", r"\frac{1}{2}")) == 1.0

    try:
        asyncio.run(main())
    finally:
        math_pool.shutdown()


# -------------------------------------------------------------------------------- dispatch
def test_rm_type_in_metadata_wins():
    cfg = RewardConfig(type="exact")
    assert asyncio.run(compute_reward(cfg, S("eiffel tower", "Eiffel Tower", rm_type="f1"))) == 1.0
    assert asyncio.run(compute_reward(cfg, S("eiffel tower", "Eiffel Tower"))) == 0.0
    with pytest.raises(RewardError, match="unknown reward type 'nope'.*exact, math, f1, remote, custom"):
        asyncio.run(compute_reward(cfg, S("x", "y", rm_type="nope")))


@pytest.fixture
def hooks_mod(tmp_path, monkeypatch):
    (tmp_path / "my_rm.py").write_text(textwrap.dedent("""
        calls = []

        def length(cfg, sample, bonus=0.0):
            calls.append(sample.index)
            return len(sample.response) + bonus

        async def as_dict(cfg, sample):
            return {"acc": 1.0, "len": len(sample.response)}

        async def ranks(cfg, samples):
            order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
            return [float(order.index(i)) for i in range(len(samples))]

        def wrong_count(cfg, samples):
            return [1.0]

        def bad_type(cfg, sample):
            return "high"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib  # noqa: E401
    import sys
    sys.modules.pop("my_rm", None)
    monkeypatch.setattr(hub, "_hooks", {})  # a fresh module per test: forget hooks loaded before
    return importlib.import_module("my_rm")


def test_custom_sync_async_and_dict(hooks_mod):
    cfg = RewardConfig(type="custom", custom="my_rm.length")
    assert asyncio.run(compute_reward(cfg, S("abcd", None))) == 4.0
    cfg = RewardConfig(type="custom", custom=OmegaConf.create({"_target_": "my_rm.length", "bonus": 0.5}))
    assert asyncio.run(compute_reward(cfg, S("ab", None))) == 2.5
    cfg = RewardConfig(type="custom", custom="my_rm.as_dict", key="acc")
    r = asyncio.run(compute_reward(cfg, S("abc", None)))
    assert r == {"acc": 1.0, "len": 3}
    s = S("abc", None)
    s.reward = r
    assert s.reward_value(cfg.key) == 1.0
    with pytest.raises(RewardError, match="my_rm.bad_type.*returned str"):
        asyncio.run(compute_reward(RewardConfig(type="custom", custom="my_rm.bad_type"), S("x", None)))


def test_custom_group(hooks_mod):
    cfg = RewardConfig(type="custom", custom="my_rm.ranks", group=True)
    group = [S("ccc", None), S("a", None), S("bb", None)]
    assert asyncio.run(compute_group_reward(cfg, group)) == [2.0, 0.0, 1.0]
    with pytest.raises(RewardError, match="use compute_group_reward"):
        asyncio.run(compute_reward(cfg, group[0]))
    bad = RewardConfig(type="custom", custom="my_rm.wrong_count", group=True)
    with pytest.raises(RewardError, match="expected a list of 3 rewards, got 1 values"):
        asyncio.run(compute_group_reward(bad, group))
    # a group whose samples ask for another type is scored per sample
    mixed = [S("x", "x", rm_type="exact"), S("y", "x", rm_type="exact")]
    assert asyncio.run(compute_group_reward(cfg, mixed)) == [1.0, 0.0]


def test_custom_hook_is_loaded_once(hooks_mod, monkeypatch):
    loads = []
    real = hub.load_hook
    monkeypatch.setattr(hub, "load_hook", lambda spec: loads.append(spec) or real(spec))
    cfg = RewardConfig(type="custom", custom=OmegaConf.create({"_target_": "my_rm.length", "bonus": 1.0}))

    async def main():
        return await asyncio.gather(*(compute_reward(cfg, Sample(response="x", index=i)) for i in range(3)))

    assert asyncio.run(main()) == [2.0, 2.0, 2.0] and sorted(hooks_mod.calls) == [0, 1, 2]
    assert len(loads) == 1


def test_math_async_thread_fallback(monkeypatch):
    monkeypatch.setattr(math_pool, "WORKERS", 0)
    monkeypatch.setattr(math_pool, "_pool", None)
    assert asyncio.run(compute_reward(RewardConfig(type="math"), S(r"\boxed{2^{10}}", "1024"))) == 1.0
    assert math_pool._pool is None
