"""One sweep job's state on disk: ``<job dir>/sweep_job.json``, written by the process that runs the job
(launcher.py) and read by the report. The run directory is the truth, so a report can be rebuilt after
the sweep's process is gone, and a resumed sweep knows which jobs finished."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import OmegaConf

from slime_hydra.launch.lease import _start_time
from slime_hydra.logging.metrics import write_json_atomic

STATUS_FILE = "sweep_job.json"
# the sweep's own job directories (relative to hydra.sweep.dir): the report reads only these, no other sweep's
MANIFEST = "sweep_jobs.json"
DIRNAME_RESOLVER = "safe_dirname"  # conf/config.yaml's hydra.sweep.subdir
DIRNAME_MAX = 200  # bytes of a job directory's name taken from its overrides (a file name has at most 255)
SEARCH_DEPTH = 32  # job_dirs looks this many folders deep at most


class JobPruned(Exception):
    """A trial stopped by the sweep's pruner (raised by the job's eval hook, prune.py)."""


FINISHED = ("ok", "pruned")  # a resumed sweep does not run these again
# set in the slime launcher's workers, which write the status around the job (else callback.py writes it)
LAUNCHER_WRITES_STATUS = False


def ended_status(err: BaseException) -> str:
    """The status of a job that ended in ``err``: pruned, interrupted (a Ctrl-C: stopped, not failed), preempted
    (SIGTERM or ``trainer.preempt_signal``: saved, launch/preempt.py) or failed."""
    from slime_hydra.launch.preempt import Preempted

    return "pruned" if isinstance(err, JobPruned) else "interrupted" if isinstance(err, KeyboardInterrupt) else \
        "preempted" if isinstance(err, Preempted) else "failed"


def in_job_order(dirs: List[str]) -> List[str]:
    return sorted(dirs, key=lambda d: ((read_status(d) or {}).get("num", 0), d))


def shown_overrides(config: Any, overrides: Sequence[str]) -> List[str]:
    """A job's overrides as the report shows them: not Hydra's, nor the sweep-wide switches that
    ``hydra.job.config.override_dirname.exclude_keys`` leaves out of its directory name."""
    exclude = set(config.hydra.job.config.override_dirname.exclude_keys or [])
    return [o for o in overrides if not o.startswith("hydra.") and o.split("=", 1)[0].lstrip("+~") not in exclude]


def safe_dirname(name: str) -> str:
    """``hydra.job.override_dirname`` as ONE directory name (in ``hydra.sweep.subdir``): a ``/`` of a value (a
    path) becomes ``%2F``, not folders (or, with ``..``, a place outside the sweep); a name longer than
    ``DIRNAME_MAX`` bytes is cut and ends with ``~`` and a hash of the whole name."""
    out = str(name).replace("/", "%2F")
    raw = out.encode()
    if len(raw) > DIRNAME_MAX:
        digest = hashlib.sha1(raw).hexdigest()[:10]
        out = raw[:DIRNAME_MAX - len(digest) - 1].decode(errors="ignore") + "~" + digest
    return out


def register_resolver() -> None:
    """``${safe_dirname:...}``, registered on import: Hydra's plugin scan imports the sweep plugins in every
    process that composes a sweep job."""
    if not OmegaConf.has_resolver(DIRNAME_RESOLVER):
        OmegaConf.register_new_resolver(DIRNAME_RESOLVER, safe_dirname)


register_resolver()


def write_status(job_dir: str, num: int, overrides: List[str], status: str, error: Optional[str] = None,
                 started: Optional[float] = None) -> None:
    """``status``: running | ok | failed | pruned | interrupted | preempted. A running job records its process and
    host, so that a reader on that host can tell a job still running from one whose sweep was killed
    (``interrupted``)."""
    os.makedirs(job_dir, exist_ok=True)
    write_json_atomic(os.path.join(job_dir, STATUS_FILE), {
        "num": num, "overrides": list(overrides), "status": status, "error": error, "host": socket.gethostname(),
        "pid": os.getpid(), "pid_start": _start_time(os.getpid()), "started": started,
        "ended": None if status == "running" else time.time()})


def read_status(job_dir: str) -> Optional[Dict[str, Any]]:
    """The job's state; a ``running`` job whose process is gone reads as ``interrupted`` (known only on the
    job's own host: a Slurm job on another node reads as it was written)."""
    try:
        with open(os.path.join(job_dir, STATUS_FILE)) as f:
            state = json.load(f)
    except (FileNotFoundError, ValueError):
        return None
    here = state.get("host", socket.gethostname()) == socket.gethostname()
    if state["status"] == "running" and here and _start_time(state["pid"]) != state["pid_start"]:
        state["status"] = "interrupted"
    return state


def job_dirs(sweep_dir: str) -> List[str]:
    """The sweep's job directories (those with a status file) at any depth, in job order; not searched: a job's
    directory, another run's (``.hydra`` but no status file), a hidden folder or a link."""
    found: List[str] = []

    def search(d: str, depth: int) -> None:
        try:
            entries = list(os.scandir(d))
        except OSError:
            return
        for e in entries:
            if e.name.startswith(".") or not e.is_dir(follow_symlinks=False):
                continue
            if os.path.exists(os.path.join(e.path, STATUS_FILE)):
                found.append(e.path)
            elif depth < SEARCH_DEPTH and not os.path.isdir(os.path.join(e.path, ".hydra")):
                search(e.path, depth + 1)

    search(sweep_dir, 1)
    return in_job_order(found)


def read_manifest(sweep_dir: str) -> Optional[List[str]]:
    """The job directories recorded for the sweep in ``sweep_dir`` (absolute); None without a manifest."""
    try:
        with open(os.path.join(sweep_dir, MANIFEST)) as f:
            rel = json.load(f)["jobs"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    return [os.path.normpath(os.path.join(os.path.abspath(sweep_dir), d)) for d in rel]


def write_manifest(sweep_dir: str, dirs: Sequence[str], append: bool) -> None:
    """Record ``dirs`` as the sweep's job directories, after those already recorded (``append``: a resumed sweep or
    study; without a manifest, every job directory there) or instead of them."""
    old = read_manifest(sweep_dir) if append else []
    old = job_dirs(sweep_dir) if old is None else old
    rel = list(dict.fromkeys(os.path.relpath(os.path.abspath(d), os.path.abspath(sweep_dir)) for d in [*old, *dirs]))
    os.makedirs(sweep_dir, exist_ok=True)
    write_json_atomic(os.path.join(sweep_dir, MANIFEST), {"jobs": rel})


def sweep_job_dirs(sweep_dir: str) -> List[str]:
    """The sweep's job directories with a status file, in job order: its manifest's, else ``job_dirs``."""
    listed = read_manifest(sweep_dir)
    if listed is None:
        return job_dirs(sweep_dir)
    return in_job_order([d for d in listed if os.path.exists(os.path.join(d, STATUS_FILE))])


def foreign_job_dirs(sweep_dir: str, ours: Sequence[str]) -> List[str]:
    """The job directories in ``sweep_dir`` that are not among ``ours``: another sweep's."""
    mine = {os.path.abspath(d) for d in ours}
    return [d for d in job_dirs(sweep_dir) if os.path.abspath(d) not in mine]
