"""FSDP2 (``trainer.strategy=fsdp``, slime_hydra/train/backends/torch/fsdp.py) on two gloo ranks: the same
loss and gradients as DDP, the whole weights gathered for the engines, the reference sharded like the
policy, and torch.distributed.checkpoint files that resume at another rank count (2 -> 1 -> 2)."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_trainer import config, fake_rollout, rl_trainer, train

from slime_hydra.utils.proc import free_port

# four micro-batches of one sample per rank: the gradients are summed over micro-batches and ranks
COMMON = ("trainer.num_rollout=10", "trainer.micro_batch_size=1", "algo.lr=1e-3", "algo.kl_loss_coef=0.1")


def _full_grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None:
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _compare_worker(rank, port, ckpt, out_dir, extra):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        full = fake_rollout(8)
        half = {k: v[rank * 4:(rank + 1) * 4] for k, v in full.items()}
        res = {}
        for strategy in ("ddp", "fsdp"):
            cfg = config(*COMMON, f"trainer.strategy={strategy}", *extra)
            torch.manual_seed(0)  # LoRA's A matrices start the same under both strategies
            rl, be = rl_trainer(cfg, ckpt, rank, 2)
            m = train(rl, cfg, half)
            grads = _full_grads(be.model)
            weights = dict(be.hf_weights())  # FSDP2: both ranks gather, rank 0 gets them
            res[strategy] = {"metrics": m, "grads": grads, "weights": weights, "pushes": be.pushes_weights}
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks, two backends each: ~70 s on a shared 2-core machine
@pytest.mark.parametrize("extra", [(), ("trainer.lora.rank=4",)], ids=["full", "lora"])
def test_fsdp_matches_ddp_on_two_ranks(tiny_ckpt, tmp_path, extra):
    """One RL step (policy loss + KL to the reference) on two gloo ranks, four micro-batches each:
    FSDP2's loss, KL and gradients are DDP's to float32 precision, and rank 0 streams the same whole
    weights to the engines (rank 1 takes part in the gathers and gets none)."""
    import torch.multiprocessing as mp

    mp.spawn(_compare_worker, args=(free_port(), tiny_ckpt, str(tmp_path), list(extra)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    ddp, fsdp = r0["ddp"], r0["fsdp"]
    for key in ("pg_loss", "kl_loss", "grad_norm", "train_rollout_logprob_abs_diff", "entropy", "loss"):
        assert fsdp["metrics"][key] == pytest.approx(ddp["metrics"][key], rel=1e-5, abs=1e-6), key
    assert ddp["metrics"]["grad_norm"] > 0
    assert sorted(fsdp["grads"]) == sorted(ddp["grads"]) and fsdp["grads"]
    for name, g in ddp["grads"].items():
        torch.testing.assert_close(fsdp["grads"][name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert fsdp["pushes"] and not r1["fsdp"]["pushes"] and r1["fsdp"]["weights"] == {}
    assert list(fsdp["weights"]) == list(ddp["weights"])  # the same Hugging Face names, tied head once
    assert "lm_head.weight" not in fsdp["weights"]
    for name, w in ddp["weights"].items():
        # Adam's first step is ~lr * sign(grad): float noise may flip it where a gradient is ~0
        torch.testing.assert_close(fsdp["weights"][name], w, rtol=0, atol=2.5e-3, msg=name)


def test_fsdp_one_rank_step_is_ddps(tiny_ckpt):
    """The fast suite's check: one rank (its own one-process group), one RL step with the KL loss over
    four micro-batches: FSDP2's metrics and gradients are DDP's; a tied LM head is gathered once."""
    import torch.distributed as dist

    res = {}
    try:
        for strategy in ("ddp", "fsdp"):
            cfg = config(*COMMON, f"trainer.strategy={strategy}")
            rl, be = rl_trainer(cfg, tiny_ckpt)
            res[strategy] = (train(rl, cfg, fake_rollout(4)), _full_grads(be.model), dict(be.hf_weights()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (m_d, g_d, w_d), (m_f, g_f, w_f) = res["ddp"], res["fsdp"]
    for key in ("pg_loss", "kl_loss", "grad_norm", "loss"):
        assert m_f[key] == pytest.approx(m_d[key], rel=1e-5, abs=1e-6), key
    for name, g in g_d.items():
        torch.testing.assert_close(g_f[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert list(w_f) == list(w_d) and "lm_head.weight" not in w_f


# ------------------------------------------------------------------------------------ checkpoints
def _adam(be) -> dict:
    """AdamW's moments by parameter name, whole (every rank gathers)."""
    out = {}
    for name, p in be.model.named_parameters():
        st = be.opt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                v = st[k]
                out[f"{name}.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def _two_ranks(rank, port, ckpt, out_dir, load_from, save_to, extra):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        cfg = config(*COMMON, "trainer.strategy=fsdp", *extra)
        rl, be = rl_trainer(cfg, ckpt, rank, 2)
        if load_from:
            rl.load_state_dict(be.load(load_from))
        loaded, loaded_adam = dict(be.hf_weights()), _adam(be) if load_from else {}
        ref = be.log_probs(be.micro_batches(fake_rollout(4), list(range(4)), 3), 1.0, reference=True)
        m = train(rl, cfg, {k: v[rank * 4:(rank + 1) * 4] for k, v in fake_rollout(8, seed=1).items()})
        if save_to:
            os.makedirs(save_to, exist_ok=True)
            be.export_hf(os.path.join(save_to, "hf"), None)
            be.save(save_to, rl.state_dict())
        torch.save({"loaded": loaded, "loaded_adam": loaded_adam, "after": dict(be.hf_weights()), "adam": _adam(be),
                    "metrics": m, "ref": ref, "step": rl.state_dict()}, os.path.join(out_dir, f"two{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # three process groups: ~80 s
@pytest.mark.parametrize("extra", [(), ("trainer.lora.rank=4",)], ids=["full", "lora"])
def test_dcp_checkpoint_resumes_at_another_rank_count(tiny_ckpt, tmp_path, extra, request):
    """Two ranks save (torch.distributed.checkpoint, one file per rank); one rank resumes from it with
    the same weights, reference and AdamW state, trains a step and saves, and two ranks resume from that
    with its weights and AdamW state."""
    import torch.multiprocessing as mp

    from slime_hydra.train.backends.torch import fsdp

    # one thread, as the ranks have: the reference log-probs are compared bit for bit, and on an AVX2 machine
    # two threads summed them differently (2.4e-7)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))

    a, b = str(tmp_path / "two"), str(tmp_path / "one")
    mp.spawn(_two_ranks, args=(free_port(), tiny_ckpt, str(tmp_path), None, a, list(extra)), nprocs=2, join=True)
    saved = torch.load(tmp_path / "two0.pt", weights_only=False)
    assert len([f for f in os.listdir(os.path.join(a, fsdp.DCP_DIR)) if f.endswith(".distcp")]) == 2

    cfg = config(*COMMON, "trainer.strategy=fsdp", *extra)
    rl, be = rl_trainer(cfg, tiny_ckpt)  # one rank: its own one-process group
    rl.load_state_dict(be.load(a))
    assert rl.state_dict() == saved["step"]
    for name, w in dict(be.hf_weights()).items():
        torch.testing.assert_close(w, saved["after"][name], rtol=0, atol=0, msg=name)
    adam = _adam(be)
    assert sorted(adam) == sorted(saved["adam"]) and adam
    for name, v in adam.items():
        torch.testing.assert_close(v, saved["adam"][name], rtol=0, atol=0, msg=name)
    mbs = be.micro_batches(fake_rollout(4), list(range(4)), 3)
    torch.testing.assert_close(be.log_probs(mbs, 1.0, reference=True), saved["ref"], rtol=0, atol=0)
    assert train(rl, cfg, fake_rollout(8, seed=1))["grad_norm"] > 0
    os.makedirs(b)
    be.export_hf(os.path.join(b, "hf"), None)
    be.save(b, rl.state_dict())
    one_after, one_adam = dict(be.hf_weights()), _adam(be)
    import torch.distributed as dist

    dist.destroy_process_group()

    mp.spawn(_two_ranks, args=(free_port(), tiny_ckpt, str(tmp_path), b, None, list(extra)), nprocs=2, join=True)
    back = torch.load(tmp_path / "two0.pt", weights_only=False)
    for name, w in one_after.items():
        torch.testing.assert_close(back["loaded"][name], w, rtol=0, atol=0, msg=name)
    for name, v in one_adam.items():
        torch.testing.assert_close(back["loaded_adam"][name], v, rtol=0, atol=0, msg=name)
    assert back["metrics"]["grad_norm"] > 0
    from transformers import AutoModelForCausalLM

    if not extra:  # the hf/ export is the gathered policy
        hf = AutoModelForCausalLM.from_pretrained(os.path.join(b, "hf"))
        torch.testing.assert_close(hf.model.embed_tokens.weight, one_after["model.embed_tokens.weight"])
