"""Sweeps for real, the long cases: jobs queue on one cluster, a killed sweep resumes, an Optuna study
continues, and a pruned trial stops early and hands its resources to the next."""

from __future__ import annotations

import json
import signal
import time

import pytest
from sweep_helpers import FAST, leftover_processes, logged_at, metrics, popen, sweep, table

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def ended(run_dir) -> float:
    return json.loads((run_dir / "sweep_job.json").read_text())["ended"]


def test_two_jobs_share_the_cluster_and_a_third_waits_for_their_bundles(tmp_path):
    """Three jobs at once on a cluster of 4 CPUs, each placement group 2 bundles of 1 CPU: two run side by
    side, and the third's group is placed only when one of them is done."""
    d = tmp_path / "sweep"
    out = sweep(d, "seed=1,2,3", "trainer.num_rollout=3", "eval.interval=0", "sweep.max_concurrent=3",
                "sweep.num_cpus=4", *FAST, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (out.stdout + out.stderr).count("one Ray cluster for every job") == 1
    assert [r["status"] for r in table(d)] == ["ok", "ok", "ok"]
    jobs = sorted((p for p in d.iterdir() if p.is_dir()), key=lambda p: logged_at(p, "weights v0 pushed"))
    placed = [logged_at(p, "weights v0 pushed") for p in jobs]  # after the job's placement group was ready
    last_eval = [logged_at(p, "step 3: eval") for p in jobs]  # before the job gives its bundles back
    for p in jobs:
        assert "joined the Ray cluster at" in (p / "run.log").read_text()
    assert placed[1] < last_eval[0], "the first two jobs did not run side by side"
    assert placed[2] > min(last_eval[0], last_eval[1]), "the third job ran while both others held their bundles"
    assert not leftover_processes(), leftover_processes()


def test_a_killed_sweep_leaves_nothing_and_resumes(tmp_path):
    """SIGKILL of the sweep's process while a job runs: nothing of it is left running. The same command
    with sweep.resume=true skips the job that had finished and resumes the other from its checkpoint."""
    d = tmp_path / "sweep"
    args = ["trainer.num_rollout=2,12", "trainer.save_interval=2", "eval.interval=0", "sweep.max_concurrent=2", *FAST]
    proc = popen(d, *args)
    deadline = time.monotonic() + 600
    short, long_ = d / "0_eval.before_train=False,eval.interval=0,trainer.num_rollout=2,trainer.save_interval=2", \
        d / "1_eval.before_train=False,eval.interval=0,trainer.num_rollout=12,trainer.save_interval=2"
    while time.monotonic() < deadline:
        latest = long_ / "checkpoints" / "latest"
        done = (short / "sweep_job.json").exists() and json.loads((short / "sweep_job.json").read_text())["status"]
        if done == "ok" and latest.exists() and latest.read_text().strip() >= "step_000004":
            break
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    else:
        pytest.fail("the sweep did not reach a checkpoint of step 4")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(5)  # the watchdog notices within a second; its kills take a moment
    assert not leftover_processes(), leftover_processes()
    assert {r["status"] for r in table(d)} <= {"ok", "running"}  # as last written while it ran
    from slime_hydra.sweep.report import collect

    assert [r["status"] for r in collect(str(d))] == ["ok", "interrupted"]
    short_ended = ended(short)

    out = sweep(d, *args, "sweep.resume=true", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ended(short) == short_ended  # not run again
    assert "resumed from" in (long_ / "run.log").read_text()
    assert [r["step"] for r in metrics(long_)] == list(range(1, 13))  # no step lost or repeated
    assert [r["status"] for r in table(d)] == ["ok", "ok"]
    assert not leftover_processes(), leftover_processes()


def test_an_optuna_study_continues(tmp_path):
    d = tmp_path / "search"
    args = ["hparams_search=grpo_digits", "trainer.num_rollout=2", "eval.interval=0", "sweep.max_concurrent=2",
            "hydra.sweeper.optuna.pruner=null", *FAST]
    out = sweep(d, *args, "hydra.sweeper.optuna.n_trials=2", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    out = sweep(d, *args, "hydra.sweeper.optuna.n_trials=3", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 trial(s) done, 1 to go" in out.stdout + out.stderr
    import optuna

    study = optuna.load_study(study_name="grpo_digits", storage=f"sqlite:///{d}/optuna.db")
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    rows = table(d)
    assert [r["job"] for r in rows] == ["0", "1", "2"] and {r["status"] for r in rows} == {"ok"}
    for t, r in zip(study.trials, rows):
        assert t.value == pytest.approx(float(r["final_reward"]), abs=1e-4)
    assert (d / "optimization_results.yaml").exists()


def test_a_pruned_trial_stops_early_and_the_next_one_gets_its_bundles(tmp_path):
    """A pruner that stops every trial at its first eval after step 2; the cluster fits one trial at a time,
    so the second trial's placement group waits for the first trial's, and gets it when that is pruned."""
    d = tmp_path / "search"
    out = sweep(d, "hparams_search=grpo_digits", "hydra.sweeper.optuna.n_trials=2", "trainer.num_rollout=30",
                "eval.interval=2", "sweep.max_concurrent=2", "sweep.num_cpus=2", "~hydra.sweeper.optuna.pruner",
                "+hydra.sweeper.optuna.pruner={_target_:optuna.pruners.ThresholdPruner,lower:2.0,n_warmup_steps:1}",
                *FAST, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = table(d)
    assert [r["status"] for r in rows] == ["pruned", "pruned"]
    assert [r["steps"] for r in rows] == ["2", "2"]  # of 30
    assert all("pruned at step 2 by ThresholdPruner" in r["error"] for r in rows)
    jobs = sorted((p for p in d.iterdir() if p.is_dir()), key=lambda p: logged_at(p, "weights v0 pushed"))
    assert logged_at(jobs[1], "weights v0 pushed") > logged_at(jobs[0], "step 2: eval")
    import optuna

    study = optuna.load_study(study_name="grpo_digits", storage=f"sqlite:///{d}/optuna.db")
    assert [t.state.name for t in study.trials] == ["PRUNED", "PRUNED"]
    assert not leftover_processes(), leftover_processes()


def test_ctrl_c_of_a_sweep_leaves_its_report_interrupted_and_says_how_to_resume(tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while a job runs: the report
    said `running` (written while the job was alive), and run.py gave a single run's advice."""
    import os
    import subprocess
    import sys

    from sweep_helpers import ENV, ROOT

    d = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "run.py", "-m", "trainer.num_rollout=200", "eval.interval=0", "seed=1",
                             *FAST, f"hydra.sweep.dir={d}"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    job = d / "0_eval.before_train=False,eval.interval=0,seed=1,trainer.num_rollout=200"
    deadline = time.monotonic() + 300
    while not (job / "metrics.jsonl").exists() or "| running |" not in (d / "sweep.md").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out[-3000:]
    assert f"interrupted: the sweep stopped (go on with the same command and sweep.resume=true " \
           f"hydra.sweep.dir={d})" in out, out[-3000:]
    assert "trainer.resume=auto" not in out.splitlines()[-1]
    md = (d / "sweep.md").read_text()
    assert "1 jobs: 1 interrupted" in md and "| running |" not in md, md
    assert table(d)[0]["status"] == "interrupted"
    time.sleep(2)
    assert not leftover_processes(), leftover_processes()


def test_hydras_basic_launcher_gets_a_report_and_a_resume_that_skips_finished_jobs(tmp_path):
    """Under a launcher of Hydra's (basic here; submitit for Slurm), the jobs' statuses come from the callback
    in conf/config.yaml: the report lists them, and sweep.resume=true runs none of the finished ones again."""
    d = tmp_path / "sweep"
    args = ("hydra/launcher=basic", "seed=1,2", "trainer.num_rollout=1", "eval.interval=0", *FAST)
    out = sweep(d, *args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r["status"] for r in table(d)] == ["ok", "ok"]
    assert "2 jobs: 2 ok" in (d / "sweep.md").read_text()
    again = sweep(d, *args, "sweep.resume=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (again.stdout + again.stderr).count("ended ok; not run again") == 2
    assert not leftover_processes(), leftover_processes()
