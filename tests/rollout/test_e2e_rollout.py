"""Real runs (``python run.py``: Hydra, Ray, the embedded engine behind sglang-router, the torch
trainer) of the rollout features: training from a converted JSONL file with named eval datasets,
DAPO's dynamic sampling with partial rollout, the multi-turn calculator agent, and a rollout
function of one's own."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]
FAST = ["logging.progress=false", "logging.backends=[]", "logging.plot=false"]


def run(run_dir: Path, *overrides: str, timeout: int = 900, env: dict = None) -> dict:
    cmd = [sys.executable, "run.py", f"hydra.run.dir={run_dir}", *overrides]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> List[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def convert(src: Path, dst: Path, *args: str) -> None:
    out = subprocess.run([sys.executable, "-m", "slime_hydra.data", "convert", str(src), str(dst), *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and dst.exists(), out.stdout + out.stderr


def test_train_from_converted_jsonl_with_two_eval_sets(tmp_path):
    """CSV -> converter -> JSONL -> ``data=jsonl`` training with two named eval datasets, one
    sampled 4 times per prompt: per-dataset rewards and pass@k land in metrics.jsonl."""
    from slime_hydra.data.tasks import make_splits

    train, held = make_splits("max_digit", 2000, 64, seed=7)
    files = {"train": train, "greedy": held[:32], "sampled": held[32:]}
    for name, rows in files.items():
        with open(tmp_path / f"{name}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["question", "answer", "source"])
            w.writeheader()
            w.writerows({"question": r["prompt"], "answer": r["label"], "source": name} for r in rows)
        convert(tmp_path / f"{name}.csv", tmp_path / f"{name}.jsonl", "--input-col", "question", "--label-col",
                "answer", "--metadata-cols", "source", "--chat")
    first = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    assert first["prompt"] == [{"role": "user", "content": train[0]["prompt"]}] and first["label"] == train[0]["label"]

    d = tmp_path / "run"
    evals = (f"[{{name: greedy, path: '{tmp_path / 'greedy.jsonl'}'}}, "
             f"{{name: sampled, path: '{tmp_path / 'sampled.jsonl'}', n_samples_per_prompt: 4, temperature: 1.0}}]")
    summary = run(d, "data=jsonl", f"data.path={tmp_path / 'train.jsonl'}", f"eval.datasets={evals}", "eval.interval=3",
                  "trainer.num_rollout=6", "rollout.batch_size=16", "rollout.max_response_len=4", "algo.lr=3e-3",
                  *FAST)
    rows = metrics(d)
    assert [r["step"] for r in rows] == list(range(7))
    for step in (0, 3, 6):
        row = rows[step]
        for key in ("eval/greedy/reward", "eval/greedy/response_len", "eval/sampled/reward", "eval/sampled/pass@1",
                    "eval/sampled/pass@2", "eval/sampled/pass@4", "eval/sampled/truncated_ratio"):
            assert key in row, (step, key, sorted(row))
        assert "eval/greedy/pass@2" not in row  # one sample per prompt
        assert row["eval/sampled/pass@1"] <= row["eval/sampled/pass@2"] <= row["eval/sampled/pass@4"]
        assert row["eval/sampled/pass@1"] == pytest.approx(row["eval/sampled/reward"])
    assert summary["steps"] == 6 and rows[1]["rollout/samples"] == 16 * 8


def test_dapo_dynamic_sampling_with_partial_rollout(tmp_path):
    """algo=dapo drops zero-std groups and over-samples until the batch is full; partial rollout
    recycles the groups cut off; every trained group has rewards that differ."""
    d = tmp_path / "run"
    run(d, "algo=dapo", "rollout.over_sampling_batch_size=48", "rollout.partial_rollout=true",
        "rollout.n_samples_per_prompt=8", "trainer.num_rollout=12", "eval.interval=0", *FAST)
    rows = metrics(d)[1:]
    # only groups with signal are trained on, except those admitted once the sampling budget
    # (rollout.max_sampled_groups, 128 in the dapo recipe) ran out: exactly the fallback groups
    for r in rows:
        assert r["rollout/zero_std_groups"] * 32 == r["rollout/dynamic_filter/fallback_groups"], r
    assert any(r["rollout/dynamic_filter/fallback_groups"] == 0 for r in rows)
    assert all(r["rollout/samples"] == 32 * 8 for r in rows)
    assert sum(r["rollout/dynamic_filter/dropped_groups"] for r in rows) > 0
    assert sum(r.get("rollout/dynamic_filter/drop_zero_std_0.0", 0) for r in rows) > 0
    assert sum(r["rollout/recycled_groups"] for r in rows) > 0
    assert any(r["rollout/resumed_samples"] > 0 for r in rows)


@pytest.mark.parametrize("seed", [1234, 1])
def test_calculator_agent_learns_the_tool_protocol(tmp_path, seed):
    """experiment=calculator_agent as shipped: the OpenAI-SDK agent of examples/calculator/agent.py behind the
    per-sample endpoint, 150 steps. The held-out reward rises from 0 to at least 0.3, three times a guessing
    model's 0.1, and every answer goes through the calculator."""
    d = tmp_path / "run"
    summary = run(d, "experiment=calculator_agent", f"seed={seed}", "trainer.save_interval=0", "eval.interval=50",
                  *FAST)
    rows = metrics(d)
    assert summary["eval_reward_initial"] == 0.0
    assert summary["eval_reward_final"] >= 0.3, summary  # a calling model that guesses gets 0.1
    assert rows[-1]["eval/heldout/tool_use_ratio"] >= 0.9
    assert rows[-1]["rollout/turns_mean"] >= 1.5
    assert not any(r.get("rollout/agent_error_count") or r.get("rollout/agent_timeout_count") for r in rows)
    assert summary["max_logprob_abs_diff"] < 1e-3  # masked tool tokens do not count


MY_ROLLOUT = """
from slime_hydra.rollout.rollout_fn import default_rollout


async def tagged(ctx, rollout_id, weight_version=None, tag=0.0):
    groups, metrics = await default_rollout(ctx, rollout_id, weight_version)
    return groups, {**metrics, "rollout/tag": tag + rollout_id, "rollout/weight_version": float(weight_version)}
"""


def test_own_rollout_function(tmp_path):
    """rollout.rollout_function from a module of one's own, with a bound argument, called by the
    rollout manager in its Ray actor for every rollout with that rollout's id and weight version."""
    (tmp_path / "my_rollout.py").write_text(MY_ROLLOUT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    d = tmp_path / "run"
    run(d, "rollout.rollout_function={_target_: my_rollout.tagged, tag: 100}", "trainer.num_rollout=3",
        "eval.interval=0", "eval.before_train=false", "rollout.max_response_len=4", "rollout.batch_size=8",
        "rollout.n_samples_per_prompt=4", *FAST, env=env)
    rows = [r for r in metrics(d) if "rollout/tag" in r]
    assert [(r["step"], r["rollout/tag"], r["rollout/weight_version"]) for r in rows] == [
        (1, 100.0, 0.0), (2, 101.0, 1.0), (3, 102.0, 2.0)]
    assert all(r["rollout/samples"] == 8 * 4 for r in rows)
