"""Experiment trackers beside metrics.jsonl (``logging.backends``): wandb, TensorBoard, MLflow, each through its
library's own writer, imported only when named. A tracker takes every metrics row (``log``), and at the end the
summary and the run's files (``finish``); ``close`` ends it, also after an error."""

from __future__ import annotations

import importlib.util
import math
import os
import time
import urllib.request
import uuid
from typing import Any, Dict, List, Optional, Tuple

# backend -> (the module it needs, the extra that installs it)
PACKAGES = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow")}
ARTIFACTS = ("config.yaml", "summary.json", "reward_curve.png")  # what MLflow keeps of a finished run
MLFLOW_RUN_ID = "mlflow_run_id"  # a run (or sweep) directory's MLflow run, continued on resume


def _numbers(row: Dict[str, Any]) -> Dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _run_id_file(run_dir: str, name: str, resuming: bool) -> Optional[str]:
    """The id a resumed run's directory keeps in ``name`` (None: a new run)."""
    path = os.path.join(run_dir, name)
    if resuming and os.path.exists(path):
        with open(path) as f:
            return f.read().strip() or None
    return None


def _keep_id(run_dir: str, name: str, run_id: str) -> None:
    with open(os.path.join(run_dir, name), "w") as f:
        f.write(run_id)


class Wandb:
    """wandb offline without a WANDB_API_KEY (``logging.wandb_mode=auto``); a resumed run continues its wandb run."""

    def __init__(self, cfg: Any) -> None:
        import wandb

        from slime_hydra.logging.secrets import redacted_config

        mode = cfg.logging.wandb_mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        resuming = cfg.trainer.resume is not None
        run_id = _run_id_file(cfg.output_dir, "wandb_run_id", resuming)
        resume = "allow" if run_id else None
        if run_id is None:
            run_id = uuid.uuid4().hex[:8]  # wandb's own ids are 8 characters of [a-z0-9]
            _keep_id(cfg.output_dir, "wandb_run_id", run_id)
        self.run = wandb.init(project=cfg.logging.wandb_project, entity=cfg.logging.wandb_entity, name=cfg.run_name,
                              group=cfg.logging.wandb_group, dir=cfg.output_dir, mode=mode,
                              tags=list(cfg.logging.wandb_tags), config=redacted_config(cfg), id=run_id, resume=resume)

    def log(self, step: int, row: Dict[str, Any]) -> None:
        self.run.log(row, step=step)

    def finish(self, summary: Dict[str, Any], run_dir: str) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class TensorBoard:
    """Event files in ``<run dir>/tensorboard`` (a sweep's jobs: one folder each under the sweep directory, so
    ``tensorboard --logdir <sweep dir>`` overlays them)."""

    def __init__(self, cfg: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(cfg.output_dir, "tensorboard"))

    def log(self, step: int, row: Dict[str, Any]) -> None:
        for k, v in _numbers(row).items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def finish(self, summary: Dict[str, Any], run_dir: str) -> None:
        for k, v in _numbers(summary).items():
            self.writer.add_scalar(f"summary/{k}", v)

    def close(self, failed: bool) -> None:
        self.writer.close()


def mlflow_uri(cfg: Any, store_dir: str) -> Tuple[str, Optional[str]]:
    """(tracking URI, where a new experiment keeps its artifacts): ``logging.mlflow_uri``, else
    MLFLOW_TRACKING_URI (the store's own artifact root), else a sqlite store in ``store_dir`` (the run's or the
    sweep's directory: ``mlflow ui --backend-store-uri`` that URI) with the artifacts beside it."""
    if uri := cfg.logging.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI"):
        return uri, None
    store_dir = os.path.abspath(store_dir)
    return f"sqlite:///{os.path.join(store_dir, 'mlflow.db')}", os.path.join(store_dir, "mlartifacts")


def mlflow_run(uri: str, artifacts: Optional[str], experiment: str, run_name: str, run_dir: str, resuming: bool,
               tags: Optional[Dict[str, str]] = None) -> Tuple[Any, str]:
    """(client, run id): the MLflow run whose id ``run_dir`` keeps when resuming, else a new one."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run_id = _run_id_file(run_dir, MLFLOW_RUN_ID, resuming)
    if run_id is None:
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(
            experiment, artifact_location=artifacts and f"file://{artifacts}")
        run_id = client.create_run(exp_id, run_name=run_name, tags=tags or {}).info.run_id
        _keep_id(run_dir, MLFLOW_RUN_ID, run_id)
    else:
        client.update_run(run_id, status="RUNNING")
    return client, run_id


def mlflow_sweep_parent(config: Any, sweep_dir: str) -> Optional[Tuple[str, str]]:
    """A sweep with ``mlflow`` among ``logging.backends``: (tracking URI, the parent run's id) that its jobs log
    under as child runs; a resumed sweep keeps its parent run."""
    if "mlflow" not in list(config.logging.backends):
        return None
    os.makedirs(sweep_dir, exist_ok=True)
    uri, artifacts = mlflow_uri(config, sweep_dir)
    name = "_".join(os.path.abspath(sweep_dir).split(os.sep)[-2:])
    _, run_id = mlflow_run(uri, artifacts, config.logging.mlflow_experiment, name, sweep_dir, resuming=True,
                           tags={"slime_hydra.sweep_dir": os.path.abspath(sweep_dir)})
    return uri, run_id


def end_mlflow_run(uri: str, run_id: str, failed: bool) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=uri).set_terminated(run_id, "FAILED" if failed else "FINISHED")


class MLflow:
    """The resolved config as parameters, the metrics per step, config.yaml, summary.json and reward_curve.png as
    artifacts; a sweep's job is a child run of the sweep's (``logging.mlflow_parent``)."""

    def __init__(self, cfg: Any) -> None:
        from mlflow.entities import Param

        from slime_hydra.logging.secrets import redacted_config

        tags = {"mlflow.parentRunId": cfg.logging.mlflow_parent} if cfg.logging.mlflow_parent else {}
        self.client, self.run_id = mlflow_run(*mlflow_uri(cfg, cfg.output_dir), cfg.logging.mlflow_experiment,
                                              cfg.run_name, cfg.output_dir, cfg.trainer.resume is not None, tags)
        if not self.client.get_run(self.run_id).data.params:  # a resumed run has them (MLflow refuses a change)
            params = [Param(k, str(v)[:6000]) for k, v in flatten(redacted_config(cfg)).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
                self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, row: Dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(1000 * time.time())
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in _numbers(row).items()])

    def finish(self, summary: Dict[str, Any], run_dir: str) -> None:
        for k, v in _numbers(summary).items():
            self.client.set_tag(self.run_id, f"summary.{k}", str(v))
        for name in ARTIFACTS:
            path = os.path.join(run_dir, name)
            if os.path.exists(path):
                self.client.log_artifact(self.run_id, path)

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


TRACKERS = {"wandb": Wandb, "tensorboard": TensorBoard, "mlflow": MLflow}


def flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """A nested dict as ``{"a.b.c": value}`` (lists as their text)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: Dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def open_trackers(cfg: Any) -> List[Any]:
    backends = [b for b in cfg.logging.backends if not (b == "wandb" and cfg.logging.wandb_mode == "disabled")]
    return [TRACKERS[b](cfg) for b in backends]


def problems(cfg: Any) -> List[str]:
    """Why a tracker of ``logging.backends`` could not start: an unknown name, its package missing, an MLflow
    tracking server that does not answer."""
    errs = []
    for i, b in enumerate(cfg.logging.backends):
        if b not in TRACKERS:
            errs.append(f"logging.backends[{i}]: unknown tracker {b!r}; expected some of {list(TRACKERS)}")
        elif importlib.util.find_spec(PACKAGES[b][0]) is None:
            errs.append(f"logging.backends[{i}]: {b} needs the {PACKAGES[b][0]} package, which is not installed: "
                        f"pip install 'slime_hydra[{PACKAGES[b][1]}]' (or leave {b} out of logging.backends)")
    if "mlflow" in cfg.logging.backends:
        key = "logging.mlflow_uri" if cfg.logging.mlflow_uri else "MLFLOW_TRACKING_URI"
        uri = cfg.logging.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri and (why := unreachable(uri)):
            errs.append(f"{key}={uri}: MLflow (logging.backends) cannot log there: {why}")
    return errs


def unreachable(uri: str) -> Optional[str]:
    """Why MLflow could not use tracking URI ``uri`` (None: it can): a scheme it has no store for, a
    server that does not answer its health check."""
    scheme = uri.partition(":")[0] if "://" in uri or uri.startswith("file:") else ""
    if scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as r:
                return None if r.status == 200 else f"its /health answered {r.status}"
        except OSError as e:
            return f"no MLflow server answers there ({e})"
    if scheme in ("", "file"):
        return None if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() == "true" else (
            "MLflow refuses a file store unless MLFLOW_ALLOW_FILE_STORE=true; use sqlite:///<path>.db")
    if scheme in ("sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc"):
        return None
    return f"no MLflow tracking store has the scheme {scheme!r} (file:, sqlite:///, http(s)://, a database URL)"
