"""The rollout manager's start-up, as the driver runs it (a Ray actor on a local cluster, a real
embedded engine and sglang-router): the router and the data load while the engine starts; a failure
on either side fails the start with its clear message and leaves no engine or router running."""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from pathlib import Path
from typing import List

import pytest
import ray

from conftest import resolved

pytestmark = pytest.mark.integration

SERVERS = ("sglang::router", "sglang_router", "rollout.engines.embedded.server")  # routers rename themselves


def servers(token: str) -> List[str]:
    """The command lines of the engine servers and routers of the run marked ``token``."""
    from slime_hydra.launch.lease import processes_of_run

    out = []
    for pid in processes_of_run(token):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # exited meanwhile
            continue
        if any(s in cmd for s in SERVERS):
            out.append(cmd)
    return out


def gone(token: str, timeout: float = 20.0) -> List[str]:
    """Waits until the run's servers have exited (a killed actor's server dies a moment later);
    returns those still running."""
    deadline = time.monotonic() + timeout
    while servers(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    return servers(token)


@contextlib.contextmanager
def start_manager(tmp_path, model_path, monkeypatch, overrides):
    """A rollout manager created as the driver creates it (an actor starting), its config and the token
    that marks the run's processes."""
    from slime_hydra.launch.cluster import create_placement_group, placed, ray_cluster
    from slime_hydra.launch.lease import TOKEN_ENV
    from slime_hydra.plan.resources import make_plan
    from slime_hydra.rollout.manager import FLEET_GROUP, RolloutManager

    token = uuid.uuid4().hex
    monkeypatch.setenv(TOKEN_ENV, token)  # ray_cluster gives it to every process of the run
    # a private cluster, even while another test's `ray start`-style cluster runs on this machine (ray.init()
    # would join that one, named in /tmp/ray/ray_current_cluster, and refuse num_cpus)
    monkeypatch.setenv("RAY_ADDRESS", "local")
    cfg = resolved(["logging.backends=[]", *overrides])
    cfg.output_dir = str(tmp_path)
    plan = make_plan(cfg)
    with ray_cluster(cfg, plan):
        pg = create_placement_group(plan)
        manager = ray.remote(num_cpus=0, concurrency_groups={FLEET_GROUP: 1})(RolloutManager).remote(
            cfg, placed(plan, pg), pg, model_path)
        yield manager, cfg, token


def manager_log(cfg) -> List[str]:
    return (Path(cfg.output_dir) / "logs" / "rollout_manager.log").read_text().splitlines()


def index(lines: List[str], pattern: str) -> int:
    found = [i for i, line in enumerate(lines) if re.search(pattern, line)]
    assert found, f"no line matches {pattern!r}:\n" + "\n".join(lines)
    return found[0]


def test_router_and_data_come_up_while_the_engine_starts(tmp_path, tiny_ckpt, monkeypatch):
    with start_manager(tmp_path, tiny_ckpt, monkeypatch, []) as (manager, cfg, token):
        (endpoint,) = ray.get(manager.endpoints.remote(), timeout=300)
        assert ray.get(manager.num_train_prompts.remote()) == cfg.data.num_train
        running = servers(token)
        assert len(running) == 2, running  # the check below that none is left sees them
        ray.get(manager.shutdown.remote(), timeout=60)
    lines = manager_log(cfg)
    engines = index(lines, r"1 embedded engine\(s\) up in [\d.]+s: \['" + re.escape(endpoint["url"]))
    data = index(lines, rf"data ready in [\d.]+s, while the engines start: {cfg.data.num_train} training prompts")
    router = index(lines, r"sglang-router at \S+ \(policy round_robin\) up in [\d.]+s")
    registered = index(lines, r"1 engine\(s\) registered with the router")
    up = index(lines, r"rollout side up in [\d.]+s")
    # the data loads after the engine's start began and is ready before it is up (so is the router:
    # ~1 s against the engine's ~7 s on 2 busy CPU cores); the engine joins the router once up
    assert data < engines and router < engines < registered < up, "\n".join(lines)
    assert gone(token) == []


@pytest.mark.parametrize("side", ["data", "engine"])
def test_a_failed_start_stops_everything_it_started(tmp_path, tiny_ckpt, monkeypatch, side):
    """A missing data file fails the start at once, before the engine is up; an engine that cannot
    start fails it with its log's tail. Either way no engine and no router keep running."""
    overrides = ["data=jsonl", f"data.path={tmp_path}/missing.jsonl"] if side == "data" else []
    model = tiny_ckpt if side == "data" else str(tmp_path / "no_such_model")
    with start_manager(tmp_path, model, monkeypatch, overrides) as (manager, cfg, token):
        with pytest.raises(ray.exceptions.RayActorError) as err:
            ray.get(manager.endpoints.remote(), timeout=300)
        assert gone(token) == []
    lines = manager_log(cfg)
    if side == "data":
        assert f"{tmp_path}/missing.jsonl" in str(err.value)
        assert not any("engine(s) up" in line for line in lines), "\n".join(lines)  # it did not wait for them
    else:
        assert "no_such_model" in str(err.value) and "last lines of" in str(err.value)
