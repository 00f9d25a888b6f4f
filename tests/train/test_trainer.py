"""The backend-neutral RL step (slime_hydra/train/trainer.py) over the torch backend on the tiny model:
it learns in the rewarded direction, and the rollout settings it gets as arguments (the sampling
temperature, the generation budget) are the ones it uses."""

from __future__ import annotations

import pytest
import torch
from tiny_trainer import config, fake_rollout, rl_trainer, train


def test_train_step_moves_rewarded_log_probs_up(tiny_ckpt):
    cfg = config("rollout.n_samples_per_prompt=2", "rollout.batch_size=4")
    rl, be = rl_trainer(cfg, tiny_ckpt)
    data = fake_rollout(8)
    data["rewards"] = [r - 0.5 for r in data["raw_rewards"]]  # as the manager's group normalisation would
    mbs = be.micro_batches(data, list(range(8)), 3)
    mask = torch.cat([mb.loss_mask for mb in mbs])
    before = be.log_probs(mbs, cfg.rollout.temperature)
    metrics = train(rl, cfg, data)
    after = be.log_probs(mbs, cfg.rollout.temperature)
    good = torch.tensor(data["rewards"]) > 0
    delta = ((after - before) * mask).sum(1) / mask.sum(1)
    assert delta[good].mean() > 0 > delta[~good].mean()
    for key in ("pg_loss", "kl_loss", "entropy", "grad_norm", "lr", "train_rollout_logprob_abs_diff",
                "advantage_abs_mean"):
        assert key in metrics, key
    assert rl.state_dict() == {"steps_done": 1, "rollouts_done": 1}


def test_the_sampling_temperature_is_the_one_passed(tiny_ckpt):
    """Rollout log-probs made at temperature 0.7 match the trainer's recomputation only when the
    trainer is told 0.7 (the log-prob gap metric)."""
    cfg = config("rollout.n_samples_per_prompt=2", "rollout.batch_size=4")
    data = fake_rollout(8)
    rl, be = rl_trainer(cfg, tiny_ckpt)
    lp = be.log_probs(be.micro_batches(data, list(range(8)), 3), 0.7)
    data["rollout_log_probs"] = [lp[i, :n].tolist() for i, n in enumerate(data["response_lengths"])]
    gap_07 = rl.train(data, temperature=0.7, max_response_len=4)["train_rollout_logprob_abs_diff"]
    rl, _ = rl_trainer(cfg, tiny_ckpt)
    gap_10 = rl.train(data, temperature=1.0, max_response_len=4)["train_rollout_logprob_abs_diff"]
    assert gap_07 < 1e-6 < 1e-2 < gap_10


def test_token_sum_normalises_by_the_budget_passed(tiny_ckpt):
    """Dr. GRPO's token_sum divides by samples x the generation budget given to train()."""
    cfg = config("algo=dr_grpo", "rollout.n_samples_per_prompt=2", "rollout.batch_size=4")
    assert cfg.algo.loss_reduction == "token_sum"
    losses = []
    for budget in (4, 8):
        rl, _ = rl_trainer(cfg, tiny_ckpt)
        losses.append(rl.train(fake_rollout(8), temperature=1.0, max_response_len=budget)["pg_loss"])
    assert losses[0] == pytest.approx(2 * losses[1], rel=1e-5) and losses[0] != 0


def test_steps_split_the_rollout_evenly(tiny_ckpt):
    from slime_hydra.train.trainer import split_steps

    assert split_steps(6, 3) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="7 samples do not split into 2 equal optimiser steps"):
        split_steps(7, 2)
    cfg = config("rollout.n_samples_per_prompt=2", "rollout.batch_size=4", "trainer.global_batch_size=4")
    assert cfg.trainer.num_steps_per_rollout == 2
    rl, _ = rl_trainer(cfg, tiny_ckpt)
    train(rl, cfg, fake_rollout(8))
    assert rl.state_dict() == {"steps_done": 2, "rollouts_done": 1}


def count_log_prob_passes(be) -> list:
    """The backend's ``log_probs`` passes from now on, as their ``reference`` flags."""
    passes = []
    log_probs = be.log_probs

    def counted(mbs, temperature, reference=False):
        passes.append(reference)
        return log_probs(mbs, temperature, reference=reference)

    be.log_probs = counted
    return passes


@pytest.mark.parametrize("overrides", [
    (),  # the default: GRPO with a KL loss
    ("algo=gspo",),
    ("algo=cispo",),
    ("algo=ppo", "algo.num_critic_only_steps=0"),
    ("algo.use_tis=true",),
    ("algo.use_rollout_logprobs=true",),
    ("trainer.micro_batch_size=3",),  # several micro-batches in the one step
])
def test_old_log_probs_from_the_policy_step_train_as_a_pass_of_their_own(tiny_ckpt, overrides):
    """With one optimiser step per rollout the old policy is the step's own: taking its log-probs from
    that step's forward pass saves a pass (only the reference's is left) and gives the same
    weights and metrics over several rollouts as recomputing them."""
    cfg = config("rollout.n_samples_per_prompt=2", "rollout.batch_size=4", *overrides)
    assert cfg.trainer.num_steps_per_rollout == 1
    runs = []
    for reuse in (True, False):
        rl, be = rl_trainer(cfg, tiny_ckpt)
        rl.reuse_step_log_probs = reuse
        passes = count_log_prob_passes(be)
        metrics = [train(rl, cfg, fake_rollout(8, seed=s)) for s in range(3)]
        runs.append((metrics, passes, {k: v.clone() for k, v in be.model.state_dict().items()}))
    (reused, reused_passes, reused_w), (recomputed, recomputed_passes, recomputed_w) = runs
    assert False not in reused_passes and recomputed_passes.count(False) == 3
    for a, b in zip(reused, recomputed):
        assert a.keys() == b.keys()
        assert b.pop("extra_forward_passes") == a.pop("extra_forward_passes") + 1  # the old policy's pass
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    for k in reused_w:
        torch.testing.assert_close(reused_w[k], recomputed_w[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides", [("trainer.global_batch_size=4",), ("algo=reinforce_plus_plus",)])
def test_old_log_probs_get_their_own_pass_where_the_step_is_not_the_old_policy(tiny_ckpt, overrides):
    """Two optimiser steps (the second step's policy is no longer the old one), or KL reward shaping
    (the advantages read the old log-probs before any step): the old policy gets its own pass."""
    cfg = config("rollout.n_samples_per_prompt=2", "rollout.batch_size=4", *overrides)
    rl, be = rl_trainer(cfg, tiny_ckpt)
    passes = count_log_prob_passes(be)
    train(rl, cfg, fake_rollout(8))
    assert passes.count(False) == 1


@pytest.mark.parametrize("overrides, expected", [
    (("algo.kl_loss_coef=0.0",), 0),  # one step, no KL: the old log-probs come from the step
    (("algo.kl_loss_coef=0.0", "trainer.global_batch_size=4"), 1),  # two steps: the old policy's pass
    ((), 1),  # GRPO's KL loss: the reference's pass
    (("trainer.global_batch_size=4",), 2),
    (("algo=reinforce_plus_plus",), 2),  # KL reward shaping: both
])
def test_extra_forward_passes_counts_the_log_prob_passes(tiny_ckpt, overrides, expected):
    """``extra_forward_passes`` (what bench/scale_gpu.py's MFU counts besides the training pass) is the
    number of log-prob passes the step ran."""
    cfg = config("rollout.n_samples_per_prompt=2", "rollout.batch_size=4", *overrides)
    rl, be = rl_trainer(cfg, tiny_ckpt)
    passes = count_log_prob_passes(be)
    assert train(rl, cfg, fake_rollout(8))["extra_forward_passes"] == len(passes) == expected
