"""Sweeps (``python run.py -m``): whole-sweep validation and dry runs, the Optuna preset and the Slurm
launcher composing, and one short real sweep (two jobs side by side, one failing) with its report."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from sweep_helpers import ENV, FAST, ROOT, leftover_processes, metrics, sweep, table


def test_a_bad_value_refuses_the_whole_sweep_before_anything_is_written(tmp_path):
    d = tmp_path / "sweep"
    out = sweep(d, "algo.lr=1e-3,-1,3e-3", "rollout.temperature=0.8,-2")
    assert out.returncode == 1, out.stdout + out.stderr
    err = out.stderr
    assert "4 of 6 sweep jobs are invalid:" in err  # every invalid job, with its overrides and problems
    for job in ("job 1 [algo.lr=0.001 rollout.temperature=-2]", "job 2 [algo.lr=-1 rollout.temperature=0.8]",
                "job 3 [algo.lr=-1 rollout.temperature=-2]", "job 5 [algo.lr=0.003 rollout.temperature=-2]"):
        assert job in err
    assert "job 0 " not in err and "job 4 " not in err
    assert "algo.lr: must be > 0, got -1.0" in err and "rollout.temperature: must be > 0" in err
    assert "sweep.skip_invalid=true" in err
    assert not d.exists()  # nothing started, nothing written


def test_dry_run_prints_each_valid_job_plan_in_one_line(tmp_path):
    d = tmp_path / "sweep"
    out = sweep(d, "dry_run=true", "algo.lr=1e-3,-1,3e-3", "sweep.skip_invalid=true")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("job ")]
    assert [line.split(":")[0] for line in lines] == ["job 0 [algo.lr=0.001]", "job 2 [algo.lr=0.003]"]
    assert all("cpu, 2 bundles of {'CPU': 1.0}, 1 trainer(s) (dp 1), 1 embedded engine(s), split, 150 steps" in line
               for line in lines)
    assert "1 of 3 sweep jobs are invalid" in out.stdout
    assert "2 job(s) valid (dry_run=true: nothing started)" in out.stdout
    assert not d.exists()


def test_the_search_preset_validates_the_corners_of_its_space(tmp_path):
    out = sweep(tmp_path / "s", "hparams_search=grpo_digits", "dry_run=true", "rollout.temperature=interval(-1.0,1.0)")
    assert out.returncode == 1
    assert "3 of 4 sweep jobs are invalid" in out.stderr  # the space's low temperature, with each other corner
    assert "rollout.temperature=-1.0]" in out.stderr and "rollout.temperature: must be > 0" in out.stderr
    out = sweep(tmp_path / "s", "hparams_search=grpo_digits", "dry_run=true")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("job ")]
    assert [line.split(":")[0] for line in lines] == [  # all low; each parameter at its high
        "job 0 [algo.lr=0.001 algo.kl_loss_coef=0.0]", "job 1 [algo.lr=0.01 algo.kl_loss_coef=0.0]",
        "job 2 [algo.lr=0.001 algo.kl_loss_coef=0.1]"]


def test_slurm_launcher_composes():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import get_class

    from slime_hydra.config.store import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "parallelism=colocate_8gpu", "model=qwen3_4b"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    get_class(launcher._target_)
    assert launcher.gpus_per_node == 8 and launcher.nodes == 1 and launcher.tasks_per_node == 1
    assert launcher.submitit_folder.endswith(".submitit/%j")


def test_optimized_metric_is_a_summary_value():
    from slime_hydra.launch.loop import summarize
    from slime_hydra.launch.rules import SUMMARY_METRICS

    assert set(SUMMARY_METRICS) <= set(summarize([], 0, 0.0, "x"))
    from conftest import resolved
    from slime_hydra.launch.validate import validate

    problems = validate(resolved(["sweep.optimized_metric=reward", "sweep.max_concurrent=0"]))
    assert any(p.startswith("sweep.optimized_metric: 'reward' is not one of") for p in problems)
    assert "sweep.max_concurrent: must be >= 1, got 0" in problems


@pytest.mark.integration
def test_two_jobs_side_by_side_one_failing_and_the_report(tmp_path):
    """A real sweep: two jobs at once on one Ray cluster, one of them failing at its first rollout. The
    good one ends ok, the sweep exits 1 naming the failed one, and the report says exactly that."""
    d = tmp_path / "sweep"
    t0 = time.time()
    out = sweep(d, "reward.type=exact,custom", "reward.custom=tests.sweep.sweep_rewards.broken",
                "trainer.num_rollout=2", "eval.interval=0", "sweep.max_concurrent=2", *FAST)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[sweep] 1 job(s) failed: job 1 [reward.type=custom reward.custom=tests.sweep.sweep_rewards.broken " \
           "trainer.num_rollout=2 eval.interval=0 eval.before_train=False]" in out.stderr
    assert (out.stdout + out.stderr).count("one Ray cluster for every job") == 1
    # the console: status lines per job, not the jobs' own logs
    assert "[sweep] job 0 | ok | step 2 | eval " in out.stdout and "[sweep] job 1 | failed | step 0 |" in out.stdout
    assert "weights v0 pushed" not in out.stdout + out.stderr
    rows = table(d)
    jobs = sorted(p for p in d.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == [
        "0_eval.before_train=False,eval.interval=0,reward.custom=tests.sweep.sweep_rewards.broken,reward.type=exact,"
        "trainer.num_rollout=2",
        "1_eval.before_train=False,eval.interval=0,reward.custom=tests.sweep.sweep_rewards.broken,reward.type=custom,"
        "trainer.num_rollout=2"]
    import json

    summary = json.loads((jobs[0] / "summary.json").read_text())
    m = metrics(jobs[0])
    step_s = [r["perf/step_time"] for r in m if "perf/step_time" in r]
    assert rows[0] == {
        "job": "0",
        "overrides": "reward.type=exact reward.custom=tests.sweep.sweep_rewards.broken trainer.num_rollout=2 "
                     "eval.interval=0 eval.before_train=False",
        "status": "ok", "objective": str(round(summary["eval_reward_final"], 4)),
        "final_reward": str(round(summary["eval_reward_final"], 4)),
        "best_reward": str(round(summary["eval_reward_final"], 4)), "best_step": "2", "steps": "2",
        "s_per_step": str(round(sum(step_s) / len(step_s), 4)), "run_dir": str(jobs[0]), "error": ""}
    assert rows[1]["job"] == "1" and rows[1]["status"] == "failed" and rows[1]["steps"] == "0"
    assert rows[1]["final_reward"] == rows[1]["best_reward"] == rows[1]["s_per_step"] == ""
    assert rows[1]["run_dir"] == str(jobs[1]) and "this reward is broken on purpose" in rows[1]["error"]
    md = (d / "sweep.md").read_text()
    assert "2 jobs: 1 failed, 1 ok" in md
    assert f"Best: job 0 ({rows[0]['overrides']}), eval_reward_final {rows[0]['final_reward']}" in md
    assert (d / "sweep_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # both jobs joined the sweep's cluster; the runs share a wandb group, each named by its overrides
    for job in jobs:
        assert "joined the Ray cluster at" in (job / "run.log").read_text()
        cfg = (job / "config.yaml").read_text()
        assert f"wandb_group: {tmp_path.name}_sweep" in cfg
    assert "run_name: reward.type=exact reward.custom=" in (jobs[0] / "config.yaml").read_text()
    # the report rebuilds from the run directories alone, identically
    csv_before, md_before = (d / "sweep.csv").read_text(), md
    (d / "sweep.csv").unlink()
    rebuilt = subprocess.run([sys.executable, "-m", "slime_hydra.sweep", "report", str(d)], cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=120)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert (d / "sweep.csv").read_text() == csv_before and (d / "sweep.md").read_text() == md_before
    time.sleep(1)
    assert not leftover_processes(), leftover_processes()
    print(f"sweep of 2 jobs: {time.time() - t0:.0f}s")


def test_a_running_job_whose_process_is_gone_reads_interrupted(tmp_path):
    """The report tells a job still running from one whose sweep was killed, by the job's process."""
    from slime_hydra.sweep.jobs import read_status, write_status

    write_status(str(tmp_path / "alive"), 0, ["seed=1"], "running", started=time.time())
    assert read_status(str(tmp_path / "alive"))["status"] == "running"  # this process
    code = ("import sys, time; from slime_hydra.sweep.jobs import write_status; "
            "write_status(sys.argv[1], 1, ['seed=2'], 'running', started=time.time())")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "gone")], check=True, env=ENV, cwd=ROOT)
    state = read_status(str(tmp_path / "gone"))
    assert state["status"] == "interrupted" and state["overrides"] == ["seed=2"] and state["num"] == 1


def test_resume_of_a_directory_without_a_sweep_is_refused(tmp_path):
    """sweep.resume=true on a new hydra.sweep.dir (the default one is timestamped) ran every job from
    scratch, silently; it is refused before anything starts, naming the directory."""
    d = tmp_path / "sweep"
    out = sweep(d, "seed=1,2", "trainer.num_rollout=1", "sweep.resume=true", "dry_run=true")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"sweep.resume=true: hydra.sweep.dir={d} holds no sweep" in out.stderr, out.stderr
    assert not d.exists()  # nothing started


def test_a_refused_resume_names_the_newest_sweep(tmp_path, monkeypatch, capsys):
    import os

    from omegaconf import OmegaConf

    from slime_hydra.sweep.flow import check_resumable

    for name, when in (("2024-01-01/10-00-00", 100), ("2024-01-02/09-00-00", 300), ("2024-01-01/23-00-00", 200)):
        (tmp_path / "multirun" / name).mkdir(parents=True)
        (tmp_path / "multirun" / name / "multirun.yaml").write_text("{}")
        os.utime(tmp_path / "multirun" / name / "multirun.yaml", (when, when))
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.create({"sweep": {"resume": True}, "hydra": {"sweep": {"dir": "multirun/2024-01-03/08-00-00"}}})
    with pytest.raises(SystemExit) as e:
        check_resumable(cfg)
    assert e.value.code == 2
    assert "the newest is hydra.sweep.dir=multirun/2024-01-02/09-00-00" in capsys.readouterr().err
    cfg.hydra.sweep.dir = "multirun/2024-01-01/10-00-00"  # a sweep's directory: resumed
    check_resumable(cfg)
    cfg.sweep.resume = False
    cfg.hydra.sweep.dir = "elsewhere"
    check_resumable(cfg)


def test_closing_the_launcher_on_an_interruption_rewrites_the_report(tmp_path):
    """The report last written while the jobs ran said `running`; once the launcher has killed them on a
    Ctrl-C, it is rewritten, and they read `interrupted`."""
    from omegaconf import OmegaConf

    from slime_hydra.sweep.launcher import SweepLauncher
    from slime_hydra.sweep.report import write_report

    job = tmp_path / "0_seed=1"
    code = ("import sys, time; from slime_hydra.sweep.jobs import write_status; "
            "write_status(sys.argv[1], 0, ['seed=1'], 'running', started=time.time()); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(job)], env=ENV, cwd=ROOT)
    try:
        while not (job / "sweep_job.json").exists():
            time.sleep(0.1)
        write_report(str(tmp_path))
        assert "1 jobs: 1 running" in (tmp_path / "sweep.md").read_text()
    finally:
        child.kill()
        child.wait()
    launcher = SweepLauncher(n_jobs=1)
    launcher.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        launcher.close()
    assert "1 jobs: 1 interrupted" in (tmp_path / "sweep.md").read_text()
    launcher.close()  # a close without an error in flight leaves the report alone


def _job_config(job_dir, mode, num=3):
    from omegaconf import OmegaConf

    return OmegaConf.create({"hydra": {
        "mode": mode, "runtime": {"output_dir": str(job_dir)}, "job": {"num": num, "config": {
            "override_dirname": {"exclude_keys": ["sweep.resume"]}}},
        "overrides": {"task": ["seed=1", "sweep.resume=true"]}}})


def test_other_launchers_get_each_jobs_status_from_the_callback(tmp_path, monkeypatch):
    from hydra.core.utils import JobReturn, JobStatus
    from hydra.types import RunMode

    from slime_hydra.sweep import jobs
    from slime_hydra.sweep.callback import SweepStatus

    def ended(status, value=None):
        ret = JobReturn(status=status)
        ret._return_value = value
        return ret

    d = tmp_path / "3_seed=1"
    cb, cfg = SweepStatus(), _job_config(d, RunMode.MULTIRUN)
    cb.on_job_start(cfg)
    state = jobs.read_status(str(d))
    assert state["status"] == "running" and state["num"] == 3 and state["overrides"] == ["seed=1"], state
    cb.on_job_end(cfg, ended(JobStatus.COMPLETED))
    assert jobs.read_status(str(d))["status"] == "ok"
    assert jobs.job_dirs(str(tmp_path)) == [str(d)]  # the report and sweep.resume find it
    for err, want in ((RuntimeError("boom"), "failed"), (jobs.JobPruned("at step 2"), "pruned"),
                      (KeyboardInterrupt(), "interrupted")):
        cb.on_job_end(cfg, ended(JobStatus.FAILED, err))
        assert jobs.read_status(str(d))["status"] == want

    # a job whose process exits in SystemExit (a refused config) never reaches on_job_end: failed at exit
    import atexit

    cb.on_job_start(cfg)
    atexit.unregister(cb.exited)  # called here, not at pytest's exit
    cb.exited(cfg)
    state = jobs.read_status(str(d))
    assert state["status"] == "failed" and "SystemExit" in state["error"], state

    # a single run writes nothing; nor does a job of the slime launcher, which writes the status itself
    single = tmp_path / "single"
    cb.on_job_start(_job_config(single, RunMode.RUN))
    monkeypatch.setattr(jobs, "LAUNCHER_WRITES_STATUS", True)
    slime = tmp_path / "slime"
    cb.on_job_start(_job_config(slime, RunMode.MULTIRUN))
    assert not single.exists() and not slime.exists()


def test_a_running_job_of_another_host_is_not_read_as_interrupted(tmp_path):
    import json

    from slime_hydra.sweep import jobs

    jobs.write_status(str(tmp_path), 0, ["seed=1"], "running")
    path = tmp_path / jobs.STATUS_FILE
    state = json.loads(path.read_text())
    state["pid"], state["pid_start"] = 2**22 + 7, 1  # no such process here
    path.write_text(json.dumps(state))
    assert jobs.read_status(str(tmp_path))["status"] == "interrupted"
    state["host"] = "another-node"  # a Slurm job on its own node: its process is not ours to look for
    path.write_text(json.dumps(state))
    assert jobs.read_status(str(tmp_path))["status"] == "running"


def test_a_resumed_job_with_its_own_trainer_resume_goes_on_from_its_own_checkpoint(tmp_path):
    """A fine-tuning sweep's jobs start from a base checkpoint (their own trainer.resume); resumed after they
    saved one of their own, they go on from it (the base's path would be refused in a run dir with checkpoints)."""
    from omegaconf import OmegaConf

    from slime_hydra.checkpoint.ckpt import save_checkpoint
    from slime_hydra.sweep.compose import Job
    from slime_hydra.sweep.flow import resume_plan

    dirs = [tmp_path / f"{i}_job" for i in range(3)]
    save_checkpoint(str(dirs[0]), 2, lambda d: None, {"epoch": 0}, keep=2)
    overrides = {0: ["seed=1", "trainer.resume=/base"], 1: ["seed=2", "trainer.resume=/base"], 2: ["seed=3"]}
    jobs = [Job(num=i, overrides=overrides[i], dir=str(d)) for i, d in enumerate(dirs)]
    plan = resume_plan(OmegaConf.create({"sweep": {"resume": True}}), jobs, overrides)
    assert plan == [(0, ["seed=1", "trainer.resume=auto"]), (1, ["seed=2", "trainer.resume=/base"]),
                    (2, ["seed=3", "trainer.resume=auto"])]
