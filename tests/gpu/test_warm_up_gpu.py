"""On a GPU: ``trainer.warm_up`` on both trainers leaves the weights, the gradients, the optimizer and the random
generators (CUDA's, and megatron's tracker) as they were, and a training step follows. The CPU tests check the
same on CPU (``tests/train/test_torch_backend.py``, ``tests/train/test_megatron_backend.py``); this one runs the CUDA
paths: CUDA's RNG, megatron's distributed optimizer and its torch.compile'd fusions. Skipped without CUDA (and
the megatron case without megatron-core); `bench/README.md`'s first GPU call of a session runs tests/gpu."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

from train.tiny_trainer import fake_rollout  # noqa: E402

from conftest import resolved  # noqa: E402
from slime_hydra.train.backend import WarmUpShape  # noqa: E402


def _warmed(be, weight: torch.Tensor) -> None:
    """``be.warm_up``, checked to run a backward (a gradient reaches ``weight``)."""
    backward = []
    hook = weight.register_hook(lambda g: backward.append(1))
    be.warm_up(1.0, WarmUpShape(samples=8, length=16, response_len=8))
    hook.remove()
    assert backward


def _unchanged(be, weights, cuda_rng) -> None:
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    for k, v in be.hf_weights():
        assert torch.equal(v, weights[k]), k


def test_torch_warm_up_on_a_gpu(tiny_ckpt):
    from slime_hydra.train.backends.torch.backend import TorchBackend
    from slime_hydra.train.trainer import RLTrainer

    cfg = resolved(["parallelism=1gpu", "trainer.micro_batch_size=4", "model.dtype=bfloat16"])
    assert cfg.trainer.warm_up is True
    be = TorchBackend(model=cfg.model, algo=cfg.algo, trainer=cfg.trainer, parallelism=cfg.parallelism,
                      model_path=tiny_ckpt, rank=0, world_size=1, device=torch.device("cuda"))
    weights = {k: v.clone() for k, v in be.hf_weights()}
    rng = torch.cuda.get_rng_state()
    _warmed(be, next(be.model.parameters()))
    assert all(p.grad is None for p in be.model.parameters()) and not be.opt.state
    _unchanged(be, weights, rng)
    out = RLTrainer(be, cfg.algo, 1).train(fake_rollout(8), temperature=1.0, max_response_len=3)
    assert out["grad_norm"] > 0


@pytest.mark.parametrize("distributed", [True, False])
def test_megatron_warm_up_on_a_gpu(tmp_path, distributed):
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron_cpu import saved_checkpoint, tiny_hf_model

    from slime_hydra.train.backend import BACKENDS
    from slime_hydra.train.trainer import RLTrainer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    saved_checkpoint(tiny_hf_model("qwen3"), str(tmp_path))
    cfg = resolved(["trainer=megatron", "parallelism=1gpu", "trainer.max_tokens_per_micro_batch=64",
                    "trainer.recompute=none", "model.dtype=bfloat16",
                    f"trainer.use_distributed_optimizer={distributed}"])
    be = BACKENDS["megatron"](model=cfg.model, algo=cfg.algo, trainer=cfg.trainer, parallelism=cfg.parallelism,
                                  model_path=str(tmp_path), rank=0, world_size=1, device=torch.device("cuda"))
    try:
        weights = {k: v.clone() for k, v in be.hf_weights()}
        rng = torch.cuda.get_rng_state()
        _warmed(be, be._params()[0])
        assert all(float(p.main_grad.abs().sum()) == 0 for p in be._params())
        assert not any(o.optimizer.state for o in be._inner_optimizers())
        _unchanged(be, weights, rng)
        out = RLTrainer(be, cfg.algo, 1).train(fake_rollout(8), temperature=1.0, max_response_len=3)
        assert out["grad_norm"] > 0
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
