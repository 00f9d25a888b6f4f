"""algo=sft through the megatron backend on CPU: the RL step with SFT's estimator and loss gives the torch
backend's cross-entropy on the same batch, and two steps on it lower it."""

from __future__ import annotations

import megatron_cpu
import pytest
import torch
from megatron_cpu import saved_checkpoint, tiny_hf_model  # skips without megatron
from train.tiny_trainer import fake_rollout, rl_trainer

from conftest import resolved

SFT = ["algo=sft", "algo.lr=1e-2", "algo.clip_grad=1e9", "rollout.n_samples_per_prompt=1"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3"))
    saved_checkpoint(tiny_hf_model("qwen3"), path)
    return path


def test_sft_loss_through_megatron_equals_torchs_and_falls(ckpt):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from slime_hydra.train.backend import BACKENDS
    from slime_hydra.train.trainer import RLTrainer

    data = fake_rollout(8)
    torch_cfg = resolved(SFT)
    torch_rl, _ = rl_trainer(torch_cfg, ckpt)
    want = torch_rl.train(data, temperature=1.0, max_response_len=8)["pg_loss"]
    cfg = resolved([*SFT, "trainer=megatron", "trainer.use_distributed_optimizer=false"])
    with megatron_cpu.trainer_on_cpu():
        be = BACKENDS["megatron"](model=cfg.model, algo=cfg.algo, trainer=cfg.trainer, parallelism=cfg.parallelism,
                                  model_path=ckpt, rank=0, world_size=1, device=torch.device("cpu"))
        try:
            rl = RLTrainer(be, cfg.algo, cfg.trainer.num_steps_per_rollout)
            losses = [rl.train(data, temperature=1.0, max_response_len=8)["pg_loss"] for _ in range(2)]
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    # the response tokens' mean cross-entropy, as the torch backend's
    assert losses[0] == pytest.approx(want, rel=1e-5)
    assert losses[1] < losses[0]
