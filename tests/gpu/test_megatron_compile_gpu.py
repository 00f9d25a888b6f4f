"""On a GPU: ``trainer.compile`` on the megatron backend, bf16, packed sequences through torch's varlen flash
attention and the packed RoPE. No graph break inside a layer except megatron's closing ``make_viewless_tensor``
(the packed RoPE reads nothing on the host, the linears pass their TP group); log-probs and gradients agree with
the eager layers' to bf16 rounding, for two rollouts of other lengths. (A second rollout of other sizes may
compile again: inductor guards the range of sizes a graph was made for. That the warm-up of the step's shape
leaves step 1 nothing to compile is measured by ``bench/warm_up_gpu.py``.) Skipped without CUDA and
megatron-core."""

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


def _loss(rows, lp, ent):
    return -(lp * torch.linspace(-1, 1, lp.shape[-1], device=lp.device)).sum(), {}


def test_megatron_compiled_layers_on_gpu(tmp_path):
    import torch._dynamo
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch._dynamo.utils import counters

    from slime_hydra.train.backend import BACKENDS

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    saved_checkpoint(tiny_hf_model("qwen3"), str(tmp_path))
    long = fake_rollout(8, seed=1)
    long["tokens"] = [t + t[:5] for t in long["tokens"]]  # each rollout one micro-batch of 8 sequences
    rollouts = [fake_rollout(8, seed=0), long]
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        cfg = resolved(["trainer=megatron", "parallelism=1gpu", "trainer.max_tokens_per_micro_batch=4096",
                        "model.dtype=bfloat16", f"trainer.compile={str(compiled).lower()}"])
        be = BACKENDS["megatron"](model=cfg.model, algo=cfg.algo, trainer=cfg.trainer,
                                      parallelism=cfg.parallelism, model_path=str(tmp_path), rank=0, world_size=1,
                                      device=torch.device("cuda"))
        try:
            got = []
            for data in rollouts:
                mbs = be.micro_batches(data, list(range(8)), max(data["response_lengths"]))
                lp = be.log_probs(mbs, 1.0)
                be.accumulate_grads(mbs, 1.0, _loss)
                grads = torch.cat([p.main_grad.float().flatten() for p in be._params()])
                got.append((lp, grads))
            runs[compiled] = got
            if compiled:
                breaks = {k: v for k, v in counters["graph_break"].items() if "make_viewless" not in k
                          and ".data" not in k}
                assert not breaks, breaks
                assert counters["stats"]["unique_graphs"] > 0
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    for (elp, eg), (clp, cg) in zip(runs[False], runs[True]):
        assert (clp - elp).abs().mean() < 0.02, (clp - elp).abs().mean()  # bf16: fused kernels round differently
        cos = torch.nn.functional.cosine_similarity(cg, eg, dim=0)
        assert cos > 0.99, cos
