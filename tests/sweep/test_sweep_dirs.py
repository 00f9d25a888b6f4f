"""Job directories: one folder per job whatever its override values (a path's ``/`` does not nest it),
and the report, the resume and the watchdog's reaping finding every job directory, also nested ones (a
sweep written before that, or a ``hydra.sweep.subdir`` of the user's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from sweep_helpers import ROOT


def subdir(*overrides: str) -> str:
    """``hydra.sweep.subdir`` of job 3 with these overrides, as the sweep composes it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    from slime_hydra.config.store import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.job.num = 3
    return str(cfg.hydra.sweep.subdir)


def test_a_path_value_does_not_nest_the_job_directory():
    name = subdir("data=jsonl", "data.path=../../data/train.jsonl", "algo.lr=1e-3")
    assert name == "3_algo.lr=1e-3,data.path=..%2F..%2Fdata%2Ftrain.jsonl,data=jsonl"
    assert os.path.dirname(os.path.join("/sweep", name)) == "/sweep"  # one folder, inside the sweep's
    # the sweep-wide switches stay out of it: a resumed sweep computes the same directory
    assert subdir("data=jsonl", "data.path=../../data/train.jsonl", "algo.lr=1e-3", "sweep.resume=true",
                  "trainer.resume=auto") == name
    assert subdir("algo.lr=1e-3") == "3_algo.lr=1e-3"  # names without a `/` as before


def test_safe_dirname_cuts_a_long_name_and_keeps_names_apart():
    from slime_hydra.sweep.jobs import DIRNAME_MAX, safe_dirname

    assert safe_dirname("") == "" and safe_dirname("a=1,b=x/y") == "a=1,b=x%2Fy"
    long_a, long_b = "data.path=/" + "é" * 300 + "a", "data.path=/" + "é" * 300 + "b"
    a, b = safe_dirname(long_a), safe_dirname(long_b)
    assert a != b and "/" not in a
    assert len(a.encode()) <= DIRNAME_MAX and a.startswith("data.path=%2Féé")
    a.encode().decode()  # not cut inside a character


def write_job(job_dir, num: int, status: str = "ok") -> str:
    from slime_hydra.sweep.jobs import write_status

    write_status(str(job_dir), num, [f"seed={num}"], status, started=time.time())
    return str(job_dir)


def test_job_dirs_at_any_depth_but_not_inside_a_job_or_a_run(tmp_path):
    from slime_hydra.sweep.jobs import job_dirs

    d = tmp_path / "sweep"
    flat = write_job(d / "0_seed=0", 0)
    nested = write_job(d / "1_data.path=data" / "train.jsonl,seed=1", 1)  # a sweep before safe_dirname
    deeper = write_job(d / "2_data.path=" / "abs" / "data" / "x.jsonl,seed=2", 2, "failed")
    write_job(d / "0_seed=0" / "checkpoints" / "step_1", 7)  # inside a job: not a job of this sweep
    write_job(d / ".hidden" / "job", 8)
    (d / "outputs" / "run" / ".hydra").mkdir(parents=True)  # another run's directory: not searched
    write_job(d / "outputs" / "run" / "inner", 9)
    (d / "empty").mkdir()
    assert job_dirs(str(d)) == [flat, nested, deeper]
    assert job_dirs(str(tmp_path / "missing")) == []


def test_the_report_of_a_sweep_with_nested_job_directories(tmp_path, capsys):
    from slime_hydra.sweep.__main__ import main
    from slime_hydra.sweep.report import collect, status_line

    d = tmp_path / "sweep"
    write_job(d / "0_data.path=tests" / "fixtures" / "tiny.jsonl", 0, "failed")
    job = write_job(d / "1_data.path=tests" / "fixtures" / "tiny.jsonl", 1)
    with open(os.path.join(job, "metrics.jsonl"), "w") as f:
        for step in (1, 2):
            f.write(json.dumps({"step": step, "perf/step_time": 1.0, "eval/heldout/reward": 0.25 * step}) + "\n")
    rows = collect(str(d))
    assert [(r["job"], r["status"], r["final_reward"]) for r in rows] == [(0, "failed", None), (1, "ok", 0.5)]
    assert status_line(rows[1]) == "[sweep] job 1 | ok | step 2 | eval 0.500 | 1.00 s/step | seed=1"
    assert main(["report", str(d)]) == 0
    md = (d / "sweep.md").read_text()
    assert "2 jobs: 1 failed, 1 ok" in md and "Best: job 1 (seed=1), eval_reward_final 0.5" in md
    assert "2 jobs: 1 failed, 1 ok" in capsys.readouterr().out


def test_the_watchdog_reaps_the_processes_of_a_nested_job(tmp_path):
    """reap_sweep finds each job's driver.json by its job directory, at any depth."""
    from slime_hydra.launch.lease import LEASE_FILE, TOKEN_ENV
    from slime_hydra.sweep.cluster import reap_sweep

    d = tmp_path / "sweep"
    job = write_job(d / "0_data.path=a" / "b.jsonl", 0, "running")
    token = f"test-{os.getpid()}-{time.time_ns()}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            env={**os.environ, TOKEN_ENV: token})
    try:
        with open(os.path.join(job, LEASE_FILE), "w") as f:
            json.dump({"token": token, "ray_session_dir": None}, f)
        assert reap_sweep(str(d), None, None) == 1
        assert proc.wait(timeout=10) == -9
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_report_reads_the_sweeps_own_jobs_from_its_manifest(tmp_path):
    """A hydra.sweep.dir reused by another sweep: the report (and so the best job and the summary) holds
    this sweep's jobs only, those its manifest lists; without a manifest (an earlier version's sweep), all."""
    from slime_hydra.sweep.jobs import read_manifest, write_manifest
    from slime_hydra.sweep.report import collect

    d = tmp_path / "sweep"
    old = write_job(d / "0_seed=7", 0)  # another sweep's
    assert [r["run_dir"] for r in collect(str(d))] == [old]
    a, b = write_job(d / "0_seed=1", 0), write_job(d / "1_seed=2", 1)
    write_manifest(str(d), [a, b], append=False)
    assert [r["run_dir"] for r in collect(str(d))] == [a, b]
    c = write_job(d / "2_seed=3", 2)
    write_manifest(str(d), [c, a], append=True)  # a resumed sweep, a continued study: after the others, once
    assert read_manifest(str(d)) == [a, b, c]
    assert [r["run_dir"] for r in collect(str(d))] == [a, b, c]
    assert json.loads((d / "sweep_jobs.json").read_text()) == {"jobs": ["0_seed=1", "1_seed=2", "2_seed=3"]}


def test_a_new_sweep_in_a_directory_with_another_sweeps_jobs_is_refused(tmp_path):
    from sweep_helpers import sweep

    d = tmp_path / "sweep"
    write_job(d / "0_seed=7", 0)
    out = sweep(d, "seed=1,2", "dry_run=true")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"hydra.sweep.dir={d} already holds 1 job(s) of another sweep (0_seed=7), and this sweep is a new one: " \
           "use a new hydra.sweep.dir, or sweep.resume=true" in out.stderr, out.stderr
    out = sweep(d, "seed=1,2", "dry_run=true", "sweep.resume=true")  # continuing it: allowed
    assert out.returncode == 0, out.stderr[-2000:]
    out = sweep(d, "seed=7", "dry_run=true")  # the same jobs again: allowed
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_sweep_over_experiments_names_each_job_by_its_experiment(tmp_path):
    """experiment= was left out of the job names: the jobs of `-m experiment=a,b` differed by their number
    only, and a resume with the list reordered took one's directory for the other's."""
    a, b = subdir("experiment=calculator_agent", "seed=1"), subdir("experiment=qwen3_4b_grpo_math", "seed=1")
    assert a == "3_experiment=calculator_agent,seed=1" and b == "3_experiment=qwen3_4b_grpo_math,seed=1"
    from sweep_helpers import sweep

    out = sweep(tmp_path / "s", "experiment=calculator_agent", "seed=1,2", "dry_run=true")
    assert out.returncode == 0, out.stderr[-2000:]
    assert [line.split(":")[0] for line in out.stdout.splitlines() if line.startswith("job ")] == [
        "job 0 [experiment=calculator_agent seed=1]", "job 1 [experiment=calculator_agent seed=2]"]
    out = sweep(tmp_path / "s", "hparams_search=grpo_digits", "dry_run=true")  # a search's name: the same for all
    assert "job 0 [algo.lr=0.001 algo.kl_loss_coef=0.0]" in out.stdout, out.stderr[-2000:]


def test_the_best_job_is_the_best_by_the_sweeps_objective_and_direction(tmp_path):
    """best_job maximised the final held-out reward whatever sweep.optimized_metric and the search's
    direction: the objective is its own column, and the best job is chosen by it."""
    from slime_hydra.sweep.report import collect, write_report

    d = tmp_path / "sweep"
    for num, (loss, reward) in enumerate([(0.3, 0.9), (0.1, 0.2), (0.2, 0.5)]):
        job = write_job(d / f"{num}_seed={num}", num)
        with open(os.path.join(job, "summary.json"), "w") as f:
            json.dump({"train_loss_last": loss, "eval_reward_final": reward}, f)
        with open(os.path.join(job, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 1, "perf/step_time": 1.0, "eval/heldout/reward": reward}) + "\n")
    (d / "multirun.yaml").write_text("sweep:\n  optimized_metric: train_loss_last\n"
                                     "hydra:\n  sweeper:\n    optuna:\n      direction: minimize\n")
    write_report(str(d))
    assert [r["objective"] for r in collect(str(d))] == [0.3, 0.1, 0.2]
    md = (d / "sweep.md").read_text()
    assert "objective: train_loss_last (sweep.optimized_metric), minimized" in md
    assert "Best: job 1 (seed=1), train_loss_last 0.1" in md
    (d / "multirun.yaml").write_text("sweep:\n  optimized_metric: train_loss_last\n")  # a grid sweep: maximized
    write_report(str(d))
    assert "Best: job 0 (seed=0), train_loss_last 0.3" in (d / "sweep.md").read_text()


def test_a_new_search_in_a_directory_with_another_sweeps_jobs_is_refused_before_writing(tmp_path):
    """As a grid sweep: refused (exit 2), and before anything is written over the other sweep's files."""
    from sweep_helpers import sweep

    d = tmp_path / "sweep"
    write_job(d / "0_seed=7", 0)
    (d / "multirun.yaml").write_text("the other sweep's\n")
    out = sweep(d, "hparams_search=grpo_digits", "dry_run=true")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "already holds 1 job(s) of another sweep (0_seed=7)" in out.stderr
    assert (d / "multirun.yaml").read_text() == "the other sweep's\n"
    assert sorted(p.name for p in d.iterdir()) == ["0_seed=7", "multirun.yaml"]
