"""``hydra/sweeper=slime``: Hydra's basic sweeper (every combination of the ``-m`` values), which first
composes and validates every job (compose.py), then runs them all in one launch (launcher.py), so that
``sweep.max_concurrent`` of them run at any time; and resumes a sweep (``sweep.resume=true``)."""

from __future__ import annotations

import logging
import os
from typing import Any, List, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from slime_hydra.sweep import flow
from slime_hydra.sweep.compose import compose
from slime_hydra.sweep.jobs import write_manifest

log = logging.getLogger(__name__)


class SlimeSweeper(BasicSweeper):
    """``optuna``: hydra-optuna-sweeper's settings: an Optuna search over ``params`` (optuna.py) instead (one
    sweeper for both: Hydra 1.3 lets the root config's ``hydra/sweeper`` win over an ``hparams_search`` preset's)."""

    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[Any] = None,
                 optuna: Optional[Any] = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.optuna = None
        if optuna is not None:
            from slime_hydra.sweep.optuna import OptunaSettings

            self.optuna = OptunaSettings.of(optuna)

    def sweep(self, arguments: List[str]) -> Any:
        if self.optuna is not None:
            from slime_hydra.sweep.optuna import search

            return search(self, self.optuna, arguments)
        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        flow.check_resumable(self.config)
        params_conf = self._parse_config()
        params_conf.extend(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        batches = self.split_arguments(parser.parse_overrides(params_conf), None)
        overrides = [list(o) for batch in batches for o in batch]
        composed = compose(self.hydra_context, self.config, list(enumerate(overrides)))
        sweep_dir = str(self.config.hydra.sweep.dir)
        resume = bool(self.config.sweep.resume)
        if not resume:
            flow.refuse_foreign_jobs(sweep_dir, [j.dir for j in composed if j.dir], "this sweep is a new one")
        jobs = flow.prepare(self, composed)
        os.makedirs(sweep_dir, exist_ok=True)
        OmegaConf.save(self.config, os.path.join(sweep_dir, "multirun.yaml"))
        write_manifest(sweep_dir, [j.dir for j in jobs if j.dir], append=resume)
        todo = flow.resume_plan(self.config, jobs, {j.num: overrides[j.num] for j in jobs})
        with flow.naming_the_sweep(sweep_dir):
            returns = flow.launch(self.launcher, todo)
        ran = {num for num, _ in todo}
        flow.finish(self, [j for j in jobs if j.num in ran], returns)
        return [returns]


