"""The trackers of ``logging.backends`` read back with their own readers: TensorBoard's event accumulator and
MLflow's client; a tracker that cannot start is refused at validation, naming the key."""

from __future__ import annotations

import json
import os

import pytest

from conftest import resolved

ROWS = [{"rollout/reward_mean": 0.1 * s, "train/loss": 1.0 / s, "eval/digits/reward": 0.2 * s} for s in (1, 2, 3)]


def logged_run(tmp_path, backends, extra=()):
    from slime_hydra.logging.metrics import RunLogger

    cfg = resolved([f"logging.backends=[{','.join(backends)}]", "logging.progress=false", *extra])
    cfg.output_dir = str(tmp_path)
    (tmp_path / "config.yaml").write_text("seed: 1\n")
    logger = RunLogger(cfg, total_steps=3)
    for step, row in enumerate(ROWS, 1):
        logger.log(step, {**row, "train/nan": float("nan")})
    logger.finish({"eval_reward_final": 0.6, "steps": 3})
    return cfg


def test_tensorboard_event_files_hold_every_scalar(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged_run(tmp_path, ["tensorboard"])
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"rollout/reward_mean", "train/loss", "eval/digits/reward", "summary/eval_reward_final"} <= set(
        acc.Tags()["scalars"])
    assert "train/nan" not in acc.Tags()["scalars"]  # not a number: left out
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("rollout/reward_mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]


def test_mlflow_run_has_params_metrics_and_artifacts_and_resumes(tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = logged_run(tmp_path, ["mlflow"])
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run((tmp_path / "mlflow_run_id").read_text())
    assert run.info.status == "FINISHED" and run.info.run_name == cfg.run_name
    assert run.data.params["algo.lr"] == str(cfg.algo.lr) and run.data.params["seed"] == str(cfg.seed)
    history = client.get_metric_history(run.info.run_id, "rollout/reward_mean")
    assert [(m.step, round(m.value, 4)) for m in history] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert run.data.tags["summary.eval_reward_final"] == "0.6"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"config.yaml", "summary.json",
                                                                        "reward_curve.png"}
    assert (tmp_path / "mlartifacts").is_dir()  # beside the store, not in the working directory
    summary = client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path / "dl"))
    assert json.load(open(summary))["eval_reward_final"] == 0.6

    logged_run(tmp_path, ["mlflow"], extra=["trainer.resume=auto"])  # a resumed run continues its MLflow run
    assert (tmp_path / "mlflow_run_id").read_text() == run.info.run_id
    assert len(client.search_runs([client.get_experiment_by_name("slime_hydra").experiment_id])) == 1


def test_a_sweep_parent_run_and_its_children(tmp_path):
    from mlflow.tracking import MlflowClient
    from omegaconf import OmegaConf

    from slime_hydra.logging.trackers import end_mlflow_run, mlflow_sweep_parent

    sweep = tmp_path / "sweep"
    config = OmegaConf.create({"logging": {"backends": ["mlflow"], "mlflow_uri": None,
                                           "mlflow_experiment": "slime_hydra"}})
    uri, parent = mlflow_sweep_parent(config, str(sweep))
    assert uri == f"sqlite:///{sweep}/mlflow.db"
    assert mlflow_sweep_parent(config, str(sweep)) == (uri, parent)  # a resumed sweep keeps its run
    for job in ("0", "1"):
        (sweep / job).mkdir()
        logged_run(sweep / job, ["mlflow"], extra=[f"logging.mlflow_uri={uri}", f"logging.mlflow_parent={parent}"])
    end_mlflow_run(uri, parent, failed=False)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("slime_hydra").experiment_id
    children = client.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)
    assert client.get_run(parent).info.status == "FINISHED"


@pytest.mark.parametrize("overrides, problem", [
    (["logging.backends=[neptune]"], "logging.backends[0]: unknown tracker 'neptune'"),
    (["logging.backends=[mlflow]", "logging.mlflow_uri=nonsense://host/x"],
     "logging.mlflow_uri=nonsense://host/x: MLflow (logging.backends) cannot log there"),
    (["logging.backends=[mlflow]", "logging.mlflow_uri=file:///tmp/mlruns"],
     "logging.mlflow_uri=file:///tmp/mlruns: MLflow (logging.backends) cannot log there: MLflow refuses a file store"),
    (["logging.backends=[mlflow]", "logging.mlflow_uri=http://127.0.0.1:9"],
     "logging.mlflow_uri=http://127.0.0.1:9: MLflow (logging.backends) cannot log there: no MLflow server"),
    (["logging.backends=[wandb,tensorboard,mlflow]"], None),
])
def test_a_tracker_that_cannot_start_is_refused_naming_the_key(overrides, problem):
    from slime_hydra.logging import rules

    errs = rules.check(resolved(overrides))
    assert (errs == []) if problem is None else any(e.startswith(problem) for e in errs), errs


def test_a_missing_tracker_package_names_the_extra(monkeypatch):
    from slime_hydra.logging import rules, trackers

    monkeypatch.setitem(trackers.PACKAGES, "tensorboard", ("no_such_tensorboard_module", "tensorboard"))
    errs = rules.check(resolved(["logging.backends=[tensorboard]"]))
    assert errs == ["logging.backends[0]: tensorboard needs the no_such_tensorboard_module package, which is not "
                    "installed: pip install 'slime_hydra[tensorboard]' (or leave tensorboard out of "
                    "logging.backends)"]


def test_mlflow_tracking_uri_from_the_environment(monkeypatch, tmp_path):
    from slime_hydra.logging.trackers import mlflow_uri

    cfg = resolved(["logging.backends=[mlflow]"])
    assert mlflow_uri(cfg, str(tmp_path)) == (f"sqlite:///{tmp_path}/mlflow.db", f"{tmp_path}/mlartifacts")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    assert mlflow_uri(cfg, str(tmp_path)) == ("http://127.0.0.1:9", None)
    from slime_hydra.logging import rules

    assert any(e.startswith("MLFLOW_TRACKING_URI=http://127.0.0.1:9: ") for e in rules.check(cfg))
    assert os.environ["MLFLOW_TRACKING_URI"]  # left to the run
