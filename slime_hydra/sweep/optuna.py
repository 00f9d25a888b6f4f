"""``hparams_search=...``: an Optuna search in hydra-optuna-sweeper's config shape (``hydra.sweeper.params`` in
Hydra's sweep syntax, ``hydra.sweeper.optuna``: sampler, direction, storage, study_name, n_trials, n_jobs,
max_failure_rate, pruner), made a sweep like the others (validated first, concurrent on one cluster, reported,
resumable), with pruning (prune.py). The corners of the search space are validated before the first trial and each
trial before it launches; an invalid trial or one without a numeric objective is told FAIL; the study lives in
sqlite in the sweep directory, so the same command continues it; a new trial starts as soon as any ends."""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import sys
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, Transformer
from hydra.core.utils import JobReturn, JobStatus
from hydra.utils import get_class, instantiate
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
        try:
            self.study.tell(trial, **tell)
        except RuntimeError as e:  # GridSampler stops the study once its grid is done: the trial is told anyway
            if "Study.stop" not in str(e):
                raise
        self.ended += 1
        self.failed += failed

    @property
    def too_many_failed(self) -> bool:
        return self.ended > 0 and self.failed / self.ended > self.max_failure_rate


@dataclass
class OptunaSettings:
    """``hydra.sweeper.optuna``: hydra-optuna-sweeper's keys, plus ``pruner``."""
    sampler: Any = None  # an optuna.samplers class as a _target_ node; None: TPE
    direction: Any = "maximize"  # or a list, one per objective
    storage: Optional[str] = None
    study_name: Optional[str] = None
    n_trials: int = 20
    n_jobs: int = 1
    max_failure_rate: float = 0.0
    pruner: Any = None  # an optuna.pruners class as a _target_ node; None: no pruning

    @classmethod
    def of(cls, node: Any) -> "OptunaSettings":
        given = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(given) - known):
            raise ValueError(f"hydra.sweeper.optuna: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**given)


def distribution(override: Override) -> Any:
    """A sweep override (``interval``: floats, ``tag(int, interval(...))``: ints; ``range``, ``choice``;
    ``tag(log, ...)``: on a log scale) as an Optuna distribution."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value = override.value()
    if override.is_interval_sweep():
        log_scale = "log" in value.tags
        if "int" in value.tags:
            return IntDistribution(int(value.start), int(value.end), log=log_scale)
        return FloatDistribution(float(value.start), float(value.end), log=log_scale)
    values = list(override.sweep_iterator(transformer=Transformer.encode))
    if override.is_range_sweep() and not value.shuffle:  # range(a, b, s): a, a+s, ... below b, as Hydra's range
        if all(isinstance(v, int) for v in (value.start, value.stop, value.step)):
            return IntDistribution(int(values[0]), int(values[-1]), step=int(value.step))
        last = round(float(values[-1]), 12)  # 0.1 + 2 * 0.1 is 0.30000000000000004
        return FloatDistribution(float(value.start), last, step=float(value.step))
    return CategoricalDistribution(values)


def search_space(params: List[str]) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """``key=value`` overrides as (distributions of the swept keys, the values of the fixed ones)."""
    dists, fixed = {}, {}
    for o in OverridesParser.create().parse_overrides(params):
        if o.is_sweep_override():
            dists[o.get_key_element()] = distribution(o)
        else:
            fixed[o.get_key_element()] = o.get_value_element_as_str()
    return {k: v for k, v in dists.items() if k not in fixed}, fixed


def grid(dists: Dict[str, Any]) -> Dict[str, List[Any]]:
    """GridSampler's search space: every value of each ``choice`` and ``range`` (an interval has no grid)."""
    from optuna.distributions import CategoricalDistribution

    out = {}
    for k, d in dists.items():
        if isinstance(d, CategoricalDistribution):
            out[k] = list(d.choices)
        elif d.step is None:
            raise ValueError(f"hydra.sweeper.params.{k}: GridSampler needs choice(...) or range(...), not an interval")
        else:
            n = round((d.high - d.low) / d.step)
            out[k] = [type(d.low)(d.low + i * d.step) for i in range(n + 1)]
    return out


def make_sampler(node: Any, dists: Dict[str, Any], trials_before: int = 0) -> Any:
    """The sampler of ``hydra.sweeper.optuna.sampler``; a GridSampler gets its grid from ``params``. A resumed
    study's sampler gets its seed moved on by the trials before, so that it does not draw the same trials again."""
    import optuna

    if node is None:
        return None
    if get_class(node["_target_"]) is optuna.samplers.GridSampler and "search_space" not in node:
        node = {**node, "search_space": grid(dists)}
    if trials_before and node.get("seed") is not None:
        node = {**node, "seed": int(node["seed"]) + trials_before}
    return instantiate(node)


def suggest(trial: Any, name: str, d: Any) -> Any:
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(d, CategoricalDistribution):
        return trial.suggest_categorical(name, d.choices)
    if isinstance(d, IntDistribution):
        return trial.suggest_int(name, d.low, d.high, step=d.step, log=d.log)
    return trial.suggest_float(name, d.low, d.high, step=d.step, log=d.log)


def directions(direction: Any) -> List[str]:
    return [str(d) for d in direction] if isinstance(direction, (list, tuple)) else [str(direction)]


def check_storage(url: Optional[str]) -> None:
    """A study database written by an older optuna (its schema needs an upgrade): exit 2 with the command that
    upgrades it, before anything starts."""
    import optuna

    if url is None or not url.startswith("sqlite:///") or not os.path.exists(url[len("sqlite:///"):]):
        return
    try:
        optuna.storages.RDBStorage(url)
    except RuntimeError as e:
        if "upgrade" not in str(e):
            raise
        print(f"hydra.sweeper.optuna.storage={url}: this study database was written by an older optuna, "
              f"whose schema optuna {optuna.__version__} cannot read ({e}). Upgrade it in place (back it up "
              f"first: older optuna cannot read it after): optuna storage upgrade --storage {url}",
              file=sys.stderr, flush=True)
        sys.exit(2)


def trials_before(settings: OptunaSettings) -> int:
    """Trials that an earlier search of this study left in its storage (0: a new study)."""
    import optuna

    url = settings.storage
    if url is None or settings.study_name is None:  # in memory, or a name optuna makes up: a new study
        return 0
    if url.startswith("sqlite:///") and not os.path.exists(url[len("sqlite:///"):]):
        return 0  # no database yet (nor, maybe, its folder: a dry run writes none)
    try:
        study = optuna.load_study(study_name=settings.study_name, storage=storage_of(url))
    except KeyError:  # no such study yet
        return 0
    return len(study.get_trials(deepcopy=False))


def search(sweeper: Any, settings: OptunaSettings, arguments: List[str]) -> None:
    """The search: ``sweeper`` is the slime sweeper (its config, launcher, Hydra context and ``params``)."""
    import optuna
    from optuna.trial import TrialState

    from slime_hydra.sweep.compose import compose

    config, launcher = sweeper.config, sweeper.launcher
    assert config is not None and launcher is not None and sweeper.hydra_context is not None
    check_resumable(config)
    distributions, fixed = search_space(sweeper._parse_config() + list(arguments))
    check_storage(settings.storage)
    before = trials_before(settings)
    sampler = make_sampler(settings.sampler, distributions, before)
    pruner = instantiate(settings.pruner) if settings.pruner else None
    probes = [tuple(f"{k}={v}" for k, v in {**p, **fixed}.items()) for p in corners(distributions)]
    jobs = compose(sweeper.hydra_context, config, list(enumerate(probes)))
    for job in jobs:
        job.problems += objective_problems(job)
    sweep_dir = str(config.hydra.sweep.dir)
    new_study = not before
    if new_study:  # its directory must hold no other sweep's jobs (checked before anything starts or is written)
        refuse_foreign_jobs(sweep_dir, [], f"study {settings.study_name} in {settings.storage} is a new one")
    prepare(sweeper, jobs)
    os.makedirs(sweep_dir, exist_ok=True)
    OmegaConf.save(config, os.path.join(sweep_dir, "multirun.yaml"))
    dirs = directions(settings.direction)
    study = optuna.create_study(study_name=settings.study_name, storage=storage_of(settings.storage),
                                sampler=sampler, pruner=pruner, directions=dirs, load_if_exists=True)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        log.warning("trial %d was left running by an interrupted search: told FAIL", t.number)
        study.tell(t.number, state=TrialState.FAIL)
    done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)))
    to_go = settings.n_trials - done
    if isinstance(sampler, optuna.samplers.GridSampler):  # every point once, then the search ends
        to_go = min(to_go, math.prod(len(v) for v in grid(distributions).values()) - done)
    if new_study:
        write_manifest(sweep_dir, [], append=False)
    log.info("study %s in %s: %d trial(s) done, %d to go", study.study_name, settings.storage, done, to_go)
    if settings.pruner:  # the jobs load the study with the pruner, and report to it at every eval
        launcher.prune = {"pruner": settings.pruner, "study_name": study.study_name, "storage": settings.storage}
    book = TrialBook(study, len(dirs), str(config.sweep.optimized_metric), settings.max_failure_rate)
    ran, returns = [], []
    running: Dict[Any, Any] = {}  # future -> (trial, job, overrides)

    def stop_if_too_many_failed(to_go: int) -> int:
        """The trials still to ask for: none once the failed ones are past ``max_failure_rate``."""
        if to_go > 0 and book.too_many_failed:
            log.error("%d of the %d trial(s) ended so far failed, more than max_failure_rate=%s: no new trial "
                      "starts (%d left not run%s)", book.failed, book.ended, settings.max_failure_rate, to_go,
                      f"; waiting for the {len(running)} running" if running else "")
            return 0
        return to_go

    launcher.begin()
    try:
        while to_go > 0 or running:
            while to_go > 0 and len(running) < settings.n_jobs and launcher.preempted is None:  # a free slot
                trial = study.ask()
                to_go -= 1
                values = {k: suggest(trial, k, d) for k, d in distributions.items()}
                overrides = [f"{k}={v}" for k, v in {**values, **fixed}.items()]
                job = compose(sweeper.hydra_context, config, [(trial.number, overrides)])[0]
                job.problems += objective_problems(job)
                if job.problems:
                    log.warning("%s is invalid, told FAIL: %s", job.label(), "; ".join(job.problems))
                    book.invalid(trial)
                    to_go = stop_if_too_many_failed(to_go)
                    continue
                if job.dir:
                    write_manifest(sweep_dir, [job.dir], append=True)
                running[launcher.submit(job.num, overrides)] = (trial, job, overrides)
            if not running:
                break
            ended, _ = concurrent.futures.wait(list(running), return_when=concurrent.futures.FIRST_COMPLETED)
            for future in ended:
                trial, job, overrides = running.pop(future)
                ret = launcher.result(future, job.num, overrides)
                book.tell(trial, ret)
                ran.append(job)
                returns.append(ret)
                to_go = stop_if_too_many_failed(to_go)
    except KeyboardInterrupt as e:
        setattr(e, INTERRUPTED_SWEEP, sweep_dir)  # run.py's advice: the same command goes on with the study
        raise
    finally:
        launcher.end()
        launcher.close()
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if complete and len(dirs) == 1:
        best = study.best_trial
        log.info("best trial %d: %s -> %s", best.number, best.params, best.value)
        OmegaConf.save(OmegaConf.create({"name": "optuna", "best_trial": best.number, "best_params": best.params,
                                         "best_value": best.value}),
                       os.path.join(sweep_dir, "optimization_results.yaml"))
    elif not complete:
        log.warning("no trial of study %s completed with an objective: no optimization_results.yaml",
                    study.study_name)
    by_num = {j.num: j for j in ran}  # the jobs that ended ok but whose trial failed (no objective), with why
    finish(sweeper, ran, returns, also_failed=[(by_num[n], why) for n, why in book.no_objective if n in by_num])
