"""One driver per run directory, and no processes left over from a driver that was killed.

The driver records a fresh token (in its environment and Ray's, so every process of the run inherits it), its
pid and the Ray session directory (Ray's agents can wipe their environment but keep its logs open) in
``<run dir>/driver.json``. The next start there kills whatever carries the token or holds a session file open
(a driver still alive is an error); a driver that ends normally kills what of its run outlived Ray's shutdown;
a watchdog in its own session kills the run's processes as soon as the driver dies without ending (SIGKILL)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Callable, List, Optional

log = logging.getLogger(__name__)

TOKEN_ENV = "SLIME_HYDRA_RUN_TOKEN"
LEASE_FILE = "driver.json"


def _stat(pid: int) -> Optional[List[str]]:
    """The fields of ``/proc/<pid>/stat`` after the command (state, parent, ...); None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (tells a pid from a later reuse of it); None: a zombie."""
    fields = _stat(pid)
    return None if fields is None or fields[0] == "Z" else fields[19]


def driver_alive(lease: dict) -> bool:
    """Whether the driver a lease file names (its pid and start time, on this host) still runs."""
    return lease.get("start_time") is not None and _start_time(lease["pid"]) == lease["start_time"]


def _holds_file_under(pid: str, directory: str) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(directory):
                return True
    return False


def processes_of_run(token: str, ray_session_dir: Optional[str] = None) -> List[int]:
    """Live processes of this machine but this one whose environment holds ``TOKEN_ENV=token`` or that hold a
    file under ``ray_session_dir`` open."""
    needle = f"{TOKEN_ENV}={token}".encode()
    session = os.path.join(ray_session_dir, "") if ray_session_dir else None
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        ours = needle in env.split(b"\0") or (session is not None and _holds_file_under(pid, session))
        if ours and _start_time(int(pid)) is not None:
            out.append(int(pid))
    return out


def own_child(name: bytes) -> Callable[[int], bool]:
    """For ``reap(spare=...)``: is ``pid`` a child of this process whose command line contains ``name``."""
    def test(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                fields = _stat(pid)
                return fields is not None and int(fields[1]) == os.getpid() and name in f.read()
        except OSError:
            return False
    return test


def reap(token: str, ray_session_dir: Optional[str] = None, timeout: float = 10.0,
         spare: Optional[Callable[[int], bool]] = None) -> List[int]:
    """SIGKILL every process of the run but those ``spare`` keeps (e.g. ``own_child(b"wandb")``, still writing);
    their pids, once gone. Kills again until a pass finds none: a dying raylet may fork meanwhile."""
    def targets() -> List[int]:
        return [p for p in processes_of_run(token, ray_session_dir) if not (spare and spare(p))]

    killed: List[int] = []
    deadline = time.monotonic() + timeout
    while (pids := targets()) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed += [p for p in pids if p not in killed]
        time.sleep(0.1)
    return killed


def wait_for_exit(pid: int, start_time: Optional[str]) -> None:
    """Return once process ``pid`` (started at ``start_time``, see ``_start_time``) has exited."""
    try:
        fd = os.pidfd_open(pid)  # readable once the process exits: no polling
    except (AttributeError, OSError):
        fd = None
    if fd is not None and _start_time(pid) == start_time:
        select.select([fd], [], [])
        os.close(fd)
    while _start_time(pid) == start_time:  # no pidfd (or a zombie not yet reaped): poll
        time.sleep(0.2)


def start_watchdog(module: str, *args: str) -> subprocess.Popen:
    """``python -m module <this pid> <its start time> *args`` in a session of its own (a signal to this process
    group does not reach it), without the run's token (its reap must not kill it)."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    return subprocess.Popen([sys.executable, "-m", module, str(os.getpid()), str(_start_time(os.getpid())), *args],
                            env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def stop_watchdog(proc: Optional[subprocess.Popen]) -> None:
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


class RunLease:
    """``with RunLease(run_dir):`` around a driver's work (see the module docstring)."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LEASE_FILE)
        self.token = uuid.uuid4().hex
        self.ray_session_dir: Optional[str] = None
        self.watchdog: Optional[subprocess.Popen] = None

    def __enter__(self) -> "RunLease":
        self._reap_previous()
        os.environ[TOKEN_ENV] = self.token
        self._write()
        self.watchdog = start_watchdog("slime_hydra.launch.lease", self.path, self.token)
        return self

    def note_ray_session(self, ray_session_dir: Optional[str]) -> None:
        """The local Ray cluster's session directory (None: a joined cluster, not ours to kill)."""
        self.ray_session_dir = ray_session_dir
        self._write()

    def _write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "start_time": _start_time(os.getpid()), "host": socket.gethostname(),
                       "token": self.token, "ray_session_dir": self.ray_session_dir}, f)
        os.replace(tmp, self.path)

    def __exit__(self, *exc) -> None:
        # Ray is shut down by now; its agents can take long to notice (seconds under load): end them
        late = reap(self.token, self.ray_session_dir, timeout=5.0, spare=own_child(b"wandb"))
        if late:
            log.info("killed %d process(es) of this run still running after the shutdown: %s", len(late), late)
        os.environ.pop(TOKEN_ENV, None)
        stop_watchdog(self.watchdog)
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)

    def _reap_previous(self) -> None:
        try:
            with open(self.path) as f:
                prev = json.load(f)
        except (FileNotFoundError, ValueError):
            return
        if prev.get("host") != socket.gethostname():
            log.warning("%s was written by a driver on %s; its processes there cannot be checked from here",
                        self.path, prev.get("host"))
            return
        if driver_alive(prev) and prev["pid"] != os.getpid():
            raise RuntimeError(f"another driver (pid {prev['pid']}) is running in {os.path.dirname(self.path)}; "
                               "stop it first, or use another run directory")
        pids = reap(prev["token"], prev.get("ray_session_dir"))
        if pids:
            log.warning("killed %d leftover process(es) of the previous driver of this run directory (pid %d): %s",
                        len(pids), prev["pid"], pids)


def watch(driver: int, driver_start: str, lease_path: str, token: str) -> None:
    """The watchdog: once the driver is gone without ending its lease, kill its run's processes."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the driver's clean end
    wait_for_exit(driver, driver_start)
    try:
        with open(lease_path) as f:
            lease = json.load(f)
    except (OSError, ValueError):
        lease = {}
    if lease.get("token") == token:
        reap(token, lease.get("ray_session_dir"))


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
