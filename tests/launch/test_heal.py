"""Self-healing runs (``rollout.fault_tolerance``; slime_hydra/launch/heal.py, docs/faults.md): a part SIGKILLed
mid-run is rebuilt in the running process and the run computes what an uninterrupted run of the same seed
computes: each step's row once, the same rewards, the same data position.

Fast: an engine killed inside a weight push, a trainer rank killed mid-run, one short chaos run
(bench/chaos.py). Slow: the rollout manager and the router killed, a crash loop stopped by the budget."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.chaos import ARGS, Chaos, check, comparable, metrics, pids_of
from conftest import ROOT
from runs import ENV

pytestmark = pytest.mark.integration
STEPS = 12  # room for three kills before the run ends
RUN_ARGS = [*ARGS, f"trainer.num_rollout={STEPS}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run of the same seed."""
    d = tmp_path_factory.mktemp("reference") / "run"
    out = subprocess.run([sys.executable, "run.py", f"hydra.run.dir={d}", *RUN_ARGS], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return d


def start(d: Path, *extra: str, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "run.py", f"hydra.run.dir={d}", *RUN_ARGS, *extra], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**ENV, **(env or {})})


def kill_when(proc: subprocess.Popen, ready, part: str, d: Path, timeout: float = 600) -> int:
    deadline = time.monotonic() + timeout
    while not (ready() and pids_of(part, d)):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"the moment to kill the {part} never came"
        time.sleep(0.02)
    pid = pids_of(part, d)[0]
    os.kill(pid, signal.SIGKILL)
    return pid


def finished(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-5000:]
    return out


def same_run(d: Path, reference: Path) -> list:
    rows = metrics(d)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))  # each step once (row 0: the eval before training)
    assert comparable(rows) == comparable(metrics(reference))
    return rows


def heals(d: Path) -> list:
    path = d / "heal.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_engine_killed_inside_a_weight_push(tmp_path, reference):
    """The issue's failure (WeightSyncError ... pause_generation ... ConnectionResetError): the engine dies
    while the engines are paused for the push of v3. The push goes again to the engines running (none: the
    only engine restarts), the restarted engine gets v3 before it serves, and the run goes on."""
    d, hold = tmp_path / "run", tmp_path / "hold"
    hold.mkdir()
    proc = start(d, env={"SLIME_HYDRA_TEST_HOLD": "push:3", "SLIME_HYDRA_TEST_HOLD_DIR": str(hold)})
    kill_when(proc, (hold / "push_3").exists, "engine", d)
    (hold / "push_3.go").touch()
    out = finished(proc)
    assert "weight push v3 over distributed failed" in out and "pushing again" in out
    rows = same_run(d, reference)
    assert sum(r.get("rollout/engine_restarts", 0) for r in rows) == 1
    assert sum(r.get("heal/push_retries", 0) for r in rows) >= 1
    assert heals(d) == []  # the fleet healed it: nothing for the driver to rebuild


def test_trainer_rank_killed_mid_run(tmp_path, reference):
    """A trainer rank SIGKILLed after step 3's row: the group is built again, the checkpoint of step 2
    loaded, step 3 done again (its row written again) and the run goes on."""
    d = tmp_path / "run"
    proc = start(d)
    kill_when(proc, lambda: len(metrics(d)) >= 4, "trainer", d)  # rows 0-3: step 4 under way
    finished(proc)
    rows = same_run(d, reference)
    [h] = heals(d)
    assert (h["part"], h["rank"], h["resumed_at"]) == ("trainer", 0, 2) and h["steps_redone"] >= 1
    assert sum(r.get("heal/trainer_restarts", 0) for r in rows) == 1
    assert sum(r.get("heal/seconds", 0) for r in rows) == pytest.approx(h["seconds"], abs=1e-3)


def test_a_dead_engine_fails_the_cache_flush_at_once(tmp_path):
    """An engine that died inside a push (after the pause, before the cache flush) fails the push at once.
    The flush asks an engine that refuses (a request still runs) again for up to a minute; it asked a dead
    one (connection refused) again too, so every engine death inside a push cost that minute (found by
    bench/heal_gpu.py --cpu: 61 s from the kill to the push's retry)."""
    import torch

    from slime_hydra.sync.sender import Endpoint, WeightSender
    from slime_hydra.utils.http import EngineUnreachable
    from slime_hydra.utils.proc import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    sender = WeightSender("disk", [Endpoint(url, 1)], torch.device("cpu"), 1, str(tmp_path), str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(EngineUnreachable):
        sender._flush_caches()
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_short_chaos_run(tmp_path, reference, seed):
    """Three kills of random parts (engine, router, manager, trainer rank, driver) at random moments."""
    d = tmp_path / "run"
    chaos = Chaos(d, 3, random.Random(f"test-{seed}"), STEPS, tmp_path / "hold")
    out = chaos.run(list(RUN_ARGS))
    result = check(d, metrics(reference), STEPS)
    assert len(out["kills"]) == 3, out
    assert (result["lost"], result["duplicated"], result["rows_equal"]) == ([], [], True), (out, result)


@pytest.mark.slow
@pytest.mark.parametrize("part", ["manager", "router"])
def test_rollout_side_killed_mid_rollout(tmp_path, reference, part):
    """The rollout manager actor (its engines and router die with it) or the router alone, killed while
    an engine serves a rollout: rebuilt / restarted, no step done twice, the same rows."""
    from bench.chaos import engine_busy

    d = tmp_path / "run"
    proc = start(d)
    kill_when(proc, lambda: len(metrics(d)) >= 3 and engine_busy(d), part, d)
    out = finished(proc)
    rows = same_run(d, reference)
    if part == "manager":
        [h] = heals(d)
        assert h["part"] == "manager" and h["steps_redone"] == 0
    else:
        assert "router restarted at" in (d / "logs" / "rollout_manager.log").read_text(), out[-3000:]
        assert sum(r.get("heal/router_restarts", 0) for r in rows) == 1


@pytest.mark.slow
def test_a_crash_loop_stops_at_the_budget(tmp_path):
    """trainer.max_restarts_per_hour=1: the second trainer death stops the run with an error naming the rank."""
    d = tmp_path / "run"
    proc = start(d, "trainer.max_restarts_per_hour=1", "trainer.num_rollout=30")
    kill_when(proc, lambda: len(metrics(d)) >= 2, "trainer", d)
    kill_when(proc, lambda: len(heals(d)) == 1, "trainer", d)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert "more than trainer.max_restarts_per_hour=1" in out and "trainer rank 0 died" in out, out[-3000:]


@pytest.mark.slow
def test_engine_frozen_inside_a_weight_push(tmp_path, reference):
    """A push that hangs (the engine SIGSTOPped while paused for the push of v3) ends at sync.push_timeout_s
    and counts as the engine's death: it fails its health check, is restarted, and gets the weights."""
    d, hold = tmp_path / "run", tmp_path / "hold"
    hold.mkdir()
    proc = start(d, "sync.push_timeout_s=5", env={"SLIME_HYDRA_TEST_HOLD": "push:3",
                                                  "SLIME_HYDRA_TEST_HOLD_DIR": str(hold)})
    deadline = time.monotonic() + 600
    while not ((hold / "push_3").exists() and pids_of("engine", d)):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(pids_of("engine", d)[0], signal.SIGSTOP)
    (hold / "push_3.go").touch()
    out = finished(proc)
    assert "failed its health check" in (d / "logs" / "rollout_manager.log").read_text(), out[-3000:]
    rows = same_run(d, reference)
    assert sum(r.get("rollout/engine_restarts", 0) for r in rows) == 1


@pytest.mark.slow
def test_trainer_rank_frozen_mid_step(tmp_path, reference):
    """A trainer rank that hangs (SIGSTOP) misses trainer.hang_timeout_s: the group is torn down and built
    again from the checkpoint, as for a dead rank."""
    d = tmp_path / "run"
    proc = start(d, "trainer.hang_timeout_s=20")
    deadline = time.monotonic() + 600
    while not (len(metrics(d)) >= 4 and pids_of("trainer", d)):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(pids_of("trainer", d)[0], signal.SIGSTOP)
    finished(proc)
    same_run(d, reference)
    [h] = heals(d)
    assert h["part"] == "trainer" and "trainer.hang_timeout_s=20" in h["reason"]
