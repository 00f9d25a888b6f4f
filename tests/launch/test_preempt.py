"""Preemption (launch/preempt.py): SIGTERM or ``trainer.preempt_signal`` at any moment of a step saves the last
step done and exits with 128 + the signal; ``trainer.resume=auto`` then writes the rows an uninterrupted run of
the same seed writes. The stop says its line or two: no native stack dump, no traceback; nothing is left
running. A grace period too short to save says so and exits; the run still resumes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_kill_resume import comparable, start

from runs import leftover_processes, metrics, run

pytestmark = pytest.mark.integration
# no periodic save before the signal: what resumes is the preemption's save; enough steps that the signal lands
# before the last (a signal during the last step lets the run finish)
ARGS = ["trainer.num_rollout=12", "trainer.save_interval=0", "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
        "eval.interval=3", "logging.progress=false", "logging.wandb_mode=disabled"]
NOISE = ("Traceback", "*** SIGTERM", "*** SIGUSR1", "received at time", "PC: @")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("reference") / "run"
    run(d, *ARGS)
    return d


def preempt(d: Path, sig: signal.Signals, after_rows: int, delay: float, *overrides: str, env=None) -> tuple:
    """Start a run, send ``sig`` ``delay`` s after its ``after_rows``-th row; its exit status, output, seconds."""
    proc = start(d, *ARGS, *overrides, env=env)
    deadline = time.monotonic() + 300
    while not ((d / "metrics.jsonl").exists() and len(metrics(d)) >= after_rows):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.05)
    time.sleep(delay)
    proc.send_signal(sig)
    t0 = time.monotonic()
    out = proc.communicate(timeout=120)[0]
    return proc.returncode, out, time.monotonic() - t0


def check_quiet_and_clean(out: str) -> None:
    tail = out[out.index("preempted"):] if "preempted" in out else out
    assert not [n for n in NOISE if n in out], tail[-3000:]
    deadline = time.monotonic() + 10
    while leftover_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not leftover_processes(), leftover_processes()


@pytest.mark.parametrize("sig,after_rows,delay", [
    (signal.SIGTERM, 3, 0.0),  # as a row is written: the next rollout, or the eval and save of the step
    pytest.param(signal.SIGUSR1, 4, 0.1, marks=pytest.mark.slow),  # within a step: its rollout or training
    pytest.param(signal.SIGTERM, 2, 0.3, marks=pytest.mark.slow),
])
def test_preempted_run_saves_and_resumes_the_same_rows(tmp_path, reference, sig, after_rows, delay):
    d = tmp_path / "run"
    code, out, took = preempt(d, sig, after_rows, delay)
    assert code == 128 + sig, out[-3000:]
    summary = json.loads((d / "summary.json").read_text())
    done = summary["steps_done"]
    assert summary["status"] == "preempted" and summary["signal"] == sig.name and done >= after_rows - 1
    assert summary["checkpoint"] == f"step_{done:06d}" == (d / "checkpoints" / "latest").read_text()
    assert [r["step"] for r in metrics(d)] == list(range(done + 1))  # the rows of the steps saved, no more
    said = [line for line in out.splitlines() if f"{sig.name}: preempted" in line or f"by {sig.name}" in line]
    assert len(said) == 2 and said[-1].endswith(f"preempted by {sig.name}: step {done} saved (go on with "
                                                "trainer.resume=auto)"), out[-3000:]
    assert took < 60, f"the stop took {took:.0f}s"
    check_quiet_and_clean(out)
    run(d, *ARGS, "trainer.resume=auto")
    assert comparable(metrics(d)) == comparable(metrics(reference))


def test_a_grace_period_too_short_to_save_says_so_and_the_run_still_resumes(tmp_path, reference):
    d = tmp_path / "run"
    # the save of step 2 (its periodic one) takes 30 s; the grace is 1 s
    code, out, took = preempt(d, signal.SIGTERM, 3, 0.0, "trainer.save_interval=2", "trainer.preempt_grace_s=1",
                              env={"SLIME_HYDRA_TEST_PAUSE_IN_SAVE": "2:30"})
    assert code == 143 and took < 15, out[-3000:]
    assert "trainer.preempt_grace_s=1 ran out before the checkpoint was saved" in out.splitlines()[-1]
    check_quiet_and_clean(out)
    run(d, *ARGS, "trainer.resume=auto")
    assert comparable(metrics(d)) == comparable(metrics(reference))


def test_a_driver_killed_on_a_busy_machine_leaves_nothing_within_5_s(tmp_path):
    """Both cores spinning: the lease's watchdog kills the run's processes as soon as the driver is gone."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        d = tmp_path / "run"
        proc = start(d, *ARGS)
        deadline = time.monotonic() + 300
        while not ((d / "metrics.jsonl").exists() and len(metrics(d)) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.1)
        assert leftover_processes()
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while leftover_processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not leftover_processes(), leftover_processes()
    finally:
        for p in spin:
            p.kill()
            p.wait()
