"""The driver's helpers that need no cluster: the log-prob gap guard, the staleness bound of async
runs, carrying metrics over when a checkpoint of another run is resumed in a new run directory, and
the run summary."""

from __future__ import annotations

import json

import pytest

from conftest import compose, resolved
from slime_hydra.launch.driver import carry_history, check_logprob_gap, check_staleness, summarize


def test_logprob_gap_guard_stops_sync_runs_only():
    gap = {"train/train_rollout_logprob_abs_diff": 5e-3}
    with pytest.raises(RuntimeError, match=r"step 7: .* 0.005 > sync.max_logprob_diff=0.001"):
        check_logprob_gap(resolved(["sync.max_logprob_diff=1e-3"]), gap, 7)
    check_logprob_gap(resolved(["sync.max_logprob_diff=1e-2"]), gap, 7)  # under the limit
    check_logprob_gap(resolved(["sync.max_logprob_diff=inf"]), gap, 7)  # off: only reported
    check_logprob_gap(resolved(["sync.max_logprob_diff=1e-3"]), {}, 7)  # no metric (critic-only step)
    # one step off-policy (async) or partial rollouts: older weights made some tokens, the gap is expected
    check_logprob_gap(resolved(["sync.max_logprob_diff=1e-3", "trainer.mode=async"]), gap, 7)
    check_logprob_gap(resolved(["sync.max_logprob_diff=1e-3", "rollout.partial_rollout=true"]), gap, 7)


def test_carry_history_copies_rows_up_to_the_checkpoint(tmp_path):
    old = tmp_path / "old"
    (old / "checkpoints" / "step_000003").mkdir(parents=True)
    (old / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "r": s / 10}) + "\n" for s in range(6)))
    new = tmp_path / "new"
    new.mkdir()
    carry_history(str(old / "checkpoints" / "step_000003"), str(new), 3)
    assert [json.loads(line)["step"] for line in (new / "metrics.jsonl").open()] == [0, 1, 2, 3]
    # resuming in the same directory, or into a directory that already has metrics, changes nothing
    (new / "metrics.jsonl").write_text('{"step": 0}\n')
    carry_history(str(old / "checkpoints" / "step_000003"), str(new), 3)
    assert (new / "metrics.jsonl").read_text() == '{"step": 0}\n'
    carry_history(str(old / "checkpoints" / "step_000003"), str(old), 3)
    assert len((old / "metrics.jsonl").read_text().splitlines()) == 6


def test_summary_reads_the_first_and_last_evaluations():
    history = [{"step": 0, "eval/a/reward": 0.1, "eval/b/reward": 0.3},
               {"step": 1, "rollout/reward_mean": 0.2, "train/train_rollout_logprob_abs_diff": 2e-7},
               {"step": 2, "rollout/reward_mean": 0.5, "train/train_rollout_logprob_abs_diff": 1e-7,
                "eval/a/reward": 0.6, "eval/b/reward": 0.8},
               {"step": 3, "rollout/reward_mean": 0.7}]
    s = summarize(history, 3, 12.345, "/runs/x")
    assert s == {"steps": 3, "wall_s": 12.35, "eval_reward_initial": pytest.approx(0.2),
                 "eval_reward_final": pytest.approx(0.7), "train_reward_first": 0.2, "train_reward_last": 0.7,
                 "max_logprob_abs_diff": 2e-7, "run_dir": "/runs/x"}
    assert summarize([], 0, 1.0, "/runs/y")["train_reward_first"] is None


def test_staleness_is_measured_per_sample_and_bounded_in_async_runs():
    from slime_hydra.config import ConfigError
    from slime_hydra.data.sample import Sample
    from slime_hydra.launch.validate import check
    from slime_hydra.rollout.manager import staleness_metrics

    samples = [Sample(weight_versions=["4"]), Sample(weight_versions=["3", "4"]), Sample(weight_versions=["5"]),
               Sample(weight_versions=[])]  # aborted before its first token: no version
    assert staleness_metrics(samples, 5) == {"rollout/staleness_max": 2.0, "rollout/staleness_mean": 1.0}
    assert staleness_metrics([Sample()], 5) == {}
    lag = {"rollout/staleness_max": 2.0}
    with pytest.raises(RuntimeError, match=r"step 9: .* 2 training steps older .* trainer.max_staleness=1"):
        check_staleness(resolved(["trainer.mode=async"]), lag, 9)
    check_staleness(resolved(["trainer.mode=async", "trainer.max_staleness=2"]), lag, 9)
    check_staleness(resolved([]), lag, 9)  # sync runs lag only through partial rollouts: reported, not bounded
    with pytest.raises(ConfigError, match=r"trainer.max_staleness: 1 < trainer.update_weights_interval=2"):
        check(compose(["trainer.mode=async", "trainer.update_weights_interval=2"]))


@pytest.mark.parametrize("push_first", [True, False])
def test_push_before_offload_moves_the_weights_after_the_push(monkeypatch, push_first):
    """The order of a colocated push with both offloads (the calls only: test_e2e's colocated CPU runs make
    them for real): with ``push_first`` the trainer's optimizer state goes, the engines take back their
    weights' memory, the push reads the trainer's GPU weights, then the trainer's weights go and the engines
    take back their KV cache; without, the trainer goes to the host whole before the push."""
    from slime_hydra.launch import driver

    calls = []

    class Call:
        def __init__(self, name):
            self.name = name

        def remote(self, *args):
            calls.append(self.name)

    class Manager:
        onload_weights, onload_kv = Call("engines: weights"), Call("engines: kv cache")

    class Trainers:
        def offload(self, keep_weights=False):
            calls.append("trainer: optimizer state" if keep_weights else "trainer: weights and state")

        def update_weights(self, version):
            calls.append("push")
            return {"seconds": 0.0}

    monkeypatch.setattr(driver.ray, "get", lambda ref: ref)
    driver.push_weights(Manager(), Trainers(), 1, driver.Offload(trainer=True, engines=True, push_first=push_first))
    if push_first:
        assert calls == ["trainer: optimizer state", "engines: weights", "push", "trainer: weights and state",
                         "engines: kv cache"]
    else:
        assert calls == ["trainer: weights and state", "engines: weights", "push", "engines: kv cache"]


def test_push_before_offload_is_chosen_where_its_phase_fits():
    """The 4B shape with megatron on one H200 (bench/measured/h200_megatron_sglang_4b_1gpu.md): the push phase
    (the trainer's bf16 weights beside the engine's) fits, so the plan pushes before the offload; the phase
    shows in the estimate. Set to false, it stays false; without offload_train there is no such phase."""
    from slime_hydra.plan.memory import PUSH_PHASE, estimate
    from slime_hydra.plan.resources import make_plan

    shape = ["model=qwen3_4b", "trainer=megatron", "rollout=sglang", "parallelism=1gpu", "rollout.batch_size=8",
             "rollout.n_samples_per_prompt=8", "rollout.max_response_len=256", "rollout.max_prompt_len=64"]
    cfg = resolved(shape)
    p = cfg.parallelism
    assert (p.offload_train, p.offload_rollout, p.push_before_offload) == (True, True, True)
    gpus = estimate(cfg, make_plan(cfg)).gpus
    assert 15 < gpus[PUSH_PHASE] < gpus["colocated GPU, training"]  # 7.5 + 7.5 GiB of weights, 1 of buckets
    assert resolved([*shape, "parallelism.push_before_offload=false"]).parallelism.push_before_offload is False
    none = resolved([*shape, "parallelism.offload_train=false", "parallelism.offload_rollout=true"])
    assert none.parallelism.push_before_offload is False
    assert PUSH_PHASE not in estimate(none, make_plan(none)).gpus
    assert resolved(["parallelism=cpu_colocate"]).parallelism.push_before_offload is True  # CPU: the GPU's order
