"""Child processes (engine servers, the router) that never outlive their owner, and small
networking helpers."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

import httpx

_PR_SET_PDEATHSIG = 1
HOST_ENV = "SLIME_HYDRA_HOST"  # set by launch.cluster for a one-machine cluster: 127.0.0.1
_PICK = random.SystemRandom()  # not the run's seeded generator: seeded processes would all pick the same port
LOWEST_PORT = 20000  # above Ray's worker ports (10002-19999 by default)


def die_with_parent(parent: Optional[int] = None) -> None:
    """Have the kernel SIGKILL this process when its parent's starting thread exits (a parent killed outright
    runs no clean-up). ``parent``: the pid the parent had; if it already died, this process dies now."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def _die_with_parent(parent: int) -> None:  # runs in the child between fork and exec
    os.setsid()  # own process group: kill_tree() reaches its children too
    die_with_parent(parent)


def spawn(cmd: List[str], log_path: str, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    """Start ``cmd`` with output to ``log_path``; the child is killed if this process dies."""
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    log = open(log_path, "ab")
    parent = os.getpid()
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            preexec_fn=lambda: _die_with_parent(parent))


def kill_tree(proc: Optional[subprocess.Popen], timeout: float = 5.0) -> None:
    """SIGTERM the child's process group (``spawn`` makes it a leader), wait up to ``timeout``, then SIGKILL
    what is left of it, even when the child itself has exited: its own children can outlive it."""
    if proc is None:
        return
    _kill_group(proc.pid, signal.SIGTERM)
    _wait_group(proc, timeout)
    _kill_group(proc.pid, signal.SIGKILL)
    _wait_group(proc, 5.0)  # until the kernel has carried the SIGKILL out
    proc.wait()


def _wait_group(proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (proc.poll() is None or _group_running(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies do not count: orphans are not always reaped)."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except FileNotFoundError:  # no procfs: ask the kernel, which counts zombies too
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        state, _ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]  # the fields after "pid (comm) "
        if state != "Z" and int(pgrp) == pgid:
            return True
    return False


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing on ``host`` is bound to now, for a server started next; from below the kernel's ephemeral
    range when there is room, where an outgoing connection cannot take it before the server binds it."""
    low = _ephemeral_low()
    for _ in range(64 if low > LOWEST_PORT else 0):
        port = _PICK.randrange(LOWEST_PORT, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """The address this node's servers bind and others reach them at: ``$SLIME_HYDRA_HOST``, else Ray's."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def tail(path: str, n: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def wait_http(url: str, proc: Optional[subprocess.Popen], timeout: float, log_path: str = "",
              interval: float = 0.2) -> None:
    """Poll ``url`` until it answers 200; fail early (with the log's tail) if ``proc`` exits."""
    deadline, last = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before {url} was ready; "
                               f"last lines of {log_path}:\n{tail(log_path)}")
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(interval)
    raise TimeoutError(f"{url} not ready after {timeout:.0f}s ({last}); last lines of {log_path}:\n{tail(log_path)}")
