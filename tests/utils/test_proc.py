"""kill_tree stops a spawned process and its children, also those that ignore SIGTERM or outlive it; free_port
keeps out of the kernel's ephemeral range."""

from __future__ import annotations

import os
import random
import socket
import sys
import time

import pytest

from conftest import running
from slime_hydra.utils.proc import LOWEST_PORT, _ephemeral_low, free_port, kill_tree, spawn

# The parent starts a child that ignores SIGTERM and writes its pid, then waits (or exits at once).
CHILD = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('child', flush=True); time.sleep(600)"
)
PARENT = (
    "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', {child!r}]); "
    "print('pid', c.pid, flush=True); time.sleep({wait})"
)


def child_pid(log: str, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = open(log).read()
        if "child" in text:  # the child has set its SIGTERM handler
            return int(text.split("pid ")[1].split()[0])
        time.sleep(0.05)
    raise TimeoutError(open(log).read())


@pytest.mark.parametrize("parent_exits_first", [False, True])
def test_kill_tree_kills_children_that_ignore_sigterm(tmp_path, parent_exits_first):
    log = str(tmp_path / "proc.log")
    proc = spawn([sys.executable, "-c", PARENT.format(child=CHILD, wait=0 if parent_exits_first else 600)], log)
    pid = child_pid(log)
    if parent_exits_first:
        proc.wait(timeout=30)
    assert running(pid)
    t0 = time.monotonic()
    kill_tree(proc, timeout=1.0)
    took = time.monotonic() - t0
    assert not running(pid), f"child {pid} survived kill_tree"
    assert proc.returncode is not None
    assert 1.0 <= took < 5.0  # the grace period for the child, then SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)


def test_die_with_parent_kills_a_process_whose_parent_is_already_gone():
    """The parent it names is not its parent (the one it had died before it asked): it dies at once. Its real
    parent named: it carries on."""
    import subprocess
    import sys

    code = "import sys; from slime_hydra.utils.proc import die_with_parent; die_with_parent(int(sys.argv[1])); " \
           "print('carried on')"
    gone = subprocess.run([sys.executable, "-c", code, "1"], capture_output=True, text=True, timeout=60)
    assert gone.returncode == -9 and gone.stdout == ""
    kept = subprocess.run([sys.executable, "-c", code, str(os.getpid())], capture_output=True, text=True, timeout=60)
    assert kept.returncode == 0 and kept.stdout.strip() == "carried on"


def test_free_port_is_below_the_ephemeral_range_bindable_and_not_seeded():
    low = _ephemeral_low()
    assert low > LOWEST_PORT  # Linux's default range starts at 32768
    ports = []
    for _ in range(20):
        random.seed(0)  # a run seeds Python's generator the same in every process; the pick must not follow it
        ports.append(free_port())
    assert all(LOWEST_PORT <= p < low for p in ports)
    assert len(set(ports)) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_free_port_skips_a_port_in_use(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        picks = iter([busy, busy + 1 if busy + 1 < 65536 else busy - 1])
        monkeypatch.setattr("slime_hydra.utils.proc._PICK.randrange", lambda a, b: next(picks))
        monkeypatch.setattr("slime_hydra.utils.proc._ephemeral_low", lambda: 65535)
        assert free_port() != busy
