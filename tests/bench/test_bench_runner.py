"""bench/run.py without running a scenario: the scenario file parses, every run of every scenario composes
with conf/ (so each override names a key the config knows), and the numbers read from a fabricated
``metrics.jsonl`` and ``summary.json`` are the ones a run would report."""

from __future__ import annotations

import json
import math
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import run as bench  # noqa: E402  (bench/run.py)

SCENARIOS = bench.load()
RUNS = [(name, label, variant) for name, sc in SCENARIOS.items() if not sc.get("script")
        for label, variant in bench.runs_of(sc)]


def test_every_scenario_says_what_it_measures_and_where_it_runs():
    assert {"default", "chaos", "anchor"} <= set(SCENARIOS)
    for name, sc in SCENARIOS.items():
        assert sc.get("what"), name
        assert sc.get("device", "cpu") in ("cpu", "cuda"), name
        assert sc.get("script") or bench.runs_of(sc), f"{name} runs nothing"
        assert not sc.get("shape") or (ROOT / "conf" / "model" / f"{sc['shape']}.yaml").is_file(), name


@pytest.mark.parametrize("name, label, variant", RUNS, ids=[f"{n}-{label}" for n, label, _ in RUNS])
def test_every_run_composes_with_conf(name, label, variant):
    from slime_hydra.config.describe import compose

    args = bench.overrides(SCENARIOS[name], variant)
    cfg = compose(args)  # an override of a key conf/ does not know raises here
    sc = SCENARIOS[name]
    if sc.get("measure"):
        assert cfg.trainer.num_rollout == (sc.get("warm") or 0) + sc["measure"]
    if sc.get("shape"):
        assert cfg.model.path.endswith(sc["shape"]) or sc["shape"] == "qwen3_0_6b"


def test_a_script_scenario_names_a_script_here():
    for sc in SCENARIOS.values():
        if sc.get("script"):
            assert (ROOT / sc["script"][0]).is_file()


def test_unknown_keys_and_baselines_are_refused(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("scenarios:\n  a: {what: x, overide: [seed=1]}\n")
    with pytest.raises(ValueError, match="unknown keys"):
        bench.load(path)
    path.write_text("scenarios:\n  a: {what: x, baseline: [vllm]}\n")
    with pytest.raises(ValueError, match="baseline"):
        bench.load(path)


def test_overrides_flatten_the_shared_lists_and_add_steps():
    sc = {"overrides": [["a=1", "b=2"], "c=3"], "warm": 2, "measure": 3, "variants": {"v": [["d=4"]]}}
    assert bench.overrides(sc, "v", extra=["e=5"]) == ["trainer.num_rollout=5", "a=1", "b=2", "c=3", "d=4", "e=5"]
    assert bench.overrides(sc, steps=7)[0] == "trainer.num_rollout=7"
    assert bench.runs_of({"runs": 2, "variants": {"v": []}}) == [("run1", None), ("run2", None), ("v", "v")]
    assert bench.runs_of({"runs": 0, "variants": {"v": []}}) == [("v", "v")]


def test_numbers_of_a_fabricated_run(tmp_path):
    rows = [{"step": 0, "eval/reward": 0.1},  # the evaluation before training: no step
            {"step": 1, "startup/total_s": 42.5, "perf/step_time": 9.0, "perf/rollout_time": 5.0,
             "perf/train_time": 3.0, "train/train_rollout_logprob_abs_diff": 0.006, "train/gpu_peak_gib": 30.0}]
    rows += [{"step": s, "perf/step_time": t, "perf/rollout_time": t - 0.3, "perf/train_time": 0.2,
              "perf/weight_sync_time": 0.06, "train/train_rollout_logprob_abs_diff": 0.0064,
              "train/gpu_peak_gib": 31.5} for s, t in ((2, 1.1), (3, 0.9), (4, 1.0))]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    got = bench.numbers(bench.read_rows(metrics), {"train_reward_last": 0.75, "eval_reward_final": math.nan})
    assert got == {"steps": 4, "measured_steps": 3, "start_s": 42.5, "step_s": 1.0, "rollout_s": pytest.approx(0.7),
                   "train_s": 0.2, "sync_s": 0.06, "logprob_gap": 0.0064, "peak_gib": 31.5,
                   "train_reward_last": 0.75}
    assert bench.numbers(rows[:2], {"startup": {"total_s": 40.0}})["step_s"] == 9.0  # one step: all there is
    assert bench.numbers(rows[:2], {"startup": {"total_s": 40.0}})["start_s"] == 40.0
    assert bench.read_rows(tmp_path / "none.jsonl") == []
    lines = bench.table({"run": got, "trl": {"step_s": 12.08}})
    assert lines[0].startswith("| run | start_s | step_s") and lines[-1].startswith("| trl | - | 12.08")


@pytest.mark.integration
def test_dry_run_prints_each_run_and_runs_nothing(capsys):
    assert bench.main(["anchor_fast_start", "--dry-run", "--", "seed=3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["run", "no_fast_start"]
    assert all("seed=3" in line for line in out)
    assert "rollout.sglang_fast_start=false" in out[1]
