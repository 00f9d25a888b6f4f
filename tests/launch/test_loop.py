"""The loop's helpers that need no cluster: the log-prob gap guard, the staleness bound of async runs,
carrying metrics over when a checkpoint of another run is resumed in a new run directory, and the run summary."""

from __future__ import annotations

import json

import pytest

from conftest import compose, resolved
from slime_hydra.launch.loop import check_logprob_gap, check_staleness, summarize
from slime_hydra.launch.parts import carry_history


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
