"""Config rules of the run's logging (``logging.*``)."""

from __future__ import annotations

from typing import List

from slime_hydra.config.rules import choice
from slime_hydra.config.schema import RunConfig

# auto: online with a WANDB_API_KEY, else offline (logging.metrics.RunLogger)
WANDB_MODES = ["auto", "online", "offline", "disabled"]


def check(cfg: RunConfig) -> List[str]:
    errs: List[str] = []
    choice(errs, "logging.wandb_mode", cfg.logging.wandb_mode, WANDB_MODES)
    return errs
