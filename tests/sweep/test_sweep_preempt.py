"""A sweep preempted (SIGTERM to its process) or stopped with Ctrl-C stops every job within 10 s, quietly;
preempted jobs save, and ``sweep.resume=true`` continues them from their saves, no step lost or repeated."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from sweep_helpers import ENV, FAST, ROOT, leftover_processes, metrics, sweep, table

pytestmark = pytest.mark.integration
ARGS = ["seed=1,2", "trainer.num_rollout=6", "trainer.save_interval=0", "eval.interval=0", "sweep.max_concurrent=2",
        "logging.wandb_mode=disabled", *FAST]
NOISE = ("Traceback", "received at time", "PC: @", "UserWarning")


def stop_when_both_run(d, sig: int, group: bool = False) -> tuple:
    proc = subprocess.Popen([sys.executable, "run.py", "-m", *ARGS, f"hydra.sweep.dir={d}"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 400
    while sum(len(metrics(j)) >= 2 for j in d.glob("*/") if (j / "metrics.jsonl").exists()) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    (os.killpg if group else os.kill)(proc.pid, sig)
    t0 = time.monotonic()
    out = proc.communicate(timeout=120)[0]
    return proc.returncode, out, time.monotonic() - t0


def test_a_preempted_sweep_saves_every_job_and_resumes_them(tmp_path):
    d = tmp_path / "sweep"
    code, out, took = stop_when_both_run(d, signal.SIGTERM)
    assert code == 143 and took < 10, f"{took:.1f}s\n{out[-3000:]}"
    assert not [n for n in NOISE if n in out], out[-3000:]
    assert out.splitlines()[-1] == ("preempted by SIGTERM: the jobs saved (go on with the same command and "
                                    f"sweep.resume=true hydra.sweep.dir={d})")
    assert [r["status"] for r in table(d)] == ["preempted", "preempted"]
    saved = {j.name: (j / "checkpoints" / "latest").read_text() for j in d.glob("*/") if (j / "metrics.jsonl").exists()}
    assert all(v >= "step_000001" for v in saved.values()) and len(saved) == 2, saved
    time.sleep(2)
    assert not leftover_processes(), leftover_processes()
    res = sweep(d, *ARGS, "sweep.resume=true", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["status"] for r in table(d)] == ["ok", "ok"]
    for name in saved:
        assert f"resumed from {d / name / 'checkpoints' / saved[name]}" in (d / name / "run.log").read_text()
        assert [r["step"] for r in metrics(d / name)] == list(range(1, 7))  # no step lost or repeated
    assert not leftover_processes(), leftover_processes()


@pytest.mark.slow
def test_ctrl_c_stops_a_two_job_sweep_within_10_s(tmp_path):
    d = tmp_path / "sweep"
    code, out, took = stop_when_both_run(d, signal.SIGINT, group=True)  # a terminal's Ctrl-C: the process group
    assert code == 130 and took < 10, f"{took:.1f}s\n{out[-3000:]}"
    assert not [n for n in NOISE if n in out], out[-3000:]
    assert [r["status"] for r in table(d)] == ["interrupted", "interrupted"]
    time.sleep(2)
    assert not leftover_processes(), leftover_processes()
