"""Running ``python run.py`` from a test: the run's summary and metrics rows, and the processes it left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

FAST = ["logging.progress=false", "eval.interval=0"]

TAG = f"slime-hydra-test-{os.getpid()}"  # every process a run starts inherits it (see leftover_processes)
ENV = {**os.environ, "SLIME_HYDRA_TEST_TAG": TAG}


def run(run_dir: Path, *overrides: str, timeout: int = 600) -> dict:
    """``python run.py`` into ``run_dir``; returns summary.json."""
    cmd = [sys.executable, "run.py", f"hydra.run.dir={run_dir}", *overrides]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def leftover_processes() -> list:
    """Processes started by this module's runs (Ray's, engines, routers) that are still alive:
    they inherit SLIME_HYDRA_TEST_TAG from the run, so other sessions' processes don't count."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            if f"SLIME_HYDRA_TEST_TAG={TAG}".encode() in env and int(pid) != os.getpid():
                ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()[:60].rstrip(bytes(1))
                token = [v for v in env.split(bytes(1)) if v.startswith(b"SLIME_HYDRA_RUN_TOKEN=")]
                alive.append(f"{pid} (parent {ppid}) {cmd!r} {token}")
        except (OSError, ValueError):
            continue
    return alive
