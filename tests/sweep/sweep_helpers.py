"""Running ``python run.py -m ...`` for the sweep tests, and finding processes it left behind."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
TAG = f"slime-hydra-sweep-test-{os.getpid()}"  # every process a sweep starts inherits it
ENV = {**os.environ, "SLIME_HYDRA_TEST_TAG": TAG, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline",
       "RAY_AUTH_MODE": "disabled"}
# short jobs: no progress bar, no eval before training, status lines every second
FAST = ["eval.before_train=false", "sweep.status_interval_s=1"]


def sweep(sweep_dir: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "run.py", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)


def popen(sweep_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "run.py", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)


def table(sweep_dir: Path) -> List[Dict[str, str]]:
    with open(sweep_dir / "sweep.csv") as f:
        return list(csv.DictReader(f))


def metrics(run_dir: Path) -> List[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def logged_at(run_dir: Path, needle: str) -> float:
    """When the job's run.log first has a line containing ``needle`` (seconds since the epoch)."""
    for line in (Path(run_dir) / "run.log").read_text().splitlines():
        if needle in line:
            m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
            return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    raise AssertionError(f"{run_dir}/run.log has no line with {needle!r}")


def leftover_processes() -> List[str]:
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            if f"SLIME_HYDRA_TEST_TAG={TAG}".encode() in env and int(pid) != os.getpid():
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                if stat[0] == "Z":
                    continue
                alive.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes()[:80]!r}")
        except (OSError, ValueError, IndexError):
            continue
    return alive
