"""One driver per run directory (slime_hydra/launch/lease.py): a live driver's directory is refused,
and the processes a killed driver left behind are killed by the next start."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from slime_hydra.launch.lease import LEASE_FILE, TOKEN_ENV, RunLease, _start_time, processes_of_run


def record(run_dir, pid: int, token: str = "t0ken", ray_session_dir=None) -> None:
    import socket

    lease = {"pid": pid, "start_time": _start_time(pid), "host": socket.gethostname(), "token": token,
             "ray_session_dir": ray_session_dir}
    (run_dir / LEASE_FILE).write_text(json.dumps(lease))


def _wait_until_named(pid: int, argv0: bytes, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read().split(b"\0")[0] == argv0:
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} was not named {argv0!r} within {timeout}s")


def test_a_live_driver_keeps_its_run_directory(tmp_path):
    other = subprocess.Popen(["sleep", "60"])
    try:
        record(tmp_path, other.pid)
        with pytest.raises(RuntimeError, match=f"another driver \\(pid {other.pid}\\) is running in {tmp_path}"):
            RunLease(str(tmp_path)).__enter__()
    finally:
        other.kill()
        other.wait()


def test_leftovers_of_a_killed_driver_are_killed_and_the_lease_is_released(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    record(tmp_path, dead.pid, token="abc123")
    leftover = subprocess.Popen(["sleep", "60"], env={**os.environ, TOKEN_ENV: "abc123"})
    bystander = subprocess.Popen(["sleep", "60"], env={**os.environ, TOKEN_ENV: "abc1234"})
    try:
        assert processes_of_run("abc123") == [leftover.pid]
        with RunLease(str(tmp_path)) as lease:
            assert leftover.wait(timeout=10) == -9
            assert bystander.poll() is None
            assert os.environ[TOKEN_ENV] == lease.token
            assert json.loads((tmp_path / LEASE_FILE).read_text())["pid"] == os.getpid()
        assert TOKEN_ENV not in os.environ and not (tmp_path / LEASE_FILE).exists()
    finally:
        for p in (leftover, bystander):
            p.kill()
            p.wait()


def test_a_driver_ending_kills_what_of_its_run_still_runs_but_its_wandb_service(tmp_path):
    """Ray's agents can outlive ``ray.shutdown()``; wandb's service, a child of the driver, is still
    writing its files and is left to finish."""
    with RunLease(str(tmp_path)):
        ray_like = subprocess.Popen(["sleep", "60"])  # inherits the run's token, as Ray's processes do
        wandb_like = subprocess.Popen(["bash", "-c", "exec -a wandb-core sleep 60"])
        _wait_until_named(wandb_like.pid, b"wandb-core")  # under load bash may not have exec'd yet
        spawner = subprocess.Popen(["bash", "-c", "while true; do sleep 60 & sleep 0.05; done"])
    try:
        assert ray_like.wait(timeout=10) == -9
        assert spawner.wait(timeout=10) == -9
        assert wandb_like.poll() is None
    finally:
        for p in (ray_like, wandb_like, spawner):
            p.kill()
            p.wait()


def test_a_process_whose_environment_was_wiped_is_known_by_its_ray_session_files(tmp_path):
    """Ray's agents rename themselves with setproctitle, which can wipe the environment /proc shows
    (seen: ray::DashboardAgent left over with no token); they keep their logs open in the session dir."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    session = tmp_path / "session_2026_1"
    (session / "logs").mkdir(parents=True)
    (tmp_path / "session_2026_10").mkdir()  # another cluster's, whose name starts the same
    record(tmp_path, dead.pid, token="abc123", ray_session_dir=str(session))
    clean = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    agent = subprocess.Popen(["bash", "-c", f"exec 3>>{session}/logs/agent.log; exec sleep 60"], env=clean)
    other = subprocess.Popen(["bash", "-c", f"exec 3>>{tmp_path}/session_2026_10/x.log; exec sleep 60"], env=clean)
    try:
        deadline = 50
        while not processes_of_run("abc123", str(session)) and deadline:  # until bash has opened the file
            subprocess.run(["sleep", "0.1"])
            deadline -= 1
        assert processes_of_run("abc123", str(session)) == [agent.pid]
        with RunLease(str(tmp_path)):
            assert agent.wait(timeout=10) == -9
            assert other.poll() is None
    finally:
        for p in (agent, other):
            p.kill()
            p.wait()
