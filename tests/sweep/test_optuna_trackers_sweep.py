"""An Optuna 5 search end to end: trials pruned, the study resumed by the same command, every job in TensorBoard
(a folder each under the sweep directory) and in MLflow (children of the sweep's run), the study read through
optuna-dashboard's HTTP API, and the runs listed and compared from the shell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from sweep_helpers import ENV, FAST, ROOT, leftover_processes, sweep, table

pytestmark = pytest.mark.integration


def dashboard_study(db: str) -> dict:
    """optuna-dashboard started on ``db``: its one study's trials, through its HTTP API; then stopped."""
    from slime_hydra.utils.proc import free_port

    port = free_port()
    cli = os.path.join(os.path.dirname(sys.executable), "optuna-dashboard")  # its console script (no __main__)
    server = subprocess.Popen([cli, f"sqlite:///{db}", "--port", str(port), "--host", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as r:
                    studies = json.load(r)["study_summaries"]
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise
                time.sleep(1)
        (study,) = studies
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies/{study['study_id']}", timeout=30) as r:
            return {"name": study["study_name"], **json.load(r)}
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_pruned_search_resumes_and_every_job_is_tracked(tmp_path):
    import optuna
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d = tmp_path / "search"
    args = ["hparams_search=grpo_digits", "trainer.num_rollout=4", "eval.interval=2", "sweep.max_concurrent=1",
            "logging.backends=[tensorboard,mlflow]", "logging.plot=true", *FAST]
    # every trial is pruned at its eval of step 2 (a threshold no reward reaches)
    out = sweep(d, *args, "hydra.sweeper.optuna.n_trials=2",
                "~hydra.sweeper.optuna.pruner",
                "+hydra.sweeper.optuna.pruner={_target_:optuna.pruners.ThresholdPruner,lower:2.0,n_warmup_steps:1}",
                timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    out = sweep(d, *args, "hydra.sweeper.optuna.n_trials=3", "hydra.sweeper.optuna.pruner=null", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 trial(s) done, 1 to go" in out.stdout + out.stderr
    study = optuna.load_study(study_name="grpo_digits", storage=f"sqlite:///{d}/optuna.db")
    assert study.trials[2].params != study.trials[0].params  # the resumed sampler does not repeat a trial
    study = optuna.load_study(study_name="grpo_digits", storage=f"sqlite:///{d}/optuna.db")
    assert [t.state.name for t in study.trials] == ["PRUNED", "PRUNED", "COMPLETE"]
    assert [sorted(t.intermediate_values) for t in study.trials] == [[2], [2], []]  # reported to the pruner
    rows = table(d)
    assert [r["status"] for r in rows] == ["pruned", "pruned", "ok"]
    jobs = [d / r["run_dir"] for r in rows]

    for job, steps in zip(jobs, ([1, 2], [1, 2], [1, 2, 3, 4])):  # one TensorBoard folder per job
        acc = EventAccumulator(str(job / "tensorboard"))
        acc.Reload()
        assert [e.step for e in acc.Scalars("rollout/reward_mean")] == steps

    client = MlflowClient(tracking_uri=f"sqlite:///{d}/mlflow.db")
    parent = (d / "mlflow_run_id").read_text()
    exp = client.get_experiment_by_name("slime_hydra").experiment_id
    children = client.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    assert len(children) == 3 and client.get_run(parent).info.status == "FINISHED"
    done = client.get_run((jobs[2] / "mlflow_run_id").read_text())
    assert done.data.tags["mlflow.parentRunId"] == parent and done.info.status == "FINISHED"
    assert float(done.data.params["algo.lr"]) == pytest.approx(study.trials[2].params["algo.lr"])
    assert len(client.get_metric_history(done.info.run_id, "rollout/reward_mean")) == 4
    assert {a.path for a in client.list_artifacts(done.info.run_id)} >= {"config.yaml", "summary.json",
                                                                         "reward_curve.png"}

    shown = dashboard_study(str(d / "optuna.db"))
    assert shown["name"] == "grpo_digits"
    assert [t["state"] for t in shown["trials"]] == ["Pruned", "Pruned", "Complete"]

    listed = subprocess.run([sys.executable, "-m", "slime_hydra.runs", "list", str(d)], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[1].startswith("date\tname\tstatus") and "3 jobs: 1 ok, 2 pruned" in lines[2]
    assert [line.split("\t")[2] for line in lines[3:]] == ["pruned", "pruned", "ok"]
    png = tmp_path / "compare.png"
    compared = subprocess.run([sys.executable, "-m", "slime_hydra.runs", "compare", str(jobs[0]), str(jobs[2]),
                               "--png", str(png)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert compared.returncode == 0, compared.stderr
    assert "\nalgo.lr\t" in compared.stdout and png.stat().st_size > 0
    assert not leftover_processes(), leftover_processes()
