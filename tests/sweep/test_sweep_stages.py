"""A sweep over the staged experiment (SFT then GRPO): each job runs both stages, and the report reads its
stages' metrics one after the other."""

from __future__ import annotations

import json

import pytest
from sweep_helpers import FAST, leftover_processes, sweep, table

from slime_hydra.sweep.report import read_metrics

SHORT = ["trainer.num_rollout=2", "rollout.batch_size=8", "rollout.n_samples_per_prompt=1",
         "algo.normalize_rewards=false", "algo.kl_loss_coef=0", "eval.interval=0", "logging.progress=false"]


@pytest.mark.integration
def test_sweep_over_the_staged_experiment(tmp_path):
    d = tmp_path / "sweep"
    out = sweep(d, "experiment=sft_then_grpo", "seed=1,2", *SHORT, *FAST)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    jobs = sorted(p for p in d.iterdir() if p.is_dir())
    rows = table(d)
    assert len(jobs) == len(rows) == 2
    for job, row, seed in zip(jobs, rows, (1, 2)):
        summary = json.loads((job / "summary.json").read_text())
        assert list(summary["stages"]) == ["0_sft", "1_grpo"] and summary["run_dir"] == str(job / "1_grpo")
        assert f"seed: {seed}\n" in (job / "0_sft/config.yaml").read_text()
        assert "0_sft/checkpoints/step_" in (job / "1_grpo/config.yaml").read_text()
        # the table: the whole experiment's steps (SFT's 2, then GRPO's 2), the last stage's held-out reward
        assert row["status"] == "ok" and row["steps"] == "4"
        assert row["objective"] == row["final_reward"] == str(round(summary["eval_reward_final"], 4))
    assert not leftover_processes(), leftover_processes()


def test_read_metrics_puts_a_staged_jobs_stages_one_after_the_other(tmp_path):
    for stage, steps in (("0_sft", [0, 1, 2]), ("1_grpo", [0, 1, 2, 3])):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in steps))
    rows = read_metrics(str(tmp_path))
    assert [(r["step"], r["stage"]) for r in rows] == [
        (0, "0_sft"), (1, "0_sft"), (2, "0_sft"), (2, "1_grpo"), (3, "1_grpo"), (4, "1_grpo"), (5, "1_grpo")]
    assert read_metrics(str(tmp_path / "none")) == []
