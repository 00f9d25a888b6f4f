"""On a GPU: the megatron backend steps, offloads to the host, onloads and steps again, twice (the
colocated choreography of every step). Step 2 used to fail in torch's fused AdamW after the optimizer
state came back from the host ("state_steps is on cpu"); and after an onload, backward left DDP's
``main_grad`` at zero (the parameters' gradient accumulators were new, DDP's hooks on the old ones), so
every colocated step after the first trained on nothing. One step offloads in two parts (the optimizer
state, then the weights: ``parallelism.push_before_offload``). Skipped without CUDA and megatron-core. Every GPU
bench runs it first (``bench/gpu/env.sh``, once per machine and code) and stops if it fails."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
pytest.importorskip("megatron.core")

from megatron_cpu import saved_checkpoint, tiny_hf_model  # noqa: E402
from train.tiny_trainer import fake_rollout  # noqa: E402

from conftest import resolved  # noqa: E402


def _row_weighted_loss(rows, log_probs, entropy):
    """A loss with a non-zero gradient whatever the weights: row i's log-probs weighted by i + 1."""
    weights = 1.0 + torch.arange(log_probs.shape[0], device=log_probs.device)[:, None]
    return -(log_probs * weights).sum(), {}


@pytest.mark.parametrize("distributed", [True, False])
def test_megatron_steps_after_offload_and_onload(tmp_path, distributed):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from slime_hydra.train.backend import BACKENDS
    from slime_hydra.train.trainer import RLTrainer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    saved_checkpoint(tiny_hf_model("qwen3"), str(tmp_path))
    cfg = resolved(["trainer=megatron", "parallelism=1gpu", "trainer.max_tokens_per_micro_batch=64",
                    "trainer.recompute=none", "model.dtype=bfloat16", "algo.lr=1e-3",
                    f"trainer.use_distributed_optimizer={distributed}"])
    be = BACKENDS["megatron"](model=cfg.model, algo=cfg.algo, trainer=cfg.trainer, parallelism=cfg.parallelism,
                                  model_path=str(tmp_path), rank=0, world_size=1, device=torch.device("cuda"))
    try:
        rl = RLTrainer(be, cfg.algo, 1)
        before = {k: v.float().clone() for k, v in be.hf_weights()}
        for step in range(3):
            data = fake_rollout(8, seed=step)
            mbs = be.micro_batches(data, list(range(8)), 3)
            be.accumulate_grads(mbs, 1.0, _row_weighted_loss)
            main = sum(float(p.main_grad.float().norm() ** 2) for c in be.chunks for p in c.parameters()) ** 0.5
            assert main > 0, f"step {step}: backward left main_grad at zero"
            out = rl.train(data, temperature=1.0, max_response_len=3)
            assert all(torch.isfinite(torch.tensor(float(v))) for v in out.values() if isinstance(v, (int, float)))
            assert out["grad_norm"] > 0, out  # the norm the optimizer clipped by (weight decay is 0: steps need it)
            free = torch.cuda.memory_allocated()
            if step == 1:  # parallelism.push_before_offload: the optimizer state first, the push, then the weights
                be.offload(keep_weights=True)
                kept = torch.cuda.memory_allocated()
                assert kept < free
                weights = {}
                for k, t in be.hf_weights():  # views of the GPU's weights: copied before the offload frees them
                    assert t.is_cuda, k  # the push reads the GPU's weights
                    weights[k] = t.cpu()
                be.offload()
                assert torch.cuda.memory_allocated() < kept
                pushed_from_host = {k: t.cpu() for k, t in be.hf_weights()}
                assert all(torch.equal(weights[k], pushed_from_host[k]) for k in weights)
            else:
                be.offload()
            assert torch.cuda.memory_allocated() < free  # the state really left the GPU
            be.onload()
            for o in be._inner_optimizers():
                for group in o.optimizer.param_groups:
                    for p in group["params"]:
                        step_count = o.optimizer.state[p]["step"]
                        assert step_count.device.type == ("cuda" if group.get("fused") else "cpu")
        after = dict(be.hf_weights())
        assert any(not torch.equal(before[k], after[k].float()) for k in before)  # the steps moved the weights
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
