"""The Optuna search's config: hydra-optuna-sweeper's params syntax as Optuna 5 distributions, the samplers
(TPE, random, grid, CMA-ES) built from it, and a study database of an older optuna refused with the command
that upgrades it."""

from __future__ import annotations

import sqlite3

import pytest


def test_params_become_distributions():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from slime_hydra.sweep.optuna import search_space

    dists, fixed = search_space(["algo.lr=tag(log, interval(1e-4, 1e-2))", "algo.kl_loss_coef=interval(0.0, 0.1)",
                                 "rollout.n_samples_per_prompt=range(2, 9, 2)", "algo=choice(grpo, dr_grpo)",
                                 "trainer.num_rollout=tag(int, interval(2, 8))", "seed=7",
                                 "algo.eps_clip=range(0.1, 0.35, 0.1)"])
    assert dists == {
        "algo.lr": FloatDistribution(1e-4, 1e-2, log=True),
        "algo.kl_loss_coef": FloatDistribution(0.0, 0.1),
        "rollout.n_samples_per_prompt": IntDistribution(2, 8, step=2),  # Hydra's range: below 9
        "algo": CategoricalDistribution(["grpo", "dr_grpo"]),
        "trainer.num_rollout": IntDistribution(2, 8),
        "algo.eps_clip": FloatDistribution(0.1, 0.3, step=0.1),
    }
    assert fixed == {"seed": "7"}
    assert search_space(["seed=choice(1,2)", "seed=3"])[0] == {}  # a fixed value wins over the space


@pytest.mark.parametrize("target", ["TPESampler", "RandomSampler", "GridSampler", "CmaEsSampler"])
def test_every_sampler_runs_a_small_study(target):
    import optuna
    from hydra.core.utils import JobReturn, JobStatus

    from slime_hydra.sweep.optuna import TrialBook, make_sampler, search_space, suggest

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    params = ["a=choice(1, 2)", "b=range(0, 3)"] if target == "GridSampler" else [
        "a=interval(1, 4)", "b=tag(log, interval(1e-3, 1e-1))"]
    dists, _ = search_space(params)
    sampler = make_sampler({"_target_": f"optuna.samplers.{target}", "seed": 3}, dists)
    assert type(sampler).__name__ == target
    study = optuna.create_study(sampler=sampler, direction="maximize")
    book = TrialBook(study, 1, "eval_reward_final", max_failure_rate=1.0)
    seen = []
    for _ in range(6):
        trial = study.ask()
        values = {k: suggest(trial, k, d) for k, d in dists.items()}
        seen.append(tuple(values.values()))
        result = JobReturn(overrides=[], status=JobStatus.COMPLETED)
        result._return_value = float(sum(values.values()))
        book.tell(trial, result)  # the grid's last: GridSampler stops the study, the trial is told all the same
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 6
    for a, b in seen:
        assert dists["a"]._contains(dists["a"].to_internal_repr(a)) and dists["b"]._contains(
            dists["b"].to_internal_repr(b))
    if target == "GridSampler":
        assert sorted(seen) == [(a, b) for a in (1, 2) for b in (0, 1, 2)]  # every point once


def test_a_grid_needs_values_not_an_interval():
    from slime_hydra.sweep.optuna import make_sampler, search_space

    with pytest.raises(ValueError, match=r"hydra.sweeper.params.lr: GridSampler needs choice\(...\) or range"):
        make_sampler({"_target_": "optuna.samplers.GridSampler"}, search_space(["lr=interval(0.1, 0.2)"])[0])


def test_unknown_settings_are_named():
    from slime_hydra.sweep.optuna import OptunaSettings

    assert OptunaSettings.of({"n_trials": 3, "direction": "minimize"}).n_trials == 3
    with pytest.raises(ValueError, match=r"hydra.sweeper.optuna: unknown key\(s\) \['n_trial'\]"):
        OptunaSettings.of({"n_trial": 3})


def test_a_study_of_an_older_optuna_is_refused_with_the_upgrade_command(tmp_path, capsys):
    import optuna

    from slime_hydra.sweep.optuna import check_storage

    url = f"sqlite:///{tmp_path}/optuna.db"
    optuna.create_study(study_name="s", storage=url)
    check_storage(url)  # the current schema: fine
    with sqlite3.connect(tmp_path / "optuna.db") as db:  # the schema head optuna 2.10 wrote
        db.execute("UPDATE alembic_version SET version_num = 'v2.6.0.a'")
    with pytest.raises(SystemExit) as e:
        check_storage(url)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"hydra.sweeper.optuna.storage={url}: this study database was written by an older optuna" in err
    assert err.strip().endswith(f"optuna storage upgrade --storage {url}")
    check_storage(f"sqlite:///{tmp_path}/none.db")  # no database yet: a new study


def test_a_resumed_study_draws_new_trials():
    import optuna

    from slime_hydra.sweep.optuna import make_sampler, search_space, suggest

    dists, _ = search_space(["x=interval(0, 1)"])
    node = {"_target_": "optuna.samplers.RandomSampler", "seed": 5}
    study = optuna.create_study(sampler=make_sampler(node, dists))
    first = suggest(study.ask(), "x", dists["x"])
    resumed = optuna.create_study(sampler=make_sampler(node, dists, trials_before=1))
    assert suggest(resumed.ask(), "x", dists["x"]) != first
