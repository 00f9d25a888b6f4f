"""``trainer.compile`` on the megatron backend: its decoder layers under torch.compile give the eager
layers' log-probs, loss and gradients, for two rollouts of different lengths (dynamic shapes). Slow: inductor
compiles each layer's forward, no-grad forward and backward on the CPU (about a minute here). On CPU the packed
attention runs one SDPA call per sequence (a graph break); GPUs run one varlen flash call."""

from __future__ import annotations

import megatron_cpu
import pytest
import torch
from megatron_cpu import saved_checkpoint, tiny_hf_model  # skips without megatron
from train.tiny_trainer import fake_rollout

from conftest import resolved


def _loss(rows, lp, ent):
    return -(lp * torch.linspace(-1, 1, lp.shape[-1])).sum(), {"lp_sum": lp.sum().detach()}


@pytest.mark.slow
def test_compiled_megatron_layers_train_as_eager_ones(tmp_path):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from slime_hydra.train.backend import BACKENDS

    path = str(tmp_path / "qwen3")
    saved_checkpoint(tiny_hf_model("qwen3"), path)
    long = fake_rollout(8, seed=1)
    long["tokens"] = [t + t[:3] for t in long["tokens"]]
    rollouts = [fake_rollout(8, seed=0), long]
    runs = []
    for compiled in (True, False):
        cfg = resolved(["trainer=megatron", "trainer.max_tokens_per_micro_batch=20",
                        "trainer.use_distributed_optimizer=false", f"trainer.compile={str(compiled).lower()}"])
        with megatron_cpu.trainer_on_cpu():
            be = BACKENDS["megatron"](model=cfg.model, algo=cfg.algo, trainer=cfg.trainer,
                                          parallelism=cfg.parallelism, model_path=path, rank=0, world_size=1,
                                          device=torch.device("cpu"))
            try:
                layers = [layer for c in be.chunks for layer in c.module.decoder.layers]
                assert all((layer._compiled_call_impl is not None) == compiled for layer in layers)
                got = []
                for data in rollouts:
                    rows, width = list(range(8)), max(data["response_lengths"])
                    mbs = be.micro_batches(data, rows, width)
                    lp = be.log_probs(mbs, 0.7)
                    metrics = be.accumulate_grads(mbs, 0.7, _loss)
                    got.append((lp, metrics, [p.main_grad.clone() for p in be._params()]))
                runs.append(got)
            finally:
                parallel_state.destroy_model_parallel()
                dist.destroy_process_group()
    for (clp, cm, cg), (elp, em, eg) in zip(*runs):
        torch.testing.assert_close(clp, elp, rtol=1e-5, atol=1e-5)
        assert cm["lp_sum"] == pytest.approx(em["lp_sum"], rel=1e-5)
        assert any(g.abs().sum() > 0 for g in eg)
        for c, e in zip(cg, eg):
            torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4)
