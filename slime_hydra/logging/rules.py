"""Config rules of the run's logging (``logging.*``)."""

from __future__ import annotations

from typing import List

from slime_hydra.config.rules import choice
from slime_hydra.config.schema import RunConfig
from slime_hydra.logging import trackers

# auto: online with a WANDB_API_KEY, else offline (logging.trackers.Wandb)
WANDB_MODES = ["auto", "online", "offline", "disabled"]


def check(cfg: RunConfig) -> List[str]:
    errs: List[str] = []
    choice(errs, "logging.wandb_mode", cfg.logging.wandb_mode, WANDB_MODES)
    errs += trackers.problems(cfg)
    return errs
