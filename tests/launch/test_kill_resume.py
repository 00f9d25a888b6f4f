"""Crash-safe resume: the driver SIGKILLed at any moment (inside a checkpoint save too), then
``trainer.resume=auto`` in the same run directory, gives the run an uninterrupted run of the same
seed gives: the same metrics rows (each step once), the same data position, the same wandb run,
and no process of the killed run left over."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from runs import ENV, leftover_processes, metrics, run
from slime_hydra.launch.lease import processes_of_run

pytestmark = pytest.mark.integration
ARGS = ["trainer.num_rollout=6", "trainer.save_interval=2", "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
        "eval.interval=0", "logging.progress=false", "logging.wandb_mode=offline"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run."""
    d = tmp_path_factory.mktemp("reference") / "run"
    run(d, *ARGS)
    return d


def start(run_dir: Path, *overrides: str, env=None) -> subprocess.Popen:
    cmd = [sys.executable, "run.py", f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**ENV, **(env or {})})


def kill_when(proc: subprocess.Popen, ready, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def comparable(rows: list) -> list:
    """Everything but timings and the engine-vs-trainer log-prob gap (float noise of the batch)."""
    return [{k: v for k, v in r.items()
             if not k.startswith(("perf/", "startup/")) and k != "train/train_rollout_logprob_abs_diff"} for r in rows]


def data_state(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "data_state.json").read_text())


def killed_driver(run_dir: Path) -> dict:
    lease = json.loads((run_dir / "driver.json").read_text())
    assert lease["ray_session_dir"] and Path(lease["ray_session_dir"]).is_dir()
    return lease


def check_same_run(d: Path, reference: Path, wandb_id: str, killed: dict) -> None:
    assert comparable(metrics(d)) == comparable(metrics(reference))
    assert data_state(d, 6) == data_state(reference, 6)
    assert (d / "wandb_run_id").read_text() == wandb_id
    assert all(p.name.endswith(wandb_id) for p in (d / "wandb").glob("offline-run-*"))
    assert not (d / "driver.json").exists()
    deadline = time.monotonic() + 20  # Ray's agents take a moment to exit after a clean shutdown
    while leftover_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not leftover_processes(), leftover_processes()
    # by the killed run's token or its Ray session's open files (Ray's renamed agents may show no token)
    assert processes_of_run(killed["token"], killed["ray_session_dir"]) == []


def test_killed_inside_a_save_resumes_from_the_previous_checkpoint(tmp_path, reference):
    d = tmp_path / "run"
    proc = start(d, *ARGS, env={"SLIME_HYDRA_TEST_PAUSE_IN_SAVE": "4:120"})
    kill_when(proc, lambda: (d / "checkpoints" / "step_000004.tmp" / "PAUSED").exists())
    ckpts = d / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_000002"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000002", "step_000004.tmp"]
    assert [r["step"] for r in metrics(d)] == [0, 1, 2, 3, 4]  # step 4's row was written, its checkpoint was not
    wandb_id, killed = (d / "wandb_run_id").read_text(), killed_driver(d)
    run(d, *ARGS, "trainer.resume=auto")
    assert [r["step"] for r in metrics(d)] == list(range(7))
    check_same_run(d, reference, wandb_id, killed)
    assert not (ckpts / "step_000004.tmp").exists()


@pytest.mark.slow
@pytest.mark.parametrize("when", ["mid_rollout", "just_after_a_save"])
def test_killed_anywhere_resumes_from_the_newest_checkpoint(tmp_path, reference, when):
    d = tmp_path / "run"
    proc = start(d, *ARGS)
    if when == "mid_rollout":  # step 3's rollout: after row 2 and its checkpoint
        kill_when(proc, lambda: (d / "checkpoints" / "latest").exists() and len(metrics(d)) >= 3)
    else:
        kill_when(proc, lambda: (d / "checkpoints" / "step_000004").exists())
    latest = (d / "checkpoints" / "latest").read_text()
    assert latest in ("step_000002", "step_000004")
    wandb_id, killed = (d / "wandb_run_id").read_text(), killed_driver(d)
    run(d, *ARGS, "trainer.resume=auto")
    check_same_run(d, reference, wandb_id, killed)
