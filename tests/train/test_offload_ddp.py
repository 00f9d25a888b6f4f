"""Offload and DDP on two gloo ranks: after an onload the ranks still all-reduce their gradients.

On a GPU, :class:`~slime_hydra.train.backends.torch.offload.Offloader` points every parameter's ``.data``
at a host buffer and back. autograd then gives each parameter a new gradient accumulator, and DDP's
all-reduce hooks stay on the old ones, so each rank went on training on its own gradients without an
error. On CPU nothing moves, so the test makes the same change to autograd's bookkeeping with a dtype
round trip (``set_data`` resets the accumulator when the device or the dtype changes), as a GPU onload
does."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_trainer import config, fake_rollout, rl_trainer, train

from slime_hydra.utils.proc import free_port


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank, port, ckpt, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        cfg = config("trainer.num_rollout=10", "trainer.micro_batch_size=2", "algo.lr=1e-3")
        rl, be = rl_trainer(cfg, ckpt, rank, 2)
        data = fake_rollout(8, seed=rank)  # each rank its own samples: only the all-reduce makes grads equal
        res = {}
        for case in ("stale_hooks", "onload"):
            for p in be.model.parameters():  # what a GPU offload + onload does to autograd's bookkeeping
                p.data = p.data.double()
                p.data = p.data.float()
            if case == "onload":
                be.offloaders[0].moved = True  # as Offloader.offload leaves it on a GPU
                be.onload()
            train(rl, cfg, data)
            res[case] = _grads(be.model)
            dist.barrier()
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_ddp_all_reduces_again_after_an_onload(tiny_ckpt, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(free_port(), tiny_ckpt, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    # the failure the fix is for: with DDP's hooks on the old accumulators the ranks' gradients differ
    assert any(not torch.equal(g, r1["stale_hooks"][n]) for n, g in r0["stale_hooks"].items())
    # TorchBackend.onload builds DDP again: the gradients are all-reduced, equal on both ranks
    assert r0["onload"] and sorted(r0["onload"]) == sorted(r1["onload"])
    for n, g in r0["onload"].items():
        torch.testing.assert_close(g, r1["onload"][n], rtol=0, atol=0, msg=n)
