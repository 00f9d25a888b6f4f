"""On a GPU: the fused log-prob head (``trainer.fused_logprobs``, slime_hydra/train/logprobs.py) under bf16
autocast with float32 weights, as the torch backend runs it, against the [B, L, V] logits path: the same
log-probs and gradients (to bf16 rounding of the matmul, computed the same way), and less peak memory; so too
with its softmax statistics compiled (``fuse``, as ``trainer.compile`` runs it).
Skipped without CUDA; the GPU benches run ``python3 -m pytest -q tests/gpu`` in every call."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

from slime_hydra.train.batch import MicroBatch, response_log_probs  # noqa: E402
from slime_hydra.train.logprobs import head_log_probs, response_rows  # noqa: E402


def test_fused_head_matches_the_logits_path_with_less_memory():
    dev = torch.device("cuda")
    # the Qwen3-0.6B head, 32 samples of 64 + 256 tokens (a micro-batch the plan picks). The fused head's memory
    # is a few 1024-row chunks whatever the batch, so it saves the most on large ones: on the H200, 4.1 against
    # 5.1 GiB at 8 samples, 3.5 against 14.2 GiB at 32 (bench/logprob_head.py)
    B, P, T, H, V = 32, 64, 256, 1024, 151936
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, P + T, H, generator=g).to(dev).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.02).to(dev).requires_grad_(True)
    ids = torch.randint(0, V, (B, T), generator=g).to(dev)
    start = torch.randint(1, P + 1, (B,), generator=g).to(dev)
    mb = MicroBatch(None, None, start, ids, torch.ones(B, T, device=dev), list(range(B)))
    adv = torch.randn(B, T, generator=g).to(dev)
    out = {}
    for name in ("logits", "fused", "compiled", "compiled"):  # the first compiled pass compiles
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if name == "logits":
                lp, ent = response_log_probs(hidden @ weight.T, mb, 0.9, with_entropy=True, entropy_grad=False)
            else:
                lp, ent = head_log_probs(response_rows(hidden, start, T), weight, ids.reshape(-1), 0.9,
                                         with_entropy=True, fuse=name == "compiled")
                lp, ent = lp.view(B, T), ent.detach().view(B, T)
        (-(lp * adv).mean()).backward()
        torch.cuda.synchronize()
        out[name] = (lp.detach(), ent, hidden.grad.clone(), weight.grad.clone(),
                     torch.cuda.max_memory_allocated() - base)
    lp1, e1, gh1, gw1, peak1 = out["logits"]
    for name in ("fused", "compiled"):
        lp2, e2, gh2, gw2, peak2 = out[name]
        assert lp2.dtype == torch.float32 and gw2.dtype == torch.float32
        # the same bf16 matmul over other row counts may round a logit one bf16 step apart: compare whole tensors
        for a, b in ((lp2, lp1), (e2, e1), (gh2, gh1), (gw2, gw1)):
            assert float((a - b).norm() / b.norm()) < 1e-2, name
        assert float((lp2 - lp1).abs().max()) < 5e-2, name
        assert peak2 < 0.5 * peak1, (name, peak2 / 2**30, peak1 / 2**30)
