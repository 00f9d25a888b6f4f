"""Shared fixtures: composed configs, a tiny random checkpoint, a running embedded engine."""

from __future__ import annotations

import _posixsubprocess
import os
import sys
from pathlib import Path
from typing import List
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


# Fixtures that start a process (a server, sglang's parser): a test that uses one is in the integration tier.
PROCESS_FIXTURES = {"engine_url", "sglang"}


def pytest_collection_modifyitems(items):
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The unit tier (`make test`) starts no process, no Ray cluster and no server, in a test or in its fixtures:
    a test that does is marked ``integration`` (or ``slow``), and an unmarked one that tries fails, saying so."""
    if any(item.get_closest_marker(m) for m in ("integration", "slow", "learning_run")):
        yield
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{item.nodeid} starts a process: mark it @pytest.mark.integration "
                           "(make test runs the unit tier: no Ray, no subprocess)")

    with mock.patch.object(_posixsubprocess, "fork_exec", refuse), mock.patch.object(os, "fork", refuse):
        yield


def running(pid: int) -> bool:
    """Whether process ``pid`` runs: an orphan that no init has reaped yet is a zombie, and does not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def compose(overrides: List[str] = ()):
    """The run config as ``python run.py <overrides>`` would compose it (a DictConfig)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from slime_hydra.config.store import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


def resolved(overrides: List[str] = ()):
    from slime_hydra.config import load, resolve
    from slime_hydra.plan.fit import fit

    cfg = resolve(load(compose(overrides)))
    fit(cfg)
    return cfg


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    """The embedded default's tiny model with random weights, saved as a Hugging Face checkpoint."""
    from slime_hydra.model.hf import build_random_checkpoint

    cfg = resolved()
    return build_random_checkpoint(cfg.model, str(tmp_path_factory.mktemp("ckpt") / "tiny"))


@pytest.fixture(scope="module")
def engine_url(tiny_ckpt, tmp_path_factory):
    """A running embedded engine server (the command line the engine actor builds for it)."""
    from slime_hydra.rollout.engines import ServerSpec
    from slime_hydra.rollout.engines.embedded import EmbeddedEngine
    from slime_hydra.utils.proc import free_port, kill_tree, spawn, wait_http

    spec = ServerSpec(engine="embedded", model_path=tiny_ckpt, tokenizer_path=tiny_ckpt, dtype="float32",
                      device="cpu", gpus=1, seed=0, num_threads=1, memory_saver=True)
    port = free_port()
    log = str(tmp_path_factory.mktemp("engine") / "engine.log")
    proc = spawn(EmbeddedEngine(spec).command("127.0.0.1", port), log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health_generate", proc, 120, log)
        yield url
    finally:
        kill_tree(proc)
