"""A sweep job's ``sweep_job.json`` under any Hydra launcher: the slime launcher (launcher.py) writes it around
the job itself; the others (basic, submitit) run the job through Hydra's ``run_job``, which calls this callback
(``hydra.callbacks.sweep_status`` in conf/config.yaml) in the job's process, on whatever node that is."""

from __future__ import annotations

import atexit
import time
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from slime_hydra.sweep import jobs


class SweepStatus(Callback):
    def __init__(self) -> None:
        self.started = None

    @staticmethod
    def _ours(config: DictConfig) -> bool:
        """A multirun job whose launcher does not write the status itself."""
        return config.hydra.mode == RunMode.MULTIRUN and not jobs.LAUNCHER_WRITES_STATUS

    @staticmethod
    def _where(config: DictConfig):
        label = jobs.shown_overrides(config, list(config.hydra.overrides.task))
        return str(config.hydra.runtime.output_dir), int(config.hydra.job.num), label

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self._ours(config):
            self.started = time.time()
            jobs.write_status(*self._where(config), "running", started=self.started)
            # a job that ends in SystemExit (a refused config) never reaches on_job_end: run_job catches Exceptions
            atexit.register(self.exited, config)

    def exited(self, config: DictConfig) -> None:
        """At the process's exit, a job that did not reach ``on_job_end``."""
        jobs.write_status(*self._where(config), "failed", started=self.started,
                          error="the job's process exited before the job ended (a SystemExit: its console says why)")

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not self._ours(config):
            return
        atexit.unregister(self.exited)
        if job_return.status == JobStatus.COMPLETED:
            status, error = "ok", None
        else:
            err = job_return._return_value
            status, error = jobs.ended_status(err), str(err)[-2000:]
        jobs.write_status(*self._where(config), status, error=error, started=self.started)
