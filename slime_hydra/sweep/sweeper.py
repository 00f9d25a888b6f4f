"""``hydra/sweeper=slime``: Hydra's basic sweeper (every combination of the ``-m`` values), which first
composes and validates every job (compose.py), then runs them all in one launch (launcher.py), so that
``sweep.max_concurrent`` of them run at any time; and resumes a sweep (``sweep.resume=true``)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, List, Optional, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from slime_hydra.sweep.compose import Job, SweepInvalid, capacity_problems, cluster_size, compose, validate_jobs
from slime_hydra.sweep.jobs import FINISHED, read_status
from slime_hydra.sweep.report import best_job, write_report

log = logging.getLogger(__name__)


def prepare(sweeper: Any, jobs: List[Job]) -> List[Job]:
    """Validate the jobs against each other's cluster (shared by both sweepers): the invalid ones listed,
    and none started (``SweepInvalid``, printed, exit 1) unless ``sweep.skip_invalid``. Then, with
    ``dry_run=true``, every job's plan in one line, and exit."""
    config = sweeper.config
    cpus, gpus = cluster_size(config, jobs)
    shared = hasattr(sweeper.launcher, "start")  # the slime launcher: every job on the sweep's local cluster
    if shared and not config.cluster.address:
        capacity_problems(jobs, cpus, gpus)
    try:
        valid = validate_jobs(config, jobs)
    except SweepInvalid as e:
        print(e, file=sys.stderr, flush=True)
        sys.exit(1)
    if config.dry_run:
        for job in valid:
            print(job.plan_line())
        print(f"{len(valid)} job(s) valid (dry_run=true: nothing started)", flush=True)
        sys.exit(0)
    if shared:  # another launcher (Slurm) gives each job a cluster of its own
        sweeper.launcher.start(cpus, gpus)
    return valid


def launch(launcher: Any, todo: List[tuple]) -> List[JobReturn]:
    """``(number, overrides)`` pairs through the slime launcher, or another launcher's ``launch`` (one call
    per run of consecutive numbers: a resumed sweep skips some); the launcher closed afterwards."""
    try:
        if hasattr(launcher, "launch_jobs"):
            return launcher.launch_jobs(todo)
        returns: List[JobReturn] = []
        i = 0
        while i < len(todo):
            j = i
            while j + 1 < len(todo) and todo[j + 1][0] == todo[j][0] + 1:
                j += 1
            returns += launcher.launch([o for _, o in todo[i:j + 1]], initial_job_idx=todo[i][0])
            i = j + 1
        return returns
    finally:
        if hasattr(launcher, "close"):
            launcher.close()


def finish(sweeper: Any, jobs: List[Job], returns: Sequence[JobReturn]) -> None:
    """The report, a summary line, and exit status 1 naming the failed jobs, if any."""
    sweep_dir = str(sweeper.config.hydra.sweep.dir)
    rows = write_report(sweep_dir)
    failed = [j for j, r in zip(jobs, returns) if r.status != JobStatus.COMPLETED and not _pruned(r)]
    best = best_job(rows)
    counts = {s: sum(r["status"] == s for r in rows) for s in sorted({r["status"] for r in rows})}
    print(f"[sweep] done: {', '.join(f'{n} {s}' for s, n in counts.items())}; report {sweep_dir}/sweep.md"
          + (f"; best: job {best['job']} {best['overrides']} ({best['final_reward']})" if best else ""), flush=True)
    if failed:
        print(f"[sweep] {len(failed)} job(s) failed: " + "; ".join(
            f"{j.label()} ({os.path.join(j.dir or '', 'console.log')})" for j in failed), file=sys.stderr, flush=True)
        sys.exit(1)


def _pruned(ret: JobReturn) -> bool:
    from slime_hydra.sweep.launcher import JobPruned

    return isinstance(ret._return_value, JobPruned)


class SlimeSweeper(BasicSweeper):
    """``optuna``: hydra-optuna-sweeper's settings (conf/hparams_search/): search ``params`` with Optuna
    (optuna.py) instead of running every combination. One sweeper for both, because Hydra 1.3 lets the
    root config's choice of ``hydra/sweeper`` win over an ``hparams_search`` preset's."""

    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[Any] = None,
                 optuna: Optional[Any] = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.optuna = None
        if optuna is not None:
            from slime_hydra.sweep.optuna import SlimeOptunaSweeper

            self.optuna = SlimeOptunaSweeper(**optuna, params=params)

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        if self.optuna is not None:
            self.optuna.setup(hydra_context=hydra_context, task_function=task_function, config=config)
        else:
            super().setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        if self.optuna is not None:
            return self.optuna.sweep(arguments)
        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        params_conf = self._parse_config()
        params_conf.extend(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        batches = self.split_arguments(parser.parse_overrides(params_conf), None)
        overrides = [list(o) for batch in batches for o in batch]
        jobs = prepare(self, compose(self.hydra_context, self.config, list(enumerate(overrides))))
        sweep_dir = str(self.config.hydra.sweep.dir)
        os.makedirs(sweep_dir, exist_ok=True)
        OmegaConf.save(self.config, os.path.join(sweep_dir, "multirun.yaml"))
        todo = resume_plan(self.config, jobs, {j.num: overrides[j.num] for j in jobs})
        returns = launch(self.launcher, todo)
        ran = {num for num, _ in todo}
        finish(self, [j for j in jobs if j.num in ran], returns)
        return [returns]


def resume_plan(config: Any, jobs: List[Job], overrides: dict) -> List[tuple]:
    """The ``(number, overrides)`` to launch. ``sweep.resume=true``: a job that ended ok or pruned is
    not run again; the others run with ``trainer.resume=auto`` (from their newest checkpoint, if any)."""
    if not config.sweep.resume:
        return [(j.num, overrides[j.num]) for j in jobs]
    todo = []
    for j in jobs:
        state = read_status(j.dir) if j.dir else None
        if state and state["status"] in FINISHED:
            log.info("sweep.resume: %s ended %s; not run again", j.label(), state["status"])
            continue
        extra = [] if any(o.startswith("trainer.resume=") for o in overrides[j.num]) else ["trainer.resume=auto"]
        todo.append((j.num, overrides[j.num] + extra))
    return todo
