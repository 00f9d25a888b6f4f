"""``hparams_search=...`` / ``hydra/sweeper=slime_optuna``: hydra-optuna-sweeper's search, made a sweep
like the others (validated first, concurrent on one cluster, reported, resumable) and with pruning.

hydra-optuna-sweeper asks Optuna for a batch of trials, launches them and tells Optuna each job's return
value (``sweep.optimized_metric`` of its summary). This subclass keeps its search space, samplers and
study handling, and changes its loop:
- before the first trial, the corners of the search space (each parameter's low and high, each choice)
  are composed and validated like a grid sweep's jobs, and a dry run prints their plans;
- trials are validated before they launch (an invalid one is told FAIL, not run);
- the study lives in sqlite in the sweep directory: the same command continues it, counting the trials
  already done towards ``n_trials`` (trials left running by a killed search are told FAIL);
- ``pruner`` (an Optuna pruner, e.g. MedianPruner): each trial's job reports its held-out reward to the
  study at every eval and stops when the pruner says so (``pruning_hook``); the trial is told PRUNED,
  its Ray resources go back to the cluster, and the report marks it ``pruned``. The plugin has no
  pruning hook of its own, so the job reaches the study itself (storage, study name and trial number).
- up to ``n_jobs`` trials run at once (= ``sweep.max_concurrent`` in the presets); the next trial is
  asked for as soon as any trial ends (the plugin asks for a batch and waits for all of it), so the
  bundles of a pruned trial go to a new trial at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Any, Dict, List, Optional

from hydra.core.utils import JobStatus
from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl, create_params_from_overrides
from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
from omegaconf import OmegaConf

from slime_hydra.sweep.flow import finish, prepare
from slime_hydra.sweep.jobs import JobPruned
from slime_hydra.sweep.prune import storage_of

log = logging.getLogger(__name__)
logging.getLogger("alembic").setLevel(logging.WARNING)  # optuna's sqlite storage: one line per schema step


def corners(distributions: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Parameter sets that reach every parameter's extremes: all at their low, then each one at its high
    (a categorical parameter: each of its choices)."""
    def extremes(d) -> List[Any]:
        if hasattr(d, "choices"):
            return list(d.choices)
        return [d.low, d.high]

    base = {name: extremes(d)[0] for name, d in distributions.items()}
    out = [base]
    for name, d in distributions.items():
        out += [{**base, name: v} for v in extremes(d)[1:]]
    return out


class _Impl(OptunaSweeperImpl):
    def __init__(self, *args: Any, pruner: Optional[Any] = None) -> None:
        super().__init__(*args)
        self.pruner = pruner

    def sweep(self, arguments: List[str]) -> None:
        import optuna
        from optuna.trial import TrialState

        from slime_hydra.sweep.compose import compose

        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        self._process_searchspace_config()
        params_conf = self._parse_sweeper_params_config()
        params_conf.extend(arguments)
        distributions, fixed = create_params_from_overrides(params_conf)
        distributions = {**(self.search_space_distributions or {}), **distributions}
        for name in fixed:
            distributions.pop(name, None)
        probes = [tuple(f"{k}={v}" for k, v in {**p, **fixed}.items()) for p in corners(distributions)]
        prepare(self, compose(self.hydra_context, self.config, list(enumerate(probes))))

        sweep_dir = str(self.config.hydra.sweep.dir)
        os.makedirs(sweep_dir, exist_ok=True)
        OmegaConf.save(self.config, os.path.join(sweep_dir, "multirun.yaml"))
        directions = self._get_directions()
        study = optuna.create_study(study_name=self.study_name, storage=storage_of(self.storage), sampler=self.sampler,
                                    directions=directions, load_if_exists=True)
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            log.warning("trial %d was left running by an interrupted search: told FAIL", t.number)
            study.tell(t.number, state=TrialState.FAIL)
        done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)))
        to_go = self.n_trials - done
        log.info("study %s in %s: %d trial(s) done, %d to go", study.study_name, self.storage, done, to_go)
        if self.pruner is not None:
            pruner = self.pruner  # Hydra instantiated it with the sweeper; else a config to instantiate in the job
            if OmegaConf.is_config(pruner):
                pruner = OmegaConf.to_container(pruner, resolve=True)
            self.launcher.prune = {"pruner": pruner, "study_name": study.study_name, "storage": self.storage}
        ran, returns = [], []
        running: Dict[Any, Any] = {}  # future -> (trial, job)
        self.launcher.begin()
        try:
            while to_go > 0 or running:
                while to_go > 0 and len(running) < self.n_jobs:  # a trial for every free slot
                    trial = study.ask()
                    to_go -= 1
                    overrides = list(self._configure_trials([trial], distributions, fixed)[0])
                    job = compose(self.hydra_context, self.config, [(trial.number, overrides)])[0]
                    if job.problems:
                        log.warning("%s is invalid, told FAIL: %s", job.label(), "; ".join(job.problems))
                        study.tell(trial, state=TrialState.FAIL)
                        continue
                    running[self.launcher.submit(job.num, overrides)] = (trial, job, overrides)
                if not running:
                    break
                done, _ = concurrent.futures.wait(list(running), return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    trial, job, overrides = running.pop(future)
                    ret = self.launcher.result(future, job.num, overrides)
                    if ret.status == JobStatus.COMPLETED:
                        study.tell(trial, values=[float(ret.return_value)] if len(directions) == 1
                                   else [float(v) for v in ret.return_value])
                    elif isinstance(ret._return_value, JobPruned):
                        study.tell(trial, state=TrialState.PRUNED)
                    else:
                        study.tell(trial, state=TrialState.FAIL)
                    ran.append(job)
                    returns.append(ret)
        finally:
            self.launcher.end()
            self.launcher.close()
        complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if complete and len(directions) == 1:
            best = study.best_trial
            log.info("best trial %d: %s -> %s", best.number, best.params, best.value)
            OmegaConf.save(OmegaConf.create({"name": "optuna", "best_trial": best.number, "best_params": best.params,
                                             "best_value": best.value}),
                           os.path.join(sweep_dir, "optimization_results.yaml"))
        finish(self, ran, returns)


class SlimeOptunaSweeper(OptunaSweeper):
    """hydra-optuna-sweeper's configuration, plus ``pruner``."""

    def __init__(self, sampler: Any, direction: Any, storage: Optional[Any], study_name: Optional[str], n_trials: int,
                 n_jobs: int, max_failure_rate: float = 1.0, search_space: Optional[Any] = None,
                 custom_search_space: Optional[str] = None, params: Optional[Any] = None,
                 pruner: Optional[Any] = None) -> None:
        self.sweeper = _Impl(sampler, direction, storage, study_name, n_trials, n_jobs, max_failure_rate, search_space,
                             custom_search_space, params, pruner=pruner)
