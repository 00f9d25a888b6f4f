"""The steps both sweepers share (sweeper.py, optuna.py): validate the jobs and start the cluster,
launch, and finish with the report and the exit status."""

from __future__ import annotations

import contextlib
import glob
import itertools
import logging
import os
import sys
from typing import Any, Iterator, List, Sequence, Tuple

from hydra.core.utils import JobReturn, JobStatus

from slime_hydra.checkpoint.ckpt import complete_checkpoints
from slime_hydra.sweep.compose import Job, SweepInvalid, capacity_problems, cluster_size, validate_jobs
from slime_hydra.sweep.jobs import FINISHED, STATUS_FILE, JobPruned, foreign_job_dirs, job_dirs, read_status
from slime_hydra.sweep.report import best_job, objective_of, write_report

log = logging.getLogger(__name__)


def prepare(sweeper: Any, jobs: List[Job]) -> List[Job]:
    """The valid jobs (invalid ones: exit 1 unless ``sweep.skip_invalid``), the cluster started; ``dry_run``:
    every job's plan in one line, and exit."""
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
    """``(number, overrides)`` pairs through the launcher (another's ``launch``: once per run of consecutive
    numbers), then closed."""
    try:
        if hasattr(launcher, "launch_jobs"):
            return launcher.launch_jobs(todo)
        returns: List[JobReturn] = []
        for _, run in itertools.groupby(enumerate(todo), key=lambda i_job: i_job[1][0] - i_job[0]):  # consecutive
            run = [job for _, job in run]
            returns += launcher.launch([o for _, o in run], initial_job_idx=run[0][0])
        return returns
    finally:
        if hasattr(launcher, "close"):
            launcher.close()


def finish(sweeper: Any, jobs: List[Job], returns: Sequence[JobReturn],
           also_failed: Sequence[Tuple[Job, str]] = ()) -> None:
    """The report, a summary line, and exit status 1 naming the failed jobs and ``also_failed`` (jobs that ran ok
    but failed the sweep, with why: an Optuna trial without an objective)."""
    sweep_dir = str(sweeper.config.hydra.sweep.dir)
    rows = write_report(sweep_dir)
    failed = [j for j, r in zip(jobs, returns)
              if r.status != JobStatus.COMPLETED and not isinstance(r._return_value, JobPruned)]
    best = best_job(rows, objective_of(sweep_dir)[1])
    counts = {s: sum(r["status"] == s for r in rows) for s in sorted({r["status"] for r in rows})}
    print(f"[sweep] done: {', '.join(f'{n} {s}' for s, n in counts.items())}; report {sweep_dir}/sweep.md"
          + (f"; best: job {best['job']} {best['overrides']} ({best['objective']})" if best else ""), flush=True)
    if failed:
        print(f"[sweep] {len(failed)} job(s) failed: " + "; ".join(
            f"{j.label()} ({os.path.join(j.dir or '', 'console.log')})" for j in failed), file=sys.stderr, flush=True)
    if also_failed:
        print(f"[sweep] {len(also_failed)} trial(s) without an objective (told Optuna FAIL): " + "; ".join(
            f"{j.label()}: {why}" for j, why in also_failed), file=sys.stderr, flush=True)
    if failed or also_failed:
        sys.exit(1)


INTERRUPTED_SWEEP = "slime_sweep_dir"  # the attribute of a KeyboardInterrupt out of a sweep: its directory


@contextlib.contextmanager
def naming_the_sweep(sweep_dir: str) -> Iterator[None]:
    """A Ctrl-C out of the sweep carries its directory, for run.py's advice (``sweep.resume=true``)."""
    try:
        yield
    except KeyboardInterrupt as e:
        setattr(e, INTERRUPTED_SWEEP, sweep_dir)
        raise


def newest_sweep(root: str = "multirun", but: str = "") -> str:
    """The newest sweep in Hydra's default ``multirun/<date>/<time>`` other than ``but`` ("" if none)."""
    found = [os.path.dirname(p) for p in glob.glob(os.path.join(root, "*", "*", "multirun.yaml"))]
    found = [d for d in found if os.path.abspath(d) != os.path.abspath(but)]
    return max(found, key=lambda d: os.path.getmtime(os.path.join(d, "multirun.yaml"))) if found else ""


def check_resumable(config: Any) -> None:
    """``sweep.resume=true`` on a ``hydra.sweep.dir`` that holds no sweep (it would start every job afresh): exit 2,
    suggesting the newest sweep."""
    sweep_dir = str(config.hydra.sweep.dir)  # a sweep's has its multirun.yaml (written first) or a job
    if not config.sweep.resume or os.path.exists(os.path.join(sweep_dir, "multirun.yaml")) or job_dirs(sweep_dir):
        return
    newest = newest_sweep(but=sweep_dir)
    print(f"sweep.resume=true: hydra.sweep.dir={sweep_dir} holds no sweep (no multirun.yaml, no job with "
          f"{STATUS_FILE}), so there is nothing to resume. Name the sweep's directory: "
          + (f"the newest is hydra.sweep.dir={newest}" if newest else "hydra.sweep.dir=<its directory>")
          + " (or leave out sweep.resume=true to start a new sweep)", file=sys.stderr, flush=True)
    sys.exit(2)


def refuse_foreign_jobs(sweep_dir: str, ours: Sequence[str], why: str) -> None:
    """A new sweep in a ``hydra.sweep.dir`` holding another sweep's jobs (they would mix in its report): exit 2."""
    if not (foreign := foreign_job_dirs(sweep_dir, ours)):
        return
    shown = ", ".join(os.path.relpath(d, sweep_dir) for d in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    print(f"hydra.sweep.dir={sweep_dir} already holds {len(foreign)} job(s) of another sweep ({shown}), and {why}: "
          f"use a new hydra.sweep.dir, or sweep.resume=true to continue the sweep that is there",
          file=sys.stderr, flush=True)
    sys.exit(2)


def resume_plan(config: Any, jobs: List[Job], overrides: dict) -> List[tuple]:
    """The ``(number, overrides)`` to launch; ``sweep.resume=true``: not a job that ended ok or pruned, the others
    with ``trainer.resume=auto`` (a job's own ``trainer.resume`` until it has saved a checkpoint)."""
    if not config.sweep.resume:
        return [(j.num, overrides[j.num]) for j in jobs]
    todo = []
    for j in jobs:
        state = read_status(j.dir) if j.dir else None
        if state and state["status"] in FINISHED:
            log.info("sweep.resume: %s ended %s; not run again", j.label(), state["status"])
            continue
        own = [o for o in overrides[j.num] if not o.startswith("trainer.resume=")]
        if own != overrides[j.num] and not complete_checkpoints(j.dir or ""):
            todo.append((j.num, overrides[j.num]))  # its own trainer.resume (a base checkpoint), nothing saved yet
        else:  # from its newest checkpoint, if any (a job's own trainer.resume was where it began)
            todo.append((j.num, own + ["trainer.resume=auto"]))
    return todo
