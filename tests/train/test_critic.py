"""The PPO critic (slime_hydra/train/backends/torch/critic.py) and the RL step's use of it over the torch backend, in
process (no Ray): value-head shapes and positions, where the value loss's gradient goes, critic-only
rollouts, checkpoint round trip, and DDP over two gloo ranks matching one rank on the whole batch."""

from __future__ import annotations

import os
import socket

import pytest
import torch
from tiny_trainer import backend, fake_rollout, rl_trainer, train

from conftest import resolved


def ppo_cfg(*overrides: str):
    return resolved(["algo=ppo", "trainer.num_rollout=10", "trainer.micro_batch_size=3", *overrides])


def micro_batch(data, rows, T=3):
    from slime_hydra.train.batch import make_micro_batch

    return make_micro_batch(data, rows, T)


# ------------------------------------------------------------------------------------ the model
def test_value_model_shape_and_positions(tiny_ckpt):
    from slime_hydra.train.backends.torch.critic import ValueModel

    model = ValueModel.from_pretrained(tiny_ckpt)
    assert not hasattr(model.backbone, "lm_head")
    data = fake_rollout(4)
    mb = micro_batch(data, [0, 1, 2, 3])
    v = model(mb)
    assert v.shape == (4, 3) and v.dtype == torch.float32
    assert torch.count_nonzero(v) == 0  # zero-initialised head: every value starts at 0
    torch.nn.init.normal_(model.value_head.weight)
    v = model(mb)
    # the value of response token t is read where the logits that score token t are, and the critic's pass
    # without a mask gives the masked pass's values at every real token (padded rows included)
    assert not mb.attention_mask.all()
    pos = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model.backbone(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=pos)
    hidden = out.last_hidden_state
    for b in range(4):
        for t in range(int(mb.loss_mask[b].sum())):
            expected = model.value_head(hidden[b, int(mb.response_start[b]) - 1 + t])
            torch.testing.assert_close(v[b, t], expected[0])


def test_backbone_is_the_policy_backbone(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    from slime_hydra.train.backends.torch.critic import ValueModel

    critic = ValueModel.from_pretrained(tiny_ckpt)
    policy = AutoModelForCausalLM.from_pretrained(tiny_ckpt)
    ps = policy.model.state_dict()
    for k, v in critic.backbone.state_dict().items():
        torch.testing.assert_close(v, ps[k], rtol=0, atol=0)


def test_masked_value_loss_grad_flows_only_into_the_critic(tiny_ckpt):
    from slime_hydra.train import algorithms as A

    cfg = ppo_cfg()
    tr = backend(cfg, tiny_ckpt)
    torch.nn.init.normal_(tr.critic.model.value_head.weight, std=0.1)
    data = fake_rollout(4)
    mb = micro_batch(data, [0, 1, 2, 3])
    mb.loss_mask[1, 0] = 0.0  # a masked token inside a response
    reducer = A.Reducer("sample_mean", 4, int(mb.loss_mask.sum()), 4)
    v = tr.critic.net(mb)
    v.retain_grad()
    loss, m = A.value_loss(cfg.algo, reducer, values=v, old_values=v.detach(), returns=torch.ones_like(v),
                           loss_mask=mb.loss_mask)
    loss.backward()
    assert set(m) == {"value_loss", "value_clipfrac"}
    assert torch.all(v.grad[mb.loss_mask == 0] == 0) and torch.all(v.grad[mb.loss_mask != 0] != 0)
    assert all(p.grad is None for p in tr.model.parameters()), "the value loss reached the policy"
    grads = [p.grad for p in tr.critic.model.parameters()]
    assert all(g is not None for g in grads) and all(torch.isfinite(g).all() for g in grads)
    assert tr.critic.model.value_head.weight.grad.abs().sum() > 0
    assert tr.critic.model.backbone.embed_tokens.weight.grad.abs().sum() > 0


def test_explained_variance_from_moments_matches_the_algorithm():
    from slime_hydra.train import algorithms as A
    from slime_hydra.train.trainer import explained_variance

    g = torch.Generator().manual_seed(0)
    v, r = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    m = (torch.rand(6, 4, generator=g) > 0.3).float()
    assert explained_variance(v, r, m) == pytest.approx(float(A.explained_variance(v, r, m)))
    assert explained_variance(v, r, m) == pytest.approx(_ev_moments(v, r, m), rel=1e-6)
    # two "ranks" with half the rows each: the sum of their moments gives the whole batch's value
    moments = []
    for rows in (slice(0, 3), slice(3, 6)):
        explained_variance(v[rows], r[rows], m[rows], all_reduce=lambda t: moments.append(t) or t)
    both = explained_variance(v[:3], r[:3], m[:3], all_reduce=lambda t: moments[0] + moments[1])
    assert both == pytest.approx(float(A.explained_variance(v, r, m)), rel=1e-6)
    assert explained_variance(v[:3], r[:3], m[:3]) != pytest.approx(both)


def _ev_moments(v, r, m):
    """The formula the DDP path uses, computed in one process."""
    m = m.double()
    rr, e = r.double() * m, (r.double() - v.double()) * m
    n = m.sum()
    var_r = (rr * rr).sum() / n - (rr.sum() / n) ** 2
    return float(1 - ((e * e).sum() / n - (e.sum() / n) ** 2) / var_r)


# ------------------------------------------------------------------------------- in the trainer
def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(before, model):
    return any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_ppo_trainer_critic_only_then_actor_and_checkpoint(tiny_ckpt, tmp_path):
    cfg = ppo_cfg("algo.num_critic_only_steps=2", "algo.critic_lr=1e-2", "algo.lr=1e-3")
    rl, tr = rl_trainer(cfg, tiny_ckpt)
    data = fake_rollout(8)
    actor0 = params(tr.model)
    losses, evs = [], []
    for i in range(4):
        critic_before = params(tr.critic.model)
        m = train(rl, cfg, data)
        assert changed(critic_before, tr.critic.model)
        losses.append(m["value_loss"])
        evs.append(m["explained_variance"])
        for key in ("value_loss", "value_clipfrac", "explained_variance", "critic_grad_norm", "critic_lr"):
            assert key in m, key
        if i < 2:  # critic-only rollouts: the actor is not updated
            assert not changed(actor0, tr.model) and rl.steps_done == 0
            assert "pg_loss" not in m
        else:
            for key in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm"):
                assert key in m, key
    assert changed(actor0, tr.model) and rl.steps_done == 2 and rl.rollouts_done == 4
    assert evs[0] == pytest.approx(0.0, abs=1e-6)  # V = 0 at first: no better than a constant
    assert losses[-1] < losses[0] and evs[-1] > evs[0]  # the critic fits the same batch

    tr.export_hf(str(tmp_path / "hf"), None)  # as TrainerActor.save does
    tr.save(str(tmp_path), rl.state_dict())
    assert (tmp_path / "critic.pt").exists()
    expected_v = tr.critic.values(tr.micro_batches(data, list(range(8)), 3))
    fresh_rl, fresh = rl_trainer(cfg, tiny_ckpt)
    fresh_rl.load_state_dict(fresh.load(str(tmp_path)))
    assert fresh_rl.rollouts_done == 4 and fresh_rl.steps_done == 2
    for k, v in tr.critic.model.state_dict().items():
        torch.testing.assert_close(fresh.critic.model.state_dict()[k], v, rtol=0, atol=0)
    torch.testing.assert_close(fresh.critic.values(fresh.micro_batches(data, list(range(8)), 3)), expected_v)
    assert fresh.critic.sched.state_dict()["last_epoch"] == tr.critic.sched.state_dict()["last_epoch"]
    assert fresh.critic.opt.state_dict()["state"].keys() == tr.critic.opt.state_dict()["state"].keys()
    # both continue identically
    m1, m2 = train(rl, cfg, data), train(fresh_rl, cfg, data)
    assert m1["value_loss"] == pytest.approx(m2["value_loss"]) and m1["pg_loss"] == pytest.approx(m2["pg_loss"])


def test_resume_without_critic_checkpoint_fails(tiny_ckpt, tmp_path):
    grpo = backend(resolved(["trainer.num_rollout=10"]), tiny_ckpt)
    grpo.export_hf(str(tmp_path / "hf"), None)
    grpo.save(str(tmp_path), {"steps_done": 0, "rollouts_done": 0})
    ppo = backend(ppo_cfg(), tiny_ckpt)
    with pytest.raises(FileNotFoundError, match="critic.pt"):
        ppo.load(str(tmp_path))


def test_ppo_needs_a_backend_with_a_critic(tiny_ckpt):
    from slime_hydra.train.trainer import RLTrainer

    grpo = backend(resolved(["trainer.num_rollout=10"]), tiny_ckpt)
    assert grpo.critic is None
    with pytest.raises(ValueError, match="advantage_estimator='ppo' trains a critic, which the TorchBackend"):
        RLTrainer(grpo, ppo_cfg().algo, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank, world, port, ckpt, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cfg = ppo_cfg("algo.num_critic_only_steps=0", "algo.critic_lr=1e-2")
        rl, tr = rl_trainer(cfg, ckpt, rank, world)
        full = fake_rollout(8)
        half = {k: v[rank * 4:(rank + 1) * 4] for k, v in full.items()}
        m = train(rl, cfg, half)
        layout = (tr.dp_rank, tr.dp_size, tr.pushes_weights, len(list(tr.hf_weights())) > 0,
                  len(list(tr.hf_weights(every_rank=True))) > 0)
        torch.save({"critic": tr.critic.model.state_dict(), "actor": tr.model.state_dict(), "metrics": m,
                    "layout": layout}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_ddp_critic_matches_one_rank(tiny_ckpt, tmp_path):
    """Two gloo ranks with half the rollout each take the same critic (and actor) step as one rank
    with all of it (sample_mean: the reducer's step totals are all-reduced)."""
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(2, _free_port(), tiny_ckpt, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    # each rank is its own data-parallel rank; only rank 0 streams weights to push, unless every rank
    # must hand over its GPU's copy (CUDA IPC to engines spanning several GPUs)
    assert r0["layout"] == (0, 2, True, True, True) and r1["layout"] == (1, 2, False, False, True)
    cfg = ppo_cfg("algo.num_critic_only_steps=0", "algo.critic_lr=1e-2")
    rl, one = rl_trainer(cfg, tiny_ckpt)
    # advantages are whitened with moments over both ranks (as slime does), so the actors agree too
    m = train(rl, cfg, fake_rollout(8))
    for k, v in one.critic.model.state_dict().items():
        torch.testing.assert_close(r0["critic"][k], r1["critic"][k], rtol=0, atol=0)
        torch.testing.assert_close(r0["critic"][k], v, rtol=1e-5, atol=1e-6)
    # (the actor's first Adam step is ~lr * sign(grad): float noise flips it on near-zero gradients,
    # so its equivalence is checked through the loss and the advantages)
    for key in ("value_loss", "value_clipfrac", "explained_variance", "values_mean", "advantage_abs_mean",
                "train_rollout_logprob_abs_diff", "pg_loss", "pg_clipfrac"):
        assert r0["metrics"][key] == pytest.approx(m[key], rel=1e-5, abs=1e-6), key
    for k in r0["actor"]:
        torch.testing.assert_close(r0["actor"][k], r1["actor"][k], rtol=0, atol=0)
