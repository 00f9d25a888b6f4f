"""The job side of pruning: a trial's job reports its held-out reward to the Optuna study at every eval and
stops when the pruner says so (the job number is the trial number)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from slime_hydra.sweep.jobs import JobPruned
from slime_hydra.sweep.report import eval_reward


def storage_of(url: Optional[str]):
    """An RDB storage that waits for sqlite's lock (the jobs report to it concurrently) instead of failing."""
    import optuna

    if url is None or not str(url).startswith("sqlite"):
        return url
    return optuna.storages.RDBStorage(str(url), engine_kwargs={"connect_args": {"timeout": 120}})


def pruning_hook(prune: Dict[str, Any], number: int, last_step: Optional[int] = None):
    """An ``EVAL_HOOKS`` entry (launch/loop.py) for trial ``number``; the eval of ``last_step`` prunes nothing."""
    import optuna
    from hydra.utils import instantiate

    pruner = prune["pruner"] if isinstance(prune["pruner"], optuna.pruners.BasePruner) else instantiate(prune["pruner"])
    study = optuna.load_study(study_name=prune["study_name"], storage=storage_of(prune["storage"]), pruner=pruner)
    trial = optuna.trial.Trial(study, study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number))

    def hook(step: int, metrics: Dict[str, float]) -> None:
        value = eval_reward(metrics)
        if value is None:
            return
        trial.report(value, step)
        if step != last_step and trial.should_prune():
            raise JobPruned(f"pruned at step {step} by {type(pruner).__name__}: held-out reward {value:.4f}")

    return hook
