"""The megatron trainer backend on CPU (gloo, TP = PP = 1, float32): construction through megatron's DDP
and optimizer (the non-distributed one: the distributed optimizer asserts CUDA tensors), packed
micro-batches in row order, log-probs equal to the torch backend's on the same checkpoint, gradients of
the same loss with the same norm (the loss scaling), and the weights it pushes and exports equal to the
checkpoint's bit for bit. megatron's DDP and schedules assume CUDA, so the CUDA calls are pointed at
the CPU here (``tests/megatron_cpu.py``, tests only); the optimizer step and
the whole run need a GPU (``bench/megatron_run.sh``)."""

from __future__ import annotations

import megatron_cpu
import pytest
import torch
from megatron_cpu import saved_checkpoint, tiny_hf_model  # skips without megatron
from train.tiny_trainer import fake_rollout

from conftest import resolved
from slime_hydra.train.backend import WarmUpShape


def cuda_on_cpu():
    return megatron_cpu.trainer_on_cpu()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3"))
    weights = saved_checkpoint(tiny_hf_model("qwen3"), path)
    return path, weights


@pytest.fixture(scope="module")
def cfg():
    return resolved(["trainer=megatron", "algo.kl_loss_coef=0.1", "trainer.max_tokens_per_micro_batch=20",
                     "trainer.use_distributed_optimizer=false"])  # the distributed one checks for CUDA tensors


@pytest.fixture(scope="module")
def backend(ckpt, cfg):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from slime_hydra.train.backend import BACKENDS

    with cuda_on_cpu():
        be = BACKENDS["megatron"](model=cfg.model, algo=cfg.algo, trainer=cfg.trainer,
                                      parallelism=cfg.parallelism, model_path=ckpt[0], rank=0, world_size=1,
                                      device=torch.device("cpu"))
        try:
            yield be
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def test_layout_on_one_rank(backend):
    assert (backend.dp_rank, backend.dp_size, backend.pushes_weights, backend.reports_metrics) == (0, 1, True, True)
    assert backend.critic is None


def test_micro_batches_keep_row_order_within_the_token_budget(backend):
    data = fake_rollout(8)
    mbs = backend.micro_batches(data, list(range(8)), 3)
    assert [i for mb in mbs for i in mb.indices] == list(range(8))
    assert len(mbs) > 1 and all(mb.packed.num_tokens <= 20 for mb in mbs)


def test_log_probs_equal_the_torch_backends(backend, ckpt, cfg):
    from slime_hydra.train.backends.torch.backend import TorchBackend

    data = fake_rollout(8)
    rows, T = list(range(8)), max(data["response_lengths"])
    torch_cfg = resolved(["algo.kl_loss_coef=0.1"])
    tb = TorchBackend(model=torch_cfg.model, algo=torch_cfg.algo, trainer=torch_cfg.trainer,
                      parallelism=torch_cfg.parallelism, model_path=ckpt[0], rank=0, world_size=1,
                      device=torch.device("cpu"))
    want = tb.log_probs(tb.micro_batches(data, rows, T), 0.7)
    with cuda_on_cpu():
        mbs = backend.micro_batches(data, rows, T)
        got = backend.log_probs(mbs, 0.7)
        ref = backend.log_probs(mbs, 0.7, reference=True)
    assert got.shape == want.shape == (8, T) and got.dtype == torch.float32
    mask = torch.tensor([[t < r for t in range(T)] for r in data["response_lengths"]])
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(ref, got, atol=0, rtol=0)  # nothing trained yet: the reference is the policy
    assert (got[~mask] == 0).all()  # zero past each response (the torch backend leaves them unmasked)


def test_hf_weights_round_trip_bit_for_bit(backend, ckpt):
    with cuda_on_cpu():
        got = dict(backend.hf_weights())
    weights = ckpt[1]
    assert set(got) == set(weights) - {"lm_head.weight"} or set(got) == set(weights)
    for k, v in got.items():
        assert v.dtype == torch.float32 and torch.equal(v, weights[k]), k


def test_export_hf_loads_in_transformers(backend, ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    with cuda_on_cpu():
        backend.export_hf(str(tmp_path / "hf"), None)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ckpt[1][k]), k


def _policy_loss(data, T):
    """A loss of both log-probs and entropies, as a share of a two-micro-batch step."""
    mask = torch.tensor([[float(t < r) for t in range(T)] for r in data["response_lengths"]])
    weights = torch.linspace(-1.0, 1.0, len(data["tokens"]))

    def loss_fn(idx, lp, ent):
        m = mask[list(idx)]
        loss = ((lp * weights[list(idx), None] - 0.01 * ent) * m).sum() / mask.sum()
        return loss, {"loss": loss.detach()}

    return loss_fn


def test_gradients_match_the_torch_backend(backend, ckpt, cfg):
    """The same loss through both backends: the same gradient norm (megatron's optimizer step itself
    asserts CUDA tensors, so the step stops at the accumulated ``main_grad`` buffers here)."""
    from slime_hydra.train.backends.torch.backend import TorchBackend

    data = fake_rollout(8)
    rows, T = list(range(8)), max(data["response_lengths"])
    torch_cfg = resolved(["algo.kl_loss_coef=0.1", "trainer.micro_batch_size=3", "algo.clip_grad=1e9"])
    tb = TorchBackend(model=torch_cfg.model, algo=torch_cfg.algo, trainer=torch_cfg.trainer,
                      parallelism=torch_cfg.parallelism, model_path=ckpt[0], rank=0, world_size=1,
                      device=torch.device("cpu"))
    want = tb.train_step(tb.micro_batches(data, rows, T), 0.7, _policy_loss(data, T))
    with cuda_on_cpu():
        mbs = backend.micro_batches(data, rows, T)
        metrics = backend.accumulate_grads(mbs, 0.7, _policy_loss(data, T))
    norm = sum(float(p.main_grad.double().pow(2).sum()) for p in backend._params()) ** 0.5
    assert len(mbs) > 1 and norm > 0
    assert abs(norm - want.grad_norm) < 1e-5 * want.grad_norm, (norm, want.grad_norm)
    assert abs(metrics["loss"] - want.metrics["loss"]) < 1e-6


def test_adam_steps_with_torchs_fused_kernel(backend):
    """Without TE or apex, megatron's torch Adam is switched to the fused kernel, and that switch made after
    construction steps exactly as an AdamW built fused (and as the foreach one, to rounding)."""
    from types import SimpleNamespace

    from slime_hydra.train.backends.megatron.model import use_fused_adam

    groups = [g for o in getattr(backend.opt, "chained_optimizers", [backend.opt]) for g in o.optimizer.param_groups]
    assert groups and all(g["fused"] and not g["foreach"] for g in groups)

    def trained(make, switch=False):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(64, 32))
        opt = make([w])
        if switch:
            assert use_fused_adam(SimpleNamespace(optimizer=opt)) == 1
        for _ in range(3):
            opt.zero_grad()
            (w.sin() * torch.arange(32.0)).sum().backward()
            opt.step()
        return w.detach()

    kw = dict(lr=1e-2, weight_decay=0.1)
    switched = trained(lambda p: torch.optim.AdamW(p, foreach=True, **kw), switch=True)
    assert torch.equal(switched, trained(lambda p: torch.optim.AdamW(p, fused=True, **kw)))
    torch.testing.assert_close(switched, trained(lambda p: torch.optim.AdamW(p, foreach=True, **kw)))


def test_old_log_probs_from_the_training_forward_give_the_same_gradients_and_metrics(backend, cfg, monkeypatch):
    """The on-policy shortcut on megatron (one optimiser step per rollout: the old policy's log-probs are
    the training forward's, detached): the RL step's gradients (the accumulated ``main_grad``) and its
    metrics, the log-prob gap included, equal those with a pass of their own. The optimizer step itself
    needs CUDA tensors, so the step stops at the gradients here."""
    from slime_hydra.train.backend import StepResult
    from slime_hydra.train.trainer import RLTrainer

    grads = {}

    def grads_only(mbs, temperature, loss_fn):
        metrics = backend.accumulate_grads(mbs, temperature, loss_fn)
        grads["now"] = [p.main_grad.detach().clone() for p in backend._params()]
        return StepResult(grad_norm=sum(float(g.double().pow(2).sum()) for g in grads["now"]) ** 0.5,
                          metrics=metrics)

    monkeypatch.setattr(backend, "train_step", grads_only)
    passes = []
    log_probs = backend.log_probs

    def counted(mbs, temperature, reference=False):
        passes.append(reference)
        return log_probs(mbs, temperature, reference=reference)

    monkeypatch.setattr(backend, "log_probs", counted)
    data = fake_rollout(8)
    data["rollout_log_probs"] = [[-1.5] * r for r in data["response_lengths"]]
    runs = []
    with cuda_on_cpu():
        for reuse in (True, False):
            passes.clear()
            rl = RLTrainer(backend, cfg.algo, 1, reuse_step_log_probs=reuse)
            metrics = rl.train(data, temperature=0.7, max_response_len=cfg.rollout.max_response_len)
            runs.append((metrics, grads["now"], list(passes)))
    (m1, g1, p1), (m2, g2, p2) = runs
    assert p1 == [True] and p2 == [False, True]  # the shortcut left out the old policy's pass, only that
    assert m1.keys() == m2.keys() and m1["train_rollout_logprob_abs_diff"] > 0
    assert (m1.pop("extra_forward_passes"), m2.pop("extra_forward_passes")) == (1, 2)
    for k in m1:
        assert m1[k] == pytest.approx(m2[k], rel=1e-5, abs=1e-7), k
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_warm_up_leaves_weights_gradients_and_rng_as_they_were(backend, ckpt):
    """``trainer.warm_up`` on megatron: the dummy rows go through the step's no-grad log-prob pass, then forward
    and backward through the schedule (DDP's ``main_grad`` buffers fill), then the buffers are zeroed; no
    optimizer step, the random generators restored. The next step's gradients
    (``test_gradients_match_the_torch_backend``) start from zeroed buffers anyway; what must hold is that nothing
    else moved."""
    weights = {k: v.clone() for k, v in backend.hf_weights()}
    torch.rand(1)  # the warm-up restores the state it found, whatever that is
    rng = torch.get_rng_state()
    backward = []  # the pass really ran a backward through megatron's schedule
    hook = backend._params()[0].register_hook(lambda g: backward.append(1))
    passes = []  # (grad enabled, train mode) of each forward: the step's no-grad log-prob pass ran too
    forward = backend.chunks[0].register_forward_hook(
        lambda m, i, o: passes.append((torch.is_grad_enabled(), m.training)))
    with cuda_on_cpu():
        backend.warm_up(1.0, WarmUpShape(samples=3, length=6, response_len=3))  # 18 tokens: one packed micro-batch
    hook.remove()
    forward.remove()
    assert backward and (False, False) in passes and (True, True) in passes
    assert all(float(p.main_grad.abs().sum()) == 0 for p in backend._params())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, weights[k]) for k, v in backend.hf_weights())
    assert not any(o.optimizer.state for o in backend._inner_optimizers())
