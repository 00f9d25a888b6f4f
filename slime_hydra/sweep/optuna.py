"""``hparams_search=...`` / ``hydra/sweeper=slime_optuna``: hydra-optuna-sweeper's search made a sweep like the
others (validated first, concurrent on one cluster, reported, resumable), with pruning (prune.py). The corners of
the search space are validated before the first trial and each trial before it launches; an invalid trial or one
without a numeric objective is told FAIL; the study lives in sqlite in the sweep directory, so the same command
continues it; a new trial starts as soon as any ends."""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl, create_params_from_overrides
from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
from omegaconf import OmegaConf

from slime_hydra.sweep.compose import Job
from slime_hydra.sweep.flow import INTERRUPTED_SWEEP, check_resumable, finish, prepare, refuse_foreign_jobs
from slime_hydra.sweep.jobs import JobPruned, write_manifest
from slime_hydra.sweep.prune import storage_of

log = logging.getLogger(__name__)
logging.getLogger("alembic").setLevel(logging.WARNING)  # optuna's sqlite storage: one line per schema step


def corners(distributions: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Parameter sets that reach every parameter's extremes: all at their low, then each one at its high
    (a categorical parameter: each of its choices)."""
    def extremes(d) -> List[Any]:
        return list(d.choices) if hasattr(d, "choices") else [d.low, d.high]

    base = {name: extremes(d)[0] for name, d in distributions.items()}
    out = [base]
    for name, d in distributions.items():
        out += [{**base, name: v} for v in extremes(d)[1:]]
    return out


EVAL_METRICS = ("eval_reward_initial", "eval_reward_final")  # summary.json's held-out rewards: NaN without evals


def objective_problems(job: Job) -> List[str]:
    """Why a search's objective cannot exist for this job's config (a held-out reward without an eval set)."""
    cfg = job.cfg
    if cfg is None:
        return []
    metric = cfg.sweep.optimized_metric
    if metric in EVAL_METRICS and not cfg.eval.datasets:
        return [f"sweep.optimized_metric: {metric} (the search's objective) is a held-out reward, but "
                f"eval.datasets is empty, so no trial would have one: name an eval set "
                f"(eval.datasets=[{{name: ..., path: ...}}], conf/eval/jsonl.yaml) or optimize another summary "
                f"value (e.g. sweep.optimized_metric=train_reward_last)"]
    return []


def objective_values(value: Any, n_objectives: int) -> Tuple[Optional[List[float]], Optional[str]]:
    """A completed job's return value as the study's values, or (None, why not: not a number, NaN, or not one per
    objective; Optuna refuses NaN)."""
    raw = list(value) if n_objectives > 1 and isinstance(value, (list, tuple)) else [value]
    try:
        values = [float(v) for v in raw]
    except (TypeError, ValueError):
        return None, f"returned {value!r}, not a number"
    if len(values) != n_objectives:
        return None, f"returned {len(values)} value(s) for {n_objectives} objective(s)"
    if any(math.isnan(v) for v in values):
        return None, f"returned {value!r}"
    return values, None


class TrialBook:
    """Tells the study how each trial ended, and counts the failed ones (invalid, crashed, or without an
    objective) against ``max_failure_rate`` over all the trials this search ended (it has no batches)."""

    def __init__(self, study: Any, n_objectives: int, metric: str, max_failure_rate: float) -> None:
        self.study, self.n_objectives, self.metric = study, n_objectives, metric
        self.max_failure_rate = max_failure_rate
        self.ended = self.failed = 0
        self.no_objective: List[Tuple[int, str]] = []  # (trial number, why) of the jobs that ended ok

    def tell(self, trial: Any, ret: JobReturn) -> None:
        from optuna.trial import TrialState

        if ret.status == JobStatus.COMPLETED:
            values, why = objective_values(ret.return_value, self.n_objectives)
            if values is not None:
                return self._end(trial, False, values=values)
            why = f"sweep.optimized_metric={self.metric} {why}"
            log.warning("trial %d: %s: told FAIL", trial.number, why)
            self.no_objective.append((trial.number, why))
            self._end(trial, True, state=TrialState.FAIL)
        elif isinstance(ret._return_value, JobPruned):
            self._end(trial, False, state=TrialState.PRUNED)
        else:
            self._end(trial, True, state=TrialState.FAIL)

    def invalid(self, trial: Any) -> None:
        from optuna.trial import TrialState

        self._end(trial, True, state=TrialState.FAIL)

    def _end(self, trial: Any, failed: bool, **tell: Any) -> None:
        self.study.tell(trial, **tell)
        self.ended += 1
        self.failed += failed

    @property
    def too_many_failed(self) -> bool:
        return self.ended > 0 and self.failed / self.ended > self.max_failure_rate


class _Impl(OptunaSweeperImpl):
    def __init__(self, *args: Any, pruner: Optional[Any] = None) -> None:
        super().__init__(*args)
        self.pruner = pruner

    def _trials_before(self) -> int:
        """Trials that an earlier search of this study left in ``self.storage`` (0: a new study)."""
        import optuna

        if self.storage is None or self.study_name is None:  # in memory, or a name optuna makes up: a new study
            return 0
        url = str(self.storage)
        if url.startswith("sqlite:///") and not os.path.exists(url[len("sqlite:///"):]):
            return 0  # no database yet (nor, maybe, its folder: a dry run writes none)
        try:
            study = optuna.load_study(study_name=self.study_name, storage=storage_of(self.storage))
        except KeyError:  # no such study yet
            return 0
        return len(study.get_trials(deepcopy=False))

    def sweep(self, arguments: List[str]) -> None:
        import optuna
        from optuna.trial import TrialState

        from slime_hydra.sweep.compose import compose

        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        check_resumable(self.config)
        self._process_searchspace_config()
        params_conf = self._parse_sweeper_params_config()
        params_conf.extend(arguments)
        distributions, fixed = create_params_from_overrides(params_conf)
        distributions = {k: v for k, v in {**(self.search_space_distributions or {}), **distributions}.items()
                         if k not in fixed}
        probes = [tuple(f"{k}={v}" for k, v in {**p, **fixed}.items()) for p in corners(distributions)]
        jobs = compose(self.hydra_context, self.config, list(enumerate(probes)))
        for job in jobs:
            job.problems += objective_problems(job)
        sweep_dir = str(self.config.hydra.sweep.dir)
        new_study = not self._trials_before()
        if new_study:  # its directory must hold no other sweep's jobs (checked before anything starts or is written)
            refuse_foreign_jobs(sweep_dir, [], f"study {self.study_name} in {self.storage} is a new one")
        prepare(self, jobs)
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
        if new_study:
            write_manifest(sweep_dir, [], append=False)
        log.info("study %s in %s: %d trial(s) done, %d to go", study.study_name, self.storage, done, to_go)
        if self.pruner is not None:
            pruner = self.pruner  # Hydra instantiated it with the sweeper; else a config to instantiate in the job
            if OmegaConf.is_config(pruner):
                pruner = OmegaConf.to_container(pruner, resolve=True)
            self.launcher.prune = {"pruner": pruner, "study_name": study.study_name, "storage": self.storage}
        book = TrialBook(study, len(directions), str(self.config.sweep.optimized_metric), self.max_failure_rate)
        ran, returns = [], []
        running: Dict[Any, Any] = {}  # future -> (trial, job)
        self.launcher.begin()
        try:
            while to_go > 0 or running:
                while to_go > 0 and len(running) < self.n_jobs and self.launcher.preempted is None:  # a free slot
                    trial = study.ask()
                    to_go -= 1
                    overrides = list(self._configure_trials([trial], distributions, fixed)[0])
                    job = compose(self.hydra_context, self.config, [(trial.number, overrides)])[0]
                    job.problems += objective_problems(job)
                    if job.problems:
                        log.warning("%s is invalid, told FAIL: %s", job.label(), "; ".join(job.problems))
                        book.invalid(trial)
                        to_go = self._stop_if_too_many_failed(book, to_go, running)
                        continue
                    if job.dir:
                        write_manifest(sweep_dir, [job.dir], append=True)
                    running[self.launcher.submit(job.num, overrides)] = (trial, job, overrides)
                if not running:
                    break
                done, _ = concurrent.futures.wait(list(running), return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    trial, job, overrides = running.pop(future)
                    ret = self.launcher.result(future, job.num, overrides)
                    book.tell(trial, ret)
                    ran.append(job)
                    returns.append(ret)
                    to_go = self._stop_if_too_many_failed(book, to_go, running)
        except KeyboardInterrupt as e:
            setattr(e, INTERRUPTED_SWEEP, sweep_dir)  # run.py's advice: the same command goes on with the study
            raise
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
        elif not complete:
            log.warning("no trial of study %s completed with an objective: no optimization_results.yaml",
                        study.study_name)
        by_num = {j.num: j for j in ran}  # the jobs that ended ok but whose trial failed (no objective), with why
        finish(self, ran, returns, also_failed=[(by_num[n], why) for n, why in book.no_objective if n in by_num])

    def _stop_if_too_many_failed(self, book: TrialBook, to_go: int, running: Dict[Any, Any]) -> int:
        """The trials still to ask for: none once the failed ones are past ``max_failure_rate``."""
        if to_go > 0 and book.too_many_failed:
            log.error("%d of the %d trial(s) ended so far failed, more than max_failure_rate=%s: no new trial "
                      "starts (%d left not run%s)", book.failed, book.ended, self.max_failure_rate, to_go,
                      f"; waiting for the {len(running)} running" if running else "")
            return 0
        return to_go


class SlimeOptunaSweeper(OptunaSweeper):
    """hydra-optuna-sweeper's configuration, plus ``pruner``."""

    def __init__(self, sampler: Any, direction: Any, storage: Optional[Any], study_name: Optional[str], n_trials: int,
                 n_jobs: int, max_failure_rate: float = 1.0, search_space: Optional[Any] = None,
                 custom_search_space: Optional[str] = None, params: Optional[Any] = None,
                 pruner: Optional[Any] = None) -> None:
        self.sweeper = _Impl(sampler, direction, storage, study_name, n_trials, n_jobs, max_failure_rate, search_space,
                             custom_search_space, params, pruner=pruner)
