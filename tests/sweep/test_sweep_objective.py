"""An Optuna search's objective: refused before any trial when it cannot exist (a held-out reward with
no eval set); a trial without one (NaN, missing) is told FAIL and counted against max_failure_rate,
and the search goes on."""

from __future__ import annotations

import math

import pytest
from hydra.core.utils import JobReturn, JobStatus
from sweep_helpers import sweep

from slime_hydra.sweep.jobs import JobPruned


def ret(value=None, status=JobStatus.COMPLETED, error=None) -> JobReturn:
    r = JobReturn(overrides=[], status=status)
    r._return_value = error if status != JobStatus.COMPLETED else value
    return r


def test_objective_values():
    from slime_hydra.sweep.optuna import objective_values

    assert objective_values(0.5, 1) == ([0.5], None)
    assert objective_values("0.25", 1) == ([0.25], None)
    assert objective_values(float("nan"), 1) == (None, "returned nan")
    assert objective_values(None, 1) == (None, "returned None, not a number")
    assert objective_values([1, 2], 2) == ([1.0, 2.0], None)
    assert objective_values([1.0, math.nan], 2)[0] is None
    assert objective_values([1.0], 2) == (None, "returned 1 value(s) for 2 objective(s)")


def test_a_trial_without_an_objective_is_told_fail_and_counted():
    import optuna
    from optuna.trial import TrialState

    from slime_hydra.sweep.optuna import TrialBook

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    book = TrialBook(study, 1, "eval_reward_final", max_failure_rate=0.5)
    book.tell(study.ask(), ret(0.75))
    assert not book.too_many_failed
    book.tell(study.ask(), ret(float("nan")))  # optuna itself raises ValueError on a NaN value
    assert book.no_objective == [(1, "sweep.optimized_metric=eval_reward_final returned nan")]
    assert (book.ended, book.failed) == (2, 1) and not book.too_many_failed  # 1 of 2: not past 0.5
    book.tell(study.ask(), ret(status=JobStatus.FAILED, error=RuntimeError("job 2 failed")))
    assert book.too_many_failed  # 2 of 3
    book.tell(study.ask(), ret(status=JobStatus.FAILED, error=JobPruned("pruned at step 2")))
    book.invalid(study.ask())
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.FAIL,
                                               TrialState.PRUNED, TrialState.FAIL]
    assert (book.ended, book.failed) == (5, 3)
    assert study.best_trial.number == 0 and study.best_value == 0.75

    book = TrialBook(study, 1, "eval_reward_final", max_failure_rate=1.0)  # the preset's: never stops
    book.tell(study.ask(), ret(None))
    assert book.failed == book.ended == 1 and not book.too_many_failed


@pytest.mark.parametrize("overrides, problem", [
    (["data=jsonl", "data.path=tests/fixtures/tiny.jsonl"], True),  # no eval set
    (["data=jsonl", "data.path=tests/fixtures/tiny.jsonl", "sweep.optimized_metric=train_reward_last"], False),
    ([], False),  # the built-in task evaluates on its held-out split
    (["eval.datasets=[]", "sweep.optimized_metric=eval_reward_initial"], True),
])
def test_an_objective_that_cannot_exist_is_a_problem(overrides, problem):
    from conftest import resolved
    from slime_hydra.sweep.compose import Job
    from slime_hydra.sweep.optuna import objective_problems

    problems = objective_problems(Job(0, overrides, cfg=resolved(overrides)))
    if problem:
        assert len(problems) == 1 and problems[0].startswith("sweep.optimized_metric: eval_reward_")
        assert "eval.datasets is empty" in problems[0]
    else:
        assert problems == []
    assert objective_problems(Job(0, overrides)) == []  # a config that did not compose has its own problems


def test_a_search_without_eval_sets_is_refused_before_any_trial(tmp_path):
    d = tmp_path / "search"
    out = sweep(d, "hparams_search=grpo_digits", "data=jsonl", "data.path=tests/fixtures/tiny.jsonl",
                "rollout.max_response_len=1")
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "3 of 3 sweep jobs are invalid" in out.stderr
    assert "sweep.optimized_metric: eval_reward_final (the search's objective) is a held-out reward, but " \
           "eval.datasets is empty" in out.stderr
    assert not (d / "optuna.db").exists()  # nothing started
