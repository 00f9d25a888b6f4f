"""SFT, on-policy distillation and stages through run.py: a staged experiment killed in its second stage
resumes there; SFT and OPD each raise the held-out reward on CPU over seeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_kill_resume import kill_when, start

from runs import FAST, metrics, run

STAGES = ("stages=[{name:sft,overrides:['algo=sft','trainer.num_rollout=2']},"
          "{name:grpo,overrides:['algo=grpo','trainer.num_rollout=6']}]")
SMALL = ["trainer.save_interval=2", "rollout.batch_size=8", "rollout.n_samples_per_prompt=1", "algo.kl_loss_coef=0"]


@pytest.mark.integration
def test_staged_experiment_resumes_in_its_second_stage(tmp_path):
    """SFT (2 steps) then GRPO (6) from SFT's final checkpoint; killed once GRPO saved step 2, the same command
    with trainer.resume=auto skips SFT and resumes GRPO: each GRPO step once, SFT's rows untouched."""
    d = tmp_path / "run"
    args = [STAGES, "algo.normalize_rewards=false", *SMALL, *FAST]
    proc = start(d, *args)
    kill_when(proc, lambda: (d / "1_grpo/checkpoints/step_000002/meta.json").exists())
    assert (d / "0_sft/summary.json").exists() and not (d / "1_grpo/summary.json").exists()
    sft_rows = metrics(d / "0_sft")
    summary = run(d, *args, "trainer.resume=auto")
    assert summary["steps"] == 6 and summary["run_dir"] == str(d / "1_grpo")
    assert [r["step"] for r in metrics(d / "1_grpo")] == list(range(7))
    assert metrics(d / "0_sft") == sft_rows
    config = (d / "1_grpo/config.yaml").read_text()
    assert "0_sft/checkpoints/step_" in config and "/hf" in config  # GRPO started from SFT's final weights


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_sft_learns(tmp_path, seed):
    summary = run(tmp_path / "sft", "algo=sft", "trainer.num_rollout=20", f"seed={seed}", "logging.progress=false")
    assert summary["eval_reward_initial"] < 0.2 and summary["eval_reward_final"] >= 0.9, summary


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    """A teacher that knows the task: 20 SFT steps on the labels (held-out about 0.99)."""
    d = tmp_path_factory.mktemp("teacher") / "run"
    summary = run(d, "algo=sft", "trainer.num_rollout=20", "logging.progress=false")
    assert summary["eval_reward_final"] >= 0.9, summary
    return str(d / "checkpoints/step_000020/hf")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_opd_learns_from_the_teacher(tmp_path, teacher, seed):
    d = tmp_path / "opd"
    summary = run(d, "algo=opd", f"teacher.path={teacher}", "trainer.num_rollout=40", f"seed={seed}",
                  "logging.progress=false")
    assert summary["eval_reward_final"] >= 0.85, summary
    kl = [r["train/opd_reverse_kl"] for r in metrics(d) if "train/opd_reverse_kl" in r]
    assert sum(kl[-5:]) < sum(kl[:5]) / 4, kl  # the student's tokens move towards the teacher's
    assert json.loads(Path(d / "summary.json").read_text())["steps"] == 40


@pytest.mark.integration
def test_sft_without_eval_starts_no_engine(tmp_path):
    """algo=sft with no eval sets: no engine, no router, no weight push; it trains and saves."""
    d = tmp_path / "run"
    summary = run(d, "algo=sft", "eval.datasets=[]", "trainer.num_rollout=2", "rollout.batch_size=8", *FAST)
    assert summary["steps"] == 2 and (d / "checkpoints/step_000002/hf").is_dir()
    assert sorted(p.name for p in (d / "logs").iterdir()) == ["rollout_manager.log"]
    rows = metrics(d)
    assert [r["step"] for r in rows] == [1, 2] and all("train/loss" in r for r in rows)
    assert not any(k.startswith("perf/weight_push") for r in rows for k in r)


def stages(sft: int, grpo: int) -> str:
    return (f"stages=[{{name:sft,overrides:['algo=sft','trainer.num_rollout={sft}']}},"
            f"{{name:grpo,overrides:['algo=grpo','trainer.num_rollout={grpo}']}}]")


@pytest.mark.integration
def test_a_finished_stage_given_other_steps_goes_on_or_is_refused(tmp_path):
    """Resumed with more steps for the last stage: it goes on from its checkpoint. More steps for a stage
    whose next stage already started from it: refused before anything starts, naming the stage."""
    import subprocess
    import sys

    from runs import ENV, ROOT

    d = tmp_path / "run"
    args = ["algo.normalize_rewards=false", *SMALL, *FAST]
    run(d, stages(2, 2), *args)
    sft_rows = metrics(d / "0_sft")
    summary = run(d, stages(2, 3), *args, "trainer.resume=auto")
    assert summary["steps"] == 3 and [r["step"] for r in metrics(d / "1_grpo")] == [0, 1, 2, 3]
    assert metrics(d / "0_sft") == sft_rows
    out = subprocess.run([sys.executable, "run.py", f"hydra.run.dir={d}", stages(3, 3), *args, "trainer.resume=auto"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "stage 0 (0_sft): trainer.num_rollout=3, but this stage finished 2 steps" in out.stderr
    assert "the stages after it (1_grpo) started from that result" in out.stderr
    assert metrics(d / "0_sft") == sft_rows


@pytest.mark.integration
def test_sft_pushes_weights_to_its_eval_engine_only_before_an_eval(tmp_path):
    """algo=sft with an eval set on one colocated slot: the engine gets the weights just before each eval (and
    sleeps again at the next step), not after every step."""
    d = tmp_path / "run"
    run(d, "algo=sft", "parallelism=cpu_colocate", "eval.interval=2", "trainer.num_rollout=3", "rollout.batch_size=8",
        "logging.progress=false")
    rows = metrics(d)
    assert [r["step"] for r in rows if "perf/weight_sync_bytes" in r] == [2, 3]
    assert [r["step"] for r in rows if "eval/heldout/reward" in r] == [0, 2, 3]
