"""The torch trainer backend on the tiny model: the reference model, log-probs, micro-batches,
checkpoints."""

from __future__ import annotations

import pytest
import torch
from tiny_trainer import backend, config, fake_rollout, rl_trainer, train

from slime_hydra.train.backend import WarmUpShape


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_reference_log_probs_are_the_first_weights_tied_head_included(tiny_ckpt):
    """The reference runs the policy's modules with its own weights (functional_call): after the
    policy has moved, its log-probs are those of the checkpoint's model, the LM head tied to the
    *reference* embedding (a head left on the policy's embedding would score differently), and the
    policy's own weights are untouched by the pass."""
    be = backend(config(), tiny_ckpt)
    assert be.model.config.tie_word_embeddings and be.ref_state is not None
    mbs = be.micro_batches(fake_rollout(6), list(range(6)), 3)
    first = be.log_probs(mbs, 1.0)
    with torch.no_grad():
        be.model.get_input_embeddings().weight.add_(0.5)  # the policy has moved (the tied head with it)
    before = snapshot(be.model)
    moved = be.log_probs(mbs, 1.0)
    assert not torch.allclose(moved, first)
    torch.testing.assert_close(be.log_probs(mbs, 1.0, reference=True), first, rtol=0, atol=0)
    after = snapshot(be.model)
    assert all(torch.equal(after[k], before[k]) for k in before)
    torch.testing.assert_close(be.log_probs(mbs, 1.0), moved, rtol=0, atol=0)


def test_log_probs_follow_temperature_and_reference(tiny_ckpt):
    be = backend(config(), tiny_ckpt)
    data = fake_rollout(6)
    mbs = be.micro_batches(data, list(range(6)), 3)
    mb = mbs[0]
    pos = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = be.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=pos).logits
    b, t = 2, 2  # sample 2 has a 3-token response: its last token is scored by the logits before it
    start = int(mb.response_start[b])
    expected = torch.log_softmax(logits[b, start - 1 + t] / 0.7, -1)[mb.response_ids[b, t]]
    lp = be.log_probs(mbs, 0.7)
    assert lp.shape == (6, 3) and lp.dtype == torch.float32 and not lp.requires_grad
    torch.testing.assert_close(lp[b, t], expected.detach())
    assert not torch.allclose(be.log_probs(mbs, 1.0), lp)
    torch.testing.assert_close(be.log_probs(mbs, 0.7, reference=True), lp)  # nothing trained yet
    with pytest.raises(RuntimeError, match="no reference weights"):
        backend(config("algo.kl_loss_coef=0"), tiny_ckpt).log_probs(mbs, 0.7, reference=True)


def test_the_forward_pass_without_attention_mask_is_the_masked_one(tiny_ckpt, monkeypatch):
    """The backend runs its right-padded rows without an attention mask (causal attention never lets a
    real token see a pad): log-probs and their gradients are those of the masked forward pass. And the
    model sees plain causal rows: transformers finds no packed sequences in the positions (pads that
    repeat a position did read as packed, and made the GPU's causal kernel a masked one)."""
    from transformers import masking_utils

    from slime_hydra.train.batch import response_log_probs

    packed = []
    find = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices",
                        lambda pos: packed.append(find(pos)) or packed[-1])  # recorded, and returned as before

    be = backend(config(), tiny_ckpt)
    data = fake_rollout(6)  # sequences of 6 to 8 tokens: rows 0, 1, 3, 4 are padded
    mb = be.micro_batches(data, list(range(6)), 3)[0]
    assert not mb.attention_mask.all()

    def masked_pass():
        pos = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = be.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=pos).logits
        return response_log_probs(logits, mb, 0.7)[0]

    grads = []
    for forward in (masked_pass, lambda: be._forward(mb, 0.7)[0]):
        be.model.zero_grad()
        lp = forward()
        (lp * mb.loss_mask).sum().backward()
        grads.append((lp.detach() * mb.loss_mask, [p.grad.clone() for p in be.model.parameters()]))
    (want, want_grads), (got, got_grads) = grads
    assert packed == [None]  # the backend's pass (the masked one has a mask, so transformers looks no further)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


def test_micro_batches_keep_rows_in_order(tiny_ckpt):
    be = backend(config("trainer.micro_batch_size=3"), tiny_ckpt)
    data = fake_rollout(8)
    mbs = be.micro_batches(data, [1, 2, 3, 4, 5, 6, 7], 3)
    assert [mb.indices for mb in mbs] == [[1, 2, 3], [4, 5, 6], [7]]
    assert all(mb.response_ids.shape[1] == 3 for mb in mbs)


def test_single_rank_layout(tiny_ckpt):
    be = backend(config(), tiny_ckpt)
    assert (be.dp_rank, be.dp_size, be.pushes_weights, be.reports_metrics) == (0, 1, True, True)
    names = [name for name, _ in be.hf_weights()]
    assert names == [n for n in be.model.state_dict() if n != "lm_head.weight"]  # tied: the embedding, once
    assert torch.equal(be.dp_all_reduce(torch.tensor([1.5, 2.0])), torch.tensor([1.5, 2.0]))


def test_save_and_load_round_trip(tiny_ckpt, tmp_path):
    cfg = config("rollout.n_samples_per_prompt=2", "rollout.batch_size=4")
    rl, be = rl_trainer(cfg, tiny_ckpt)
    train(rl, cfg, fake_rollout(8))
    be.export_hf(str(tmp_path / "hf"), tiny_ckpt)  # as TrainerActor.save does
    be.save(str(tmp_path), rl.state_dict())
    fresh_rl, fresh = rl_trainer(cfg, tiny_ckpt)
    fresh_rl.load_state_dict(fresh.load(str(tmp_path)))
    a, b = snapshot(be.model), snapshot(fresh.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert fresh.opt.state_dict()["state"].keys() == be.opt.state_dict()["state"].keys()
    assert all(torch.equal(be.ref_state[k], fresh.ref_state[k]) for k in be.ref_state)
    assert fresh_rl.state_dict() == rl.state_dict() == {"steps_done": 1, "rollouts_done": 1}
    assert fresh.lr == be.lr


def test_resuming_with_more_rollouts_steps_at_the_new_schedules_rate(tiny_ckpt, tmp_path):
    """2 rollouts of a cosine decay saved, resumed with trainer.num_rollout=4 (set_num_rollout sized the new
    schedule): the first resumed step runs at the 4-step schedule's rate at step 2, not the 2-step schedule's
    end (min_lr), which the optimiser's param groups and the scheduler's state carried; the critic's too."""
    from slime_hydra.train.optim import lr_lambda

    decay = ["algo=ppo", "algo.num_critic_only_steps=0", "algo.lr_decay=cosine", "algo.lr=1e-3", "algo.min_lr=1e-4",
             "algo.critic_lr=2e-3", "rollout.n_samples_per_prompt=2", "rollout.batch_size=4"]
    cfg = config(*decay, "trainer.num_rollout=2")
    rl, be = rl_trainer(cfg, tiny_ckpt)
    for seed in (0, 1):
        train(rl, cfg, fake_rollout(8, seed))
    assert be.lr == pytest.approx(1e-4)  # the 2-step schedule's end
    be.export_hf(str(tmp_path / "hf"), tiny_ckpt)  # as TrainerActor.save does
    be.save(str(tmp_path), rl.state_dict())
    cfg = config(*decay, "trainer.num_rollout=4")
    fresh_rl, fresh = rl_trainer(cfg, tiny_ckpt)
    fresh_rl.load_state_dict(fresh.load(str(tmp_path)))
    want = 1e-3 * lr_lambda(cfg.algo, 4)(2)
    assert want == pytest.approx(5.5e-4)
    assert fresh.lr == pytest.approx(want)
    assert [g["lr"] for g in fresh.opt.param_groups] == pytest.approx([want])
    assert [g["lr"] for g in fresh.critic.opt.param_groups] == pytest.approx([2 * want])
    assert fresh.critic.lr == pytest.approx(2 * want)
    assert fresh.sched.last_epoch == 2 and fresh.opt.state_dict()["state"]  # the position and AdamW state kept
    train(fresh_rl, cfg, fake_rollout(8, 2))
    assert fresh.lr == pytest.approx(1e-3 * lr_lambda(cfg.algo, 4)(3))


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_entropy_keeps_a_graph_only_for_an_entropy_bonus(tiny_ckpt, entropy_coef):
    """Without an entropy bonus the entropies are a metric: the same values, no autograd graph (whose
    saved float32 vocabulary-wide tensors would wait for the backward pass)."""
    be = backend(config(f"algo.entropy_coef={entropy_coef}"), tiny_ckpt)
    mb = be.micro_batches(fake_rollout(4), list(range(4)), 3)[0]
    log_probs, entropy = be._forward(mb, 1.0, with_entropy=True)
    assert log_probs.requires_grad and entropy.requires_grad == bool(entropy_coef)
    with torch.no_grad():
        _, expected = be._forward(mb, 1.0, with_entropy=True)
    torch.testing.assert_close(entropy.detach(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("lora", [[], ["trainer.lora.rank=4", "trainer.lora.dropout=0.1"]], ids=["full", "lora"])
def test_warm_up_changes_nothing_the_training_keeps(tiny_ckpt, lora):
    """``trainer.warm_up``: the step's no-grad log-prob pass and a forward and backward pass on dummy rows leave no
    gradient, no optimizer state and the random generators where they were (LoRA's dropout draws), so training
    after it is bitwise the training without it."""
    runs = []
    for warm in (True, False):
        cfg = config("trainer.micro_batch_size=3", *lora)
        torch.manual_seed(0)
        rl, be = rl_trainer(cfg, tiny_ckpt)
        before = {k: v.clone() for k, v in be.model.state_dict().items()}
        if warm:
            rng = torch.get_rng_state()
            backward: list = []  # the pass really ran a backward: a gradient reached the first trained weight
            trained = next(p for p in be.model.parameters() if p.requires_grad)
            hook = trained.register_hook(lambda g, seen=backward: seen.append(1))
            passes: list = []  # (grad enabled, train mode, [B, L]) of each forward: the step's no-grad pass ran too
            forward = be.model.register_forward_hook(
                lambda m, i, kw, o, seen=passes: seen.append((torch.is_grad_enabled(), m.training,
                                                              tuple(kw["input_ids"].shape))), with_kwargs=True)
            # the step's shape: 5 rows of 12 tokens in micro-batches of 3, the last one 2
            be.warm_up(cfg.rollout.temperature, WarmUpShape(samples=5, length=12, response_len=4))
            hook.remove()
            forward.remove()
            assert backward and {(False, False), (True, True)} == {p[:2] for p in passes}
            assert {p[2] for p in passes} == {(3, 12), (2, 12)}
            assert all(p.grad is None for p in be.model.parameters())
            assert not be.opt.state and torch.equal(torch.get_rng_state(), rng)
            for k, v in be.model.state_dict().items():
                assert torch.equal(v, before[k]), k
        metrics = [train(rl, cfg, fake_rollout(6, seed=s)) for s in (0, 1)]
        runs.append((metrics, {k: v.clone() for k, v in be.model.state_dict().items()}))
    (wm, ww), (cm, cw) = runs
    assert wm == cm
    for k in ww:
        assert torch.equal(ww[k], cw[k]), k
