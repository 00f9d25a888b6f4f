"""The fused log-prob head (slime_hydra/train/logprobs.py) against the plain one (the model's logits,
then the float32 log-softmax, slime_hydra/train/batch.py): the same log-probs, entropies and gradients, with
its softmax statistics compiled (``fuse``, ``trainer.compile``) as well: in the fast suite the functions it
compiles run as they are (the compile is the slow test's)."""

from __future__ import annotations

import pytest
import torch
from tiny_trainer import backend, config, fake_rollout, rl_trainer, train

from slime_hydra.train import logprobs
from slime_hydra.train.batch import MicroBatch, response_log_probs
from slime_hydra.train.logprobs import fused_head, head_log_probs


@pytest.fixture
def uncompiled(monkeypatch):
    """``fuse``'s functions run uncompiled: the same Python, in eager torch."""
    monkeypatch.setattr(logprobs, "compiled", lambda fn: fn)


def _plain(hidden, weight, targets, temperature):
    lp = torch.log_softmax((hidden @ weight.T).float() / temperature, -1)
    return lp.gather(-1, targets[:, None])[:, 0], -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_log_probs_and_their_gradients_are_the_plain_ones(chunk, temperature, fuse, uncompiled):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 40, (10,), generator=g)
    a, b = torch.randn(10, generator=g), torch.randn(10, generator=g)  # weights of log-prob and entropy in a loss

    lp, ent = head_log_probs(hidden, weight, targets, temperature, with_entropy=True, chunk=chunk, fuse=fuse)
    (lp * a + ent * b).sum().backward()
    fused = (lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    lp, ent = _plain(hidden, weight, targets, temperature)
    (lp * a + ent * b).sum().backward()
    # fuse sums the softmax from the row's maximum, not log_softmax: float32 rounds it differently
    tol = dict(rtol=1e-4, atol=1e-5) if fuse else dict(rtol=1e-5, atol=1e-6)
    for x, y in zip(fused, (lp.detach(), ent.detach(), hidden.grad, weight.grad)):
        torch.testing.assert_close(x.double(), y.double(), **tol)


@pytest.mark.parametrize("fuse", [False, True])
def test_gradients_pass_a_frozen_weight_and_an_unused_entropy_by(fuse, uncompiled):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 8, generator=g, requires_grad=True)
    weight = torch.randn(20, 8, generator=g)  # frozen (LoRA's base)
    targets = torch.randint(0, 20, (6,), generator=g)
    lp, ent = head_log_probs(hidden, weight, targets, with_entropy=True, chunk=4, fuse=fuse)
    lp.sum().backward()  # the entropy is a metric only
    fused = hidden.grad.clone()
    hidden.grad = None
    _plain(hidden, weight, targets, 1.0)[0].sum().backward()
    torch.testing.assert_close(fused, hidden.grad, rtol=1e-5, atol=1e-6)


def test_fused_head_is_the_logits_path_on_the_tiny_model(tiny_ckpt):
    """The tiny model's forward with the fused head: log-probs, entropies and every parameter's gradient
    equal those of its [B, L, V] logits through batch.response_log_probs."""
    from transformers import AutoModelForCausalLM

    from slime_hydra.train.batch import make_micro_batch

    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    data = fake_rollout(6, seed=3)
    mb: MicroBatch = make_micro_batch(data, range(6), 3)
    pos = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = []
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        if fused:
            with fused_head(model.lm_head, mb.response_start, mb.response_ids, 0.8, True, chunk=4):
                both = model(input_ids=mb.input_ids, position_ids=pos).logits
            lp, ent = both[..., 0], both[..., 1]
        else:
            logits = model(input_ids=mb.input_ids, position_ids=pos).logits
            lp, ent = response_log_probs(logits, mb, 0.8, with_entropy=True)
        ((lp - 0.1 * ent) * mb.loss_mask).sum().backward()
        out.append((lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp1, e1, g1), (lp2, e2, g2) = out
    m = mb.loss_mask.bool()
    torch.testing.assert_close(lp1[m], lp2[m], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(e1[m], e2[m], rtol=1e-5, atol=1e-6)
    assert "lm_head.forward" not in str(vars(model.lm_head).keys())  # the head is itself again
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("overrides", [(), ("algo.entropy_coef=0.01",), ("algo=ppo", "algo.num_critic_only_steps=0")])
def test_training_with_the_fused_head_is_training_with_logits(tiny_ckpt, overrides):
    """Three rollouts through the RL step (KL loss's reference pass included) with and without
    trainer.fused_logprobs: the same metrics and weights."""
    runs = []
    for fused in (True, False):
        cfg = config("rollout.n_samples_per_prompt=2", "rollout.batch_size=4", "trainer.micro_batch_size=3",
                     f"trainer.fused_logprobs={str(fused).lower()}", *overrides)
        rl, be = rl_trainer(cfg, tiny_ckpt)
        metrics = [train(rl, cfg, fake_rollout(8, seed=s)) for s in range(3)]
        runs.append((metrics, {k: v.clone() for k, v in be.model.state_dict().items()}))
    (fm, fw), (pm, pw) = runs
    for a, b in zip(fm, pm):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    # Adam divides by the gradient's RMS: a 1e-7 difference in a gradient near zero can move a weight by up to
    # the learning rate a step (3e-3 here; the gradients themselves are compared in the test above)
    for k in fw:
        torch.testing.assert_close(fw[k], pw[k], rtol=1e-5, atol=1e-2 * cfg.algo.lr)


def test_reference_log_probs_through_the_fused_head(tiny_ckpt):
    """The reference pass (functional_call with the first weights) reads the reference's head weight."""
    cfg = config("trainer.fused_logprobs=true")
    be = backend(cfg, tiny_ckpt)
    mbs = be.micro_batches(fake_rollout(8), list(range(8)), 3)
    first = be.log_probs(mbs, 1.0)
    with torch.no_grad():
        for p in be.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert not torch.allclose(be.log_probs(mbs, 1.0), first)
    torch.testing.assert_close(be.log_probs(mbs, 1.0, reference=True), first)
    be.trainer_cfg.fused_logprobs = False
    torch.testing.assert_close(be.log_probs(mbs, 1.0, reference=True), first, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_compiled_head_is_the_plain_one():
    """``fuse`` with torch.compile itself (inductor's CPU code; about half a minute here): chunks of two sizes
    (one graph, dynamic), log-probs, entropies and both gradients as the plain head's."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(37, 32, generator=g, requires_grad=True)
    weight = torch.randn(300, 32, generator=g, requires_grad=True)
    targets = torch.randint(0, 300, (37,), generator=g)
    a, b = torch.randn(37, generator=g), torch.randn(37, generator=g)
    lp, ent = head_log_probs(hidden, weight, targets, 0.8, with_entropy=True, chunk=16, fuse=True)
    (lp * a + ent * b).sum().backward()
    got = (lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    lp, ent = _plain(hidden, weight, targets, 0.8)
    (lp * a + ent * b).sum().backward()
    for x, y in zip(got, (lp.detach(), ent.detach(), hidden.grad, weight.grad)):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_compiled_chunks_have_no_single_row_tail():
    """Dynamo compiles a size of 1 apart from the others: with ``fuse`` a last chunk of one row joins the one before,
    so a batch whose row count leaves one over compiles nothing mid-step; eager chunks are as they were."""
    from slime_hydra.train.logprobs import chunk_slices

    def sizes(rows, chunk, fuse):
        return [s.stop - s.start for s in chunk_slices(rows, chunk, fuse)]

    assert sizes(10, 3, True) == [3, 3, 4] and sizes(10, 3, False) == [3, 3, 3, 1]
    assert sizes(9, 3, True) == [3, 3, 3] and sizes(1, 4, True) == [1] and sizes(5, 4, True) == [5]
    assert sizes(0, 4, True) == []
