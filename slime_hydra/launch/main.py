"""Entry point behind ``run.py``: validate everything, plan, then (unless ``dry_run``) train."""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import time
from typing import Any, Dict, Optional

from omegaconf import DictConfig, OmegaConf

from slime_hydra.config import ConfigError
from slime_hydra.config.deferred import deferred_checks
from slime_hydra.launch.validate import check
from slime_hydra.plan.memory import GIB, machine_problems
from slime_hydra.plan.resources import make_plan
from slime_hydra.rollout.engines import engine_class

log = logging.getLogger("slime_hydra")
_first_run = True  # the first run of this process counts its start-up from the process's start (python run.py)


def run(dcfg: DictConfig, output_dir: str) -> Optional[Dict[str, Any]]:
    global _first_run
    from slime_hydra.launch.startup import StartupClock, process_started

    # a sweep's worker process runs job after job: the later ones start when they are called
    clock = StartupClock(process_started() if _first_run else time.time())
    _first_run = False
    choices: list = []
    deferred: list = []  # checks still running after validation, answered while the run starts (loop.train)
    try:
        dcfg.output_dir = output_dir  # validation reads trainer.resume=auto's checkpoint there
        with deferred_checks() as deferred:
            cfg = check(dcfg, notes=choices)
        if cfg.dry_run and (problems := [p for c in deferred for p in c.problems()]):
            raise ConfigError(problems)
        plan = make_plan(cfg)
        plan.notes += choices + engine_class(cfg.rollout.engine).plan_notes(cfg, plan)
        if cfg.dry_run:
            print(plan.describe())
            print("config is valid (dry_run=true: nothing started)")
            return None
        if plan.memory is not None:  # GPUs: this machine's memory and disk against the plan, before anything starts
            problems, warnings = machine_problems(plan, _host_gib(cfg), _disk_free_gib(output_dir))
            for w in warnings:
                log.warning("%s", w)
            if problems:
                raise ConfigError(problems)
    except ConfigError as e:
        for c in deferred:
            c.kill()
        log.error("%s", e)
        sys.exit(2)
    os.makedirs(output_dir, exist_ok=True)
    from slime_hydra.logging.secrets import redacted_config

    OmegaConf.save(OmegaConf.create(redacted_config(cfg)), os.path.join(output_dir, "config.yaml.tmp"))
    os.replace(os.path.join(output_dir, "config.yaml.tmp"), os.path.join(output_dir, "config.yaml"))
    log.info("run directory: %s", output_dir)
    log.info("%s", plan.describe())
    from slime_hydra.launch.loop import train

    try:
        summary = train(cfg, plan, clock, deferred)
    except ConfigError as e:  # a deferred check's problems, before a trainer started
        log.error("%s", e)
        sys.exit(2)
    log.info("done in %.0fs: %s over %d steps; %s/reward_curve.png", summary["wall_s"], rewards_said(summary),
             summary["steps"], output_dir)
    return summary


def rewards_said(summary: Dict[str, Any]) -> str:
    """The held-out reward's first and last values; the training reward's where no eval set ran."""
    if not math.isnan(summary["eval_reward_initial"]):
        return f"eval reward {summary['eval_reward_initial']:.3f} -> {summary['eval_reward_final']:.3f}"
    if summary["train_reward_first"] is None:
        return "no eval set ran and no training step"
    return (f"training reward {summary['train_reward_first']:.3f} -> {summary['train_reward_last']:.3f} (no held-out "
            "reward: no eval set ran, see eval.datasets)")


def _host_gib(cfg) -> Optional[float]:
    """This machine's memory, where a local Ray cluster puts the trainers; None when joining a cluster."""
    return None if cfg.cluster.address else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def _disk_free_gib(path: str) -> float:
    """Free space of the disk that holds ``path`` (or will: its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free / GIB
