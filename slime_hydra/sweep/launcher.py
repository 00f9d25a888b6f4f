"""``hydra/launcher=slime``: hydra-joblib-launcher's process pool (``sweep.max_concurrent`` workers), every job a
Ray driver of its own on the sweep's cluster (cluster.py). Around each job its worker writes ``sweep_job.json``,
sends its console to ``<job dir>/console.log``, names its wandb run by its overrides, makes its MLflow run a child of
the sweep's and installs the pruning hook."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra.types import HydraContext, TaskFunction
from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher
from omegaconf import DictConfig, OmegaConf, open_dict

from slime_hydra.launch import preempt
from slime_hydra.sweep import jobs
from slime_hydra.sweep.cluster import SweepCluster
from slime_hydra.sweep.jobs import JobPruned, read_status, shown_overrides, sweep_job_dirs, write_status
from slime_hydra.sweep.report import collect, status_line, write_report

log = logging.getLogger(__name__)


def sweep_id(sweep_dir: str) -> str:
    """A sweep's name for wandb's group: the last two parts of its directory (``<date>_<time>``)."""
    return "_".join(os.path.abspath(sweep_dir).split(os.sep)[-2:])


def execute_job(idx: int, overrides: Sequence[str], hydra_context: HydraContext, config: DictConfig,
                task_function: TaskFunction, singleton_state: Dict[Any, Any], prune: Optional[Dict[str, Any]],
                mlflow: Optional[Tuple[str, str]] = None) -> JobReturn:
    """One job, in a worker process (hydra-joblib-launcher's ``execute_job``, plus the sweep's bookkeeping)."""
    setup_globals()
    Singleton.set_state(singleton_state)
    jobs.LAUNCHER_WRITES_STATUS = True  # callback.py leaves the status to this function
    preempt.EXIT_BEFORE_FIRST_STEP = False  # a preempted job ends as a job, the worker stays
    sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    with open_dict(sweep_config):
        sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{idx}"
        sweep_config.hydra.job.num = idx
        sweep_config.logging.progress = False  # the sweep prints status lines
        if sweep_config.logging.wandb_group is None:
            sweep_config.logging.wandb_group = sweep_id(str(sweep_config.hydra.sweep.dir))
        if mlflow is not None:  # (tracking URI, the sweep's run)
            sweep_config.logging.mlflow_uri, sweep_config.logging.mlflow_parent = mlflow
        shown = " ".join(shown_overrides(sweep_config, overrides))
        if shown:
            sweep_config.run_name = shown
    HydraConfig.instance().set_config(sweep_config)
    job_dir = os.path.join(str(sweep_config.hydra.sweep.dir), str(sweep_config.hydra.sweep.subdir))  # as run_job
    started = time.time()
    label = shown_overrides(sweep_config, overrides)
    write_status(job_dir, idx, label, "running", started=started)
    from slime_hydra.launch import loop

    hooks = []
    if prune:
        from slime_hydra.sweep.prune import pruning_hook

        hooks.append(pruning_hook(prune, idx, sweep_config.trainer.num_rollout))
    loop.EVAL_HOOKS.extend(hooks)
    saved = _redirect(os.path.join(job_dir, "console.log"))
    try:
        with preempt.handling(sweep_config.trainer):  # the sweep forwards a preemption to the job
            ret = run_job(hydra_context=hydra_context, config=sweep_config, task_function=task_function,
                          job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
    except BaseException as e:  # noqa: BLE001 - a SystemExit of the task must not take the worker with it
        ret = JobReturn(overrides=list(overrides), cfg=sweep_config, hydra_cfg=sweep_config,
                        working_dir=job_dir, task_name=sweep_config.hydra.job.name, status=JobStatus.FAILED)
        ret._return_value = e
    finally:
        _restore(saved)
        for hook in hooks:
            loop.EVAL_HOOKS.remove(hook)
    if ret.status == JobStatus.COMPLETED:
        write_status(job_dir, idx, label, "ok", started=started)
    else:
        err = ret._return_value
        pruned = isinstance(err, JobPruned)
        tail = str(err) if isinstance(err, (JobPruned, preempt.Preempted)) else \
            "".join(traceback.format_exception(err))[-2000:]
        write_status(job_dir, idx, label, jobs.ended_status(err), error=tail, started=started)
        # what comes back to the sweep's process must unpickle there: the error's text, not its object
        ret._return_value = err if pruned else RuntimeError(f"job {idx} failed: {tail}")
    ret.cfg = ret.hydra_cfg = None  # the sweeper needs the status and value, not the configs
    return ret


def _redirect(path: str) -> Tuple[int, int, Any, Any]:
    """Point this process's stdout and stderr (the file descriptors: also the servers it starts) at ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2), sys.stdout, sys.stderr)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    return saved


def _restore(saved: Tuple[int, int, Any, Any]) -> None:
    out, err, sys_out, sys_err = saved
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):
            stream.close()
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    sys.stdout, sys.stderr = sys_out, sys_err


class StatusPrinter(threading.Thread):
    """While jobs run: every ``interval`` s, a line for each job whose state changed, and the report rewritten."""

    def __init__(self, sweep_dir: str, interval: float, shown: Dict[Any, str]):
        super().__init__(daemon=True, name="sweep-status")
        self.sweep_dir, self.interval = sweep_dir, interval
        self.stopped = threading.Event()
        self.shown = shown  # the last line printed per job (kept across a search's batches)

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.update()

    def update(self) -> None:
        try:
            rows = collect(self.sweep_dir)
        except Exception as e:  # noqa: BLE001 - a status line must never stop the sweep
            log.debug("sweep status: %s", e)
            return
        lines = {row["job"]: status_line(row) for row in rows}
        changed = {job: line for job, line in lines.items() if self.shown.get(job) != line}
        for line in changed.values():
            print(line, flush=True)
        self.shown.update(changed)
        if changed:
            write_report(self.sweep_dir)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=30)
        self.update()


class SweepLauncher(JoblibLauncher):
    """The sweepers call ``start`` with the cluster's size before the first job and ``close`` after the last."""

    def __init__(self, **joblib: Any) -> None:
        super().__init__(**joblib)
        self.cluster: Optional[SweepCluster] = None
        self.prune: Optional[Dict[str, Any]] = None  # set by the Optuna sweeper when it prunes
        self.shown: Dict[Any, str] = {}
        self.printer: Optional[StatusPrinter] = None
        self.pool: Any = None  # loky's process pool, while jobs run
        self.mlflow: Optional[Tuple[str, str]] = None  # the sweep's MLflow (tracking URI, parent run id)
        self.futures: List[Any] = []  # the jobs submitted
        self.preempted: Optional[int] = None  # the preemption signal the sweep got
        self.handlers: Dict[int, Any] = {}  # the signals' handlers before ``begin``

    def start(self, num_cpus: int, num_gpus: int) -> None:
        if self.cluster is None:
            cfg = self.config
            self.cluster = SweepCluster(str(cfg.hydra.sweep.dir), num_cpus, num_gpus, cfg.cluster.address)
            self.cluster.start()

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        return self.launch_jobs([(initial_job_idx + i, o) for i, o in enumerate(job_overrides)])

    @property
    def n_jobs(self) -> int:
        return max(1, int(self.joblib.get("n_jobs") or 1))

    def begin(self) -> None:
        """Before the first job of a launch: the cluster (if the sweeper did not start it) and the status lines."""
        setup_globals()
        # run.py leaves a stopped sweep with os._exit: the semaphores of loky's queues are not unlinked, and the
        # resource tracker would warn of them
        os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning:multiprocessing.resource_tracker")
        assert self.config is not None and self.task_function is not None and self.hydra_context is not None
        if self.cluster is None:
            from slime_hydra.sweep.compose import cluster_size

            self.start(*cluster_size(self.config, []))
        os.makedirs(str(self.config.hydra.sweep.dir), exist_ok=True)
        if self.mlflow is None:
            from slime_hydra.logging.trackers import mlflow_sweep_parent

            self.mlflow = mlflow_sweep_parent(self.config, str(self.config.hydra.sweep.dir))
        if self.printer is None:
            interval = float(OmegaConf.select(self.config, "sweep.status_interval_s") or 10.0)
            self.printer = StatusPrinter(str(self.config.hydra.sweep.dir), interval, self.shown)
            self.printer.start()
        for s in preempt.signals(self.config.trainer):
            self.handlers[s] = signal.signal(s, self._preempt)

    def end(self) -> None:
        for s, handler in self.handlers.items():
            signal.signal(s, handler)
        self.handlers = {}
        if self.printer is not None:
            self.printer.stop()
            self.printer = None

    def _preempt(self, signum: int, _frame: Any) -> None:
        """SIGTERM or ``trainer.preempt_signal``: no job starts any more; each running job gets the signal (and
        saves, launch/preempt.py); ``close`` raises :class:`Preempted` once they have."""
        if self.preempted is None:
            log.warning("%s: preempted; the running jobs save, no other starts", signal.Signals(signum).name)
        self.preempted = signum
        for future in self.futures:
            future.cancel()  # those not started yet
        for job_dir in sweep_job_dirs(str(self.config.hydra.sweep.dir)):
            state = read_status(job_dir)  # a running job's process is alive (on this host)
            if state and state["status"] == "running" and state["pid"] != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(state["pid"], signum)

    def submit(self, idx: int, overrides: Sequence[str]) -> Any:
        """Job ``idx`` into loky's pool (not ``joblib.Parallel``, which runs ``n_jobs=1`` in this process); a future
        of its JobReturn (``result``), so that the Optuna sweeper starts a trial as soon as any ends."""
        from joblib.externals.loky import get_reusable_executor

        log.info("sweep: job #%d: %s", idx, " ".join(filter_overrides(overrides)))
        self.pool = get_reusable_executor(max_workers=self.n_jobs)
        self.futures.append(self.pool.submit(execute_job, idx, overrides, self.hydra_context, self.config,
                                             self.task_function, Singleton.get_state(), self.prune, self.mlflow))
        return self.futures[-1]

    @staticmethod
    def result(future: Any, idx: int, overrides: Sequence[str]) -> JobReturn:
        """The job's JobReturn; a job whose process died (killed, out of memory) or that a preemption cancelled
        before it started is a failed one."""
        try:
            return future.result()
        except Exception as e:  # noqa: BLE001 - the worker process is gone: report, do not stop the sweep
            ret = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
            ret._return_value = RuntimeError(f"job {idx}: its process ended: {type(e).__name__}: {e}")
            return ret

    def launch_jobs(self, jobs: List[Tuple[int, Sequence[str]]]) -> List[JobReturn]:
        """Run ``(job number, overrides)`` pairs, ``n_jobs`` at once; their JobReturns in that order."""
        self.begin()
        log.info("sweep: %d job(s), %d at once, in %s", len(jobs), self.n_jobs, self.config.hydra.sweep.dir)
        try:
            futures = [self.submit(idx, overrides) for idx, overrides in jobs]
            return [self.result(f, idx, overrides) for f, (idx, overrides) in zip(futures, jobs)]
        finally:
            self.end()

    def close(self) -> None:
        """After the last job: the workers end (killed on the way out of an error or a Ctrl-C), then the cluster;
        a preempted sweep raises :class:`Preempted`."""
        failing = sys.exc_info()[0] is not None or self.preempted is not None  # not waiting for their teardown
        if self.pool is not None:
            self.pool.shutdown(wait=True, kill_workers=failing)
            self.pool = None
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
        if self.mlflow is not None:
            from slime_hydra.logging.trackers import end_mlflow_run

            end_mlflow_run(*self.mlflow, failed=failing)
            self.mlflow = None
        if failing and self.config is not None:
            # the last report saw the jobs running: their processes are gone now, they read ``interrupted``
            try:
                write_report(str(self.config.hydra.sweep.dir))
            except Exception as e:  # noqa: BLE001 - the error (the Ctrl-C) on its way out comes first
                log.warning("sweep: the report after the interruption: %s", e)
        if self.preempted is not None:
            raise preempt.Preempted(self.preempted, "the jobs saved (go on with the same command and "
                                    f"sweep.resume=true hydra.sweep.dir={self.config.hydra.sweep.dir})")
