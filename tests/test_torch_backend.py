"""The torch trainer backend on the tiny model: the reference swap, a train step, checkpoints."""

from __future__ import annotations

import torch

from conftest import resolved
from slime_hydra.train.torch_backend import TorchTrainer


def trainer(tiny_ckpt, tmp_path, *overrides):
    cfg = resolved(list(overrides))
    cfg.output_dir = str(tmp_path)
    return TorchTrainer(cfg, tiny_ckpt, 0, 1, torch.device("cpu"))


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_reference_swap_restores_tied_weights_exactly(tiny_ckpt, tmp_path):
    """Regression: with tied embeddings, backing up the LM head after the embedding had been
    overwritten restored the *reference* embeddings, silently undoing every update to them."""
    tr = trainer(tiny_ckpt, tmp_path)
    assert tr.model.config.tie_word_embeddings and tr.needs_ref
    with torch.no_grad():
        for p in tr.model.parameters():
            p.add_(0.5)  # the policy has moved away from the reference
    before = snapshot(tr.model)
    with tr.swapped_in(tr.ref_state):
        inside = snapshot(tr.model)
    after = snapshot(tr.model)
    for k in before:
        assert torch.equal(after[k], before[k]), k
        assert torch.allclose(inside[k], before[k] - 0.5, atol=1e-6), k  # the reference is in use inside


def _data(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens, lens, rewards = [], [], []
    for i in range(n):
        prompt = torch.randint(2, 12, (5,), generator=g).tolist() + [12]
        resp = torch.randint(2, 24, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist() + [1]
        tokens.append(prompt + resp)
        lens.append(len(resp))
        rewards.append(float(i % 2))
    return {"tokens": tokens, "response_lengths": lens, "loss_masks": [None] * n,
            "rewards": [r - 0.5 for r in rewards], "raw_rewards": rewards,
            "rollout_log_probs": [[0.0] * l for l in lens]}


def test_train_step_moves_rewarded_log_probs_up(tiny_ckpt, tmp_path):
    tr = trainer(tiny_ckpt, tmp_path, "rollout.n_samples_per_prompt=2", "rollout.batch_size=8")
    data = _data()
    from slime_hydra.train.batch import make_micro_batch

    mb = make_micro_batch(data, list(range(16)), max(data["response_lengths"]))
    before = tr._log_probs_all([mb])
    metrics = tr.train(data)
    after = tr._log_probs_all([mb])
    good = torch.tensor(data["rewards"]) > 0
    delta = ((after - before) * mb.loss_mask).sum(1) / mb.loss_mask.sum(1)
    assert delta[good].mean() > 0 > delta[~good].mean()
    for key in ("pg_loss", "kl_loss", "entropy", "grad_norm", "lr", "train_rollout_logprob_abs_diff"):
        assert key in metrics, key


def test_save_and_load_round_trip(tiny_ckpt, tmp_path):
    tr = trainer(tiny_ckpt, tmp_path, "rollout.n_samples_per_prompt=2", "rollout.batch_size=8")
    tr.train(_data())
    tr.save(str(tmp_path / "ckpt"), tiny_ckpt)
    fresh = trainer(tiny_ckpt, tmp_path, "rollout.n_samples_per_prompt=2", "rollout.batch_size=8")
    fresh.load(str(tmp_path / "ckpt"))
    a, b = snapshot(tr.model), snapshot(fresh.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert fresh.opt.state_dict()["state"].keys() == tr.opt.state_dict()["state"].keys()
    assert all(torch.equal(tr.ref_state[k], fresh.ref_state[k]) for k in tr.ref_state)
