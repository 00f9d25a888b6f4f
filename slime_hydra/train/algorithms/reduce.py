"""Loss reduction over an optimiser step split into micro-batches: a ``Reducer`` is built once per step from
step-wide totals and each micro-batch's loss is ``reducer(x, mask)``, so the gradients accumulated over the
step are those of the step loss. With ``x_it`` per token and ``m_it`` the loss mask:

- ``sample_mean`` (slime's default): ``sum_i (sum_t x_it m_it / max(sum_t m_it, 1)) / num_samples``;
- ``token_mean`` (DAPO, arXiv 2503.14476): ``sum_it x_it m_it / num_tokens``;
- ``token_sum`` (Dr. GRPO, arXiv 2503.20783, no length bias): ``sum_it x_it m_it / (num_samples * max_len)``.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Tuple

import torch
from torch import Tensor

from slime_hydra.train.algorithms import REDUCTIONS


def _masked(x: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
    """(x * m in float32 with padded positions forced to 0 even if x is inf/nan there, m as float32)."""
    m = mask.float()
    x = x.float()
    return torch.where(m != 0, x * m, torch.zeros_like(x)), m


class Reducer:
    """Reduces a per-token ``[b, T]`` tensor of one micro-batch to its share of the step's scalar.
    ``num_samples``, ``num_tokens``: samples and loss-mask tokens in the step; ``max_len``: the ``token_sum``
    normaliser per sample (the generation budget, ``rollout.max_response_len``, as in Dr. GRPO)."""

    def __init__(self, kind: str, num_samples: int, num_tokens: int, max_len: int):
        if kind not in REDUCTIONS:
            raise ValueError(f"unknown reduction {kind!r}; expected one of {REDUCTIONS}")
        self.kind, self.num_samples, self.num_tokens, self.max_len = kind, num_samples, num_tokens, max_len

    @classmethod
    def for_step(cls, kind: str, masks: Iterable[Tensor], max_len: int) -> "Reducer":
        """Build from the loss masks (``[b, T]`` each) of all micro-batches of one step."""
        masks = list(masks)
        return cls(kind, sum(int(m.shape[0]) for m in masks), int(sum(float(m.float().sum()) for m in masks)), max_len)

    @property
    def metric(self) -> "Reducer":
        """For diagnostics: ``token_sum`` reports the token mean (it would scale a fraction by mean / max length)."""
        if self.kind != "token_sum":
            return self
        return Reducer("token_mean", self.num_samples, self.num_tokens, self.max_len)

    def __call__(self, x: Tensor, mask: Tensor) -> Tensor:
        xm, m = _masked(x, mask)
        if self.kind == "sample_mean":
            per_sample = xm.sum(-1) / m.sum(-1).clamp_min(1.0)
            return per_sample.sum() / max(self.num_samples, 1)
        if self.kind == "token_mean":
            return xm.sum() / max(self.num_tokens, 1)
        return xm.sum() / max(self.num_samples * self.max_len, 1)

    def __repr__(self) -> str:
        return (f"Reducer({self.kind!r}, num_samples={self.num_samples}, num_tokens={self.num_tokens}, "
                f"max_len={self.max_len})")


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8,
                  all_reduce: Optional[Callable[[Tensor], Tensor]] = None) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and unbiased (Bessel) variance over the masked
    elements only; masked-out positions come back as 0. As slime's ``distributed_masked_whiten``:
    ``all_reduce`` (a sum over data-parallel ranks, returning the summed tensor) makes the moments
    those of every rank's elements, so each rank whitens its shard with the global statistics."""
    xm, m = _masked(x, mask)
    reduce = all_reduce or (lambda t: t)
    n, total = reduce(torch.stack([m.sum(), xm.sum()]).double()).to(xm.device).unbind()
    if n == 0:
        return torch.zeros_like(xm)
    mean = total / n
    var = reduce(_masked((x.double() - mean) ** 2, m)[0].sum().reshape(1))[0].to(xm.device) / n
    if n >= 2:
        var = var * n / (n - 1)
    out = ((x.double() - mean) * torch.rsqrt(var + eps)).float()
    return torch.where(m != 0, out, torch.zeros_like(out))
