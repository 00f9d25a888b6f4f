"""One sweep job's state on disk: ``<job dir>/sweep_job.json``, written by the process that runs the job
(launcher.py) and read by the report. The run directory is the truth, so a report can be rebuilt after
the sweep's process is gone, and a resumed sweep knows which jobs finished."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional, Sequence

from slime_hydra.launch.lease import _start_time

STATUS_FILE = "sweep_job.json"


class JobPruned(Exception):
    """A trial stopped by the sweep's pruner (raised by the job's eval hook, prune.py)."""


FINISHED = ("ok", "pruned")  # a resumed sweep does not run these again


def write_json_atomic(path: str, obj: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


def shown_overrides(config: Any, overrides: Sequence[str]) -> List[str]:
    """A job's overrides as the report shows them: not Hydra's, nor the sweep-wide switches that
    ``hydra.job.config.override_dirname.exclude_keys`` leaves out of its directory name."""
    exclude = set(config.hydra.job.config.override_dirname.exclude_keys or [])
    return [o for o in overrides if not o.startswith("hydra.") and o.split("=", 1)[0].lstrip("+~") not in exclude]


def write_status(job_dir: str, num: int, overrides: List[str], status: str, error: Optional[str] = None,
                 started: Optional[float] = None) -> None:
    """``status``: running | ok | failed | pruned. A running job records its process, so that a reader can
    tell a job still running from one whose sweep was killed (``interrupted``)."""
    os.makedirs(job_dir, exist_ok=True)
    write_json_atomic(os.path.join(job_dir, STATUS_FILE), {
        "num": num, "overrides": list(overrides), "status": status, "error": error, "pid": os.getpid(),
        "pid_start": _start_time(os.getpid()), "started": started,
        "ended": None if status == "running" else time.time()})


def read_status(job_dir: str) -> Optional[Dict[str, Any]]:
    """The job's state; a ``running`` job whose process is gone reads as ``interrupted``."""
    try:
        with open(os.path.join(job_dir, STATUS_FILE)) as f:
            state = json.load(f)
    except (FileNotFoundError, ValueError):
        return None
    if state["status"] == "running" and _start_time(state["pid"]) != state["pid_start"]:
        state["status"] = "interrupted"
    return state


def job_dirs(sweep_dir: str) -> List[str]:
    """The sweep's job directories (those with a status file), in job order."""
    if not os.path.isdir(sweep_dir):
        return []
    dirs = [os.path.join(sweep_dir, d) for d in os.listdir(sweep_dir)
            if os.path.exists(os.path.join(sweep_dir, d, STATUS_FILE))]
    return sorted(dirs, key=lambda d: (read_status(d) or {}).get("num", 0))
