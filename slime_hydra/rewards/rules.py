"""Config rules of the rewards: every reward type named in the config is in ``REWARD_TYPES``, each has
what it needs, and the custom hook imports."""

from __future__ import annotations

from typing import List

from slime_hydra.config.rules import choice, loads
from slime_hydra.config.schema import RunConfig
from slime_hydra.rewards import REWARD_TYPES
from slime_hydra.utils.hooks import load_hook


def check(cfg: RunConfig) -> List[str]:
    errs, rw = [], cfg.reward
    choice(errs, "reward.type", rw.type, REWARD_TYPES)
    for i, ds in enumerate(cfg.eval.datasets):
        if ds.reward != rw.type:  # set on the dataset itself (resolve fills the others with reward.type)
            choice(errs, f"eval.datasets[{i}].reward", ds.reward, REWARD_TYPES)
    if rw.type == "remote" and not rw.url:
        errs.append("reward.url: required for reward.type=remote")
    if rw.type == "custom" and rw.custom is None:
        errs.append("reward.custom: required for reward.type=custom (a _target_ node or a dotted path)")
    if rw.custom is not None:
        loads(errs, "reward.custom", lambda: load_hook(rw.custom))
    return errs
