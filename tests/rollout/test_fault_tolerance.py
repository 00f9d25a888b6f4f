"""Fault tolerance (``rollout.fault_tolerance``, slime_hydra/rollout/fleet.py): two embedded engines
behind the real router; one is SIGKILLed, or frozen with SIGSTOP, while it serves a rollout. The run
finishes with every group it promised (the data position shows no prompt lost or repeated), and its
metrics show the restart and the re-queued requests (one request per group: the default generate
function's groups go straight to an engine, and a dead engine's group is sent again to another). An agent's
sessions (``rollout.agent``) go on: their turns go through the router, and a dead engine's turn is sent again."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import ROOT
from runs import ENV, TAG, metrics

pytestmark = pytest.mark.integration
BATCH, N, STEPS = 8, 8, 4
ARGS = [f"trainer.num_rollout={STEPS}", "trainer.save_interval=0", f"rollout.batch_size={BATCH}",
        f"rollout.n_samples_per_prompt={N}", "rollout.max_response_len=32", "parallelism.rollout_gpus=2",
        "parallelism.gpus_per_node=3", "rollout.fault_tolerance=true", "rollout.health_check_interval_s=1",
        "rollout.health_check_timeout_s=10", "eval.interval=0", "eval.before_train=false", "logging.progress=false",
        "logging.backends=[]", "sync.max_logprob_diff=inf"]


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "run.py", f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)


def engine_servers() -> dict:
    """Running embedded servers of this module's runs: {pid: port}."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLIME_HYDRA_TEST_TAG={TAG}".encode() in env and b"slime_hydra.rollout.engines.embedded.server" in cmd:
            out[int(pid)] = int(cmd[cmd.index(b"--port") + 1])
    return out


def busy(port: int) -> bool:
    try:
        load = httpx.get(f"http://127.0.0.1:{port}/v1/loads", timeout=1).json()["loads"][0]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return load["num_reqs"] > 0


@pytest.mark.parametrize("fault, overrides", [
    pytest.param("kill", [], marks=pytest.mark.slow),  # 46 s; the fast suite kills engines in tests/launch/test_heal.py
    pytest.param("stop", [], marks=pytest.mark.slow),
    # the only engine of an async run: the rollout cannot go on until the trainers push, and they have
    # moved on by a step, so the rollout is generated again with the newer weights
    pytest.param("kill", ["parallelism.rollout_gpus=1", "trainer.mode=async"], marks=pytest.mark.slow,
                 id="async-only")])
def test_run_survives_an_engine_failure_mid_rollout(tmp_path, fault, overrides):
    d = tmp_path / "run"
    proc = start(d, *ARGS, *overrides)
    victim = {}

    def serving_a_rollout() -> bool:  # after the first step: the restarted engine must get trained weights
        if not (d / "metrics.jsonl").exists() or not metrics(d):
            return False
        servers = engine_servers()
        engines = 1 if "parallelism.rollout_gpus=1" in overrides else 2
        for pid, port in sorted(servers.items())[engines - 1:]:  # the last engine
            if len(servers) == engines and busy(port):
                victim.update(pid=pid, port=port)
                os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                return True
        return False

    wait_for(proc, serving_a_rollout)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-5000:]
    rows = metrics(d)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["rollout/samples"] == BATCH * N for r in rows)
    assert sum(r["rollout/engine_restarts"] for r in rows) >= 1  # more only if a busy engine missed a probe
    assert sum(r["rollout/requeued_requests"] for r in rows) >= 1
    if "trainer.mode=async" not in overrides:  # (there a rollout generated again counts its requests twice)
        assert [r["rollout/generate_requests"] for r in rows] == [BATCH] * STEPS  # one per group, re-queued too
    if "trainer.mode=async" in overrides:  # one step off-policy, or none for the rollout generated again
        assert max(r["rollout/staleness_max"] for r in rows) <= 1
    assert_restarted(d, victim, "exited with code -9" if fault == "kill" else "failed its health check")
    assert_every_prompt_once(d, BATCH)


TURNS = 4  # tests/fixtures/chat_agent.py's sessions


@pytest.mark.slow
@pytest.mark.parametrize("agent", [
    pytest.param(["rollout.max_response_len=12"], id="calculator"),  # most sessions are one turn
    pytest.param(["rollout.agent._target_=tests.fixtures.chat_agent.run", f"rollout.agent.max_turns={TURNS}",
                  "rollout.agent.turn_max_tokens=4"], id="multi-turn")])  # 28 tokens at most: within 32
def test_agent_sessions_survive_an_engine_kill_mid_rollout(tmp_path, agent):
    """``rollout.agent`` (the OpenAI-SDK calculator agent, or an agent whose every session has ``TURNS`` turns,
    killed while it serves the later turns): an engine SIGKILLed while it serves the sessions' turns. Each turn it
    was serving is re-queued and answered by the other engine, so the agents see no error: no sample fails or
    starts over, each session keeps its turns, and every sample of every step is trained."""
    d, mark = tmp_path / "run", tmp_path / "later_turn"
    multi = f"rollout.agent.max_turns={TURNS}" in agent
    proc = start(d, "experiment=calculator_agent", *ARGS, *agent, *[f"+rollout.agent.mark={mark}"] * multi)
    victim = {}

    def serving_a_turn() -> bool:  # after the first step, as above; a later turn: a session with turns behind it
        servers = engine_servers()
        if len(servers) != 2 or not (d / "metrics.jsonl").exists() or not metrics(d):
            return False
        if multi and not (mark.exists() and time.time() - mark.stat().st_mtime < 0.1):
            return False
        pid, port = max(servers.items())
        if busy(port):
            victim.update(pid=pid, port=port)
            os.kill(pid, signal.SIGKILL)
            return True
        return False

    wait_for(proc, serving_a_turn, poll_s=0.005)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-5000:]
    rows = metrics(d)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["rollout/samples"] == BATCH * N for r in rows)
    assert sum(r["rollout/engine_restarts"] for r in rows) >= 1
    assert sum(r["rollout/requeued_requests"] for r in rows) >= 1
    for what in ("agent_error", "agent_timeout", "agent_no_request", "agent_new_segment"):
        assert sum(r.get(f"rollout/{what}_count", 0) for r in rows) == 0, (what, out[-5000:])
    # each turn sent once (a re-queued one counts once), no session started over
    assert all(r["rollout/generate_requests"] == round(r["rollout/turns_mean"] * BATCH * N) for r in rows)
    if multi:  # every session went through all its turns
        assert all(r["rollout/turns_mean"] == TURNS for r in rows)
    assert_restarted(d, victim, "exited with code -9")
    assert_every_prompt_once(d, BATCH)


def wait_for(proc: subprocess.Popen, caught, poll_s: float = 0.02) -> None:
    """Poll ``caught()`` until it has struck (True); the run must not end first."""
    deadline = time.monotonic() + 300
    while not caught():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no rollout was caught in flight"
        time.sleep(poll_s)


def assert_restarted(d: Path, victim: dict, reason: str) -> None:
    """The manager's log names the victim's failure and its restart; its server is gone."""
    rank = next(int(p.stem.split("_")[1]) for p in (d / "logs").glob("engine_*.log")
                if f"--port {victim['port']} " in p.read_text().splitlines()[0])
    log = (d / "logs" / "rollout_manager.log").read_text()
    assert re.search(f"engine {rank} .*{reason}", log), log[-3000:]
    assert f"engine {rank} restarted at" in log
    assert victim["pid"] not in engine_servers()


def assert_every_prompt_once(d: Path, batch: int) -> None:
    state = json.loads((d / "checkpoints" / f"step_{STEPS:06d}" / "data_state.json").read_text())
    assert state["next_group_index"] == STEPS * batch  # no prompt lost or repeated
    assert json.loads((d / "summary.json").read_text())["steps"] == STEPS
