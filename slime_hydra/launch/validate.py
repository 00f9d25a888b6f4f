"""Every component's config rules, run in a fixed order before Ray or any model starts (here, not in ``config``:
it imports every component)."""

from __future__ import annotations

from typing import List, Optional

from omegaconf import DictConfig

from slime_hydra.checkpoint import rules as checkpoint_rules
from slime_hydra.config import ConfigError, RunConfig, load, resolve
from slime_hydra.data import rules as data_rules
from slime_hydra.launch import rules as launch_rules
from slime_hydra.logging import rules as logging_rules
from slime_hydra.model import rules as model_rules
from slime_hydra.plan.fit import fit, suggestion
from slime_hydra.plan.memory import memory_problems
from slime_hydra.plan.resources import make_plan
from slime_hydra.rewards import rules as reward_rules
from slime_hydra.rollout import rules as rollout_rules
from slime_hydra.sync import rules as sync_rules
from slime_hydra.train import rules as trainer_rules
from slime_hydra.train.algorithms import rules as algorithm_rules

# model, run checkpoints, placement and loop, trainer, algorithm, rollout, data, sync, rewards, logging
RULES = [model_rules, checkpoint_rules, launch_rules, trainer_rules, algorithm_rules, rollout_rules, data_rules,
         sync_rules, reward_rules, logging_rules]


def validate(cfg: RunConfig) -> List[str]:
    """Every violation of the resolved ``cfg``; when the rules pass, the memory estimate must fit the GPUs."""
    problems = [problem for component in RULES for problem in component.check(cfg)]
    if not problems:
        plan = make_plan(cfg)
        problems = memory_problems(cfg, plan, cfg.parallelism.gpu_memory_gib)
        if problems and (fits := suggestion(cfg)):
            problems.append(f"trainer: {fits}")
    return problems


def check(cfg: DictConfig | RunConfig, notes: Optional[List[str]] = None) -> RunConfig:
    """load + resolve + fit (each choice left to the memory estimate appended to ``notes``) + validate; raises
    ConfigError with every violation."""
    run = resolve(load(cfg))
    choices = fit(run)
    if notes is not None:
        notes.extend(choices)
    if errs := validate(run):
        raise ConfigError(errs)
    return run
