"""Log-probs and entropies of the response tokens straight from a causal LM's last hidden states: the LM head's
matmul, the float32 log-softmax and the entropy run ``chunk`` rows at a time, forward and again backward (as
Liger's fused linear cross-entropy), so the full float32 logits are never kept. :func:`fused_head` swaps the
LM head's ``forward`` so the model's own forward (and its DDP, FSDP2, PEFT hooks) still runs. With
``trainer.compile`` the per-chunk statistics (shared with the megatron head) are torch.compile'd.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, List, Optional, Tuple

import torch

# response rows a chunk (a [chunk, V] float32 temporary; about four live at once in the backward)
HEAD_CHUNK_ROWS = 1024


def row_max(logits: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """``max(logits * inv_temp)`` of each row, float32 (``inv_temp > 0``)."""
    return logits.float().amax(-1) * inv_temp


def softmax_sums(logits: torch.Tensor, m: torch.Tensor, targets: torch.Tensor, in_range: torch.Tensor,
                 inv_temp: float, with_entropy: bool) -> torch.Tensor:
    """``[3, rows]`` float32 for ``x = logits * inv_temp`` and the rows' maxima ``m``: ``sum exp(x - m)``, the
    target column's ``x`` (0 where ``in_range`` is False: the target is in another rank's slice) and, with
    entropy, ``sum exp(x - m) * x`` (else 0). The statistics add up over slices of the vocabulary."""
    x = logits.float() * inv_temp
    e = torch.exp(x - m[:, None])
    se = e.sum(-1)
    chosen = x.gather(-1, targets[:, None])[:, 0] * in_range
    return torch.stack([se, chosen, (e * x).sum(-1) if with_entropy else torch.zeros_like(se)])


def softmax_grad(logits: torch.Tensor, targets: torch.Tensor, in_range: torch.Tensor, lse: torch.Tensor,
                 ent: torch.Tensor, g_logp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor], inv_temp: float,
                 dtype: torch.dtype) -> torch.Tensor:
    """The gradient with respect to ``logits`` (in ``dtype``) of ``g_logp . log p_target + g_ent . H``, where
    ``log p = logits * inv_temp - lse`` and ``H = ent``: ``d log p_t / dz_k = [k = t] - p_k`` and
    ``dH / dz_k = -p_k (log p_k + H)``, times ``inv_temp``. A column equal to the target (in this rank's slice) is
    found by comparison, not a scatter, so that the whole is one pointwise kernel once compiled."""
    logq = logits.float() * inv_temp - lse[:, None]
    p = torch.exp(logq)
    dz = torch.zeros_like(p)
    if g_logp is not None:
        cols = torch.arange(logits.shape[-1], device=logits.device)
        hit = (cols[None, :] == targets[:, None]) & in_range[:, None]
        dz = torch.where(hit, g_logp[:, None], dz) - p * g_logp[:, None]
    if g_ent is not None:
        dz = dz - g_ent[:, None] * p * (logq + ent[:, None])
    return (dz * inv_temp).to(dtype)


def chunk_slices(rows: int, chunk: int, fuse: bool) -> List[slice]:
    """``rows`` in slices of ``chunk``; with ``fuse`` a last 1-row slice joins the previous (size 1 recompiles)."""
    starts = list(range(0, rows, chunk))
    if fuse and len(starts) > 1 and rows - starts[-1] == 1:
        starts.pop()
    return [slice(s, starts[i + 1] if i + 1 < len(starts) else rows) for i, s in enumerate(starts)]


@functools.cache
def compiled(fn: Callable) -> Callable:
    """``fn`` under torch.compile with dynamic shapes (one graph for every chunk's row count), made once."""
    return torch.compile(fn, dynamic=True)


class _HeadLogProbs(torch.autograd.Function):
    """(hidden rows [R, H], head weight [V, H], targets [R]) -> (log-prob [R], entropy [R]), float32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, with_entropy, dtype, fuse):
        ctx.set_materialize_grads(False)
        h, w = hidden.to(dtype), weight.to(dtype)
        rows = h.shape[0]
        logp = torch.empty(rows, dtype=torch.float32, device=h.device)
        ent = torch.zeros(rows, dtype=torch.float32, device=h.device)
        lse = torch.empty(rows, dtype=torch.float32, device=h.device) if fuse else ent
        with torch.autocast(h.device.type, enabled=False):
            for sl in chunk_slices(rows, chunk, fuse):
                if fuse:  # the compiled statistics (see the module's docstring)
                    z, t = h[sl] @ w.T, targets[sl]
                    m = compiled(row_max)(z, 1.0 / temperature)
                    se, chosen, sx = compiled(softmax_sums)(z, m, t, torch.ones_like(t, dtype=torch.bool),
                                                            1.0 / temperature, with_entropy)
                    lse[sl] = m + torch.log(se)
                    logp[sl] = chosen - lse[sl]
                    if with_entropy:
                        ent[sl] = lse[sl] - sx / se
                    continue
                lp = torch.log_softmax((h[sl] @ w.T).float() / temperature, dim=-1)
                logp[sl] = lp.gather(-1, targets[sl, None])[:, 0]
                if with_entropy:
                    ent[sl] = -(lp.exp() * lp).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, ent, lse)
        ctx.args = (temperature, chunk, with_entropy, dtype, fuse)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, ent, lse = ctx.saved_tensors
        temperature, chunk, with_entropy, dtype, fuse = ctx.args
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_ent is not None and not with_entropy:
            g_ent = None
        if g_logp is None and g_ent is None:
            return (None,) * 8
        h, w = hidden.to(dtype), weight.to(dtype)
        rows = h.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        with torch.autocast(h.device.type, enabled=False):
            for sl in chunk_slices(rows, chunk, fuse):
                if fuse:
                    t = targets[sl]
                    g = compiled(softmax_grad)(h[sl] @ w.T, t, torch.ones_like(t, dtype=torch.bool), lse[sl],
                                               ent[sl], None if g_logp is None else g_logp[sl],
                                               None if g_ent is None else g_ent[sl], 1.0 / temperature, dtype)
                else:
                    lp = torch.log_softmax((h[sl] @ w.T).float() / temperature, dim=-1)
                    p = lp.exp()
                    dz = torch.zeros_like(lp)
                    if g_logp is not None:  # d log p_t / dz_k = [k = t] - p_k
                        dz.sub_(p * g_logp[sl, None])
                        dz.scatter_add_(-1, targets[sl, None], g_logp[sl, None])
                    if g_ent is not None:  # dH / dz_k = -p_k (log p_k + H)
                        dz.sub_(g_ent[sl, None] * p * (lp + ent[sl, None]))
                    g = (dz / temperature).to(dtype)
                if need_h:
                    grad_h[sl] = (g @ w).to(hidden.dtype)
                if need_w:
                    grad_w.add_(g.T @ h[sl])
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None


def head_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, chunk: int = HEAD_CHUNK_ROWS, fuse: bool = False
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``log_softmax(hidden @ weight.T / temperature)[target]`` and, if asked, its entropy, for each row of
    ``hidden`` ``[R, H]`` (``weight`` ``[V, H]``, a bias-free LM head): float32 ``[R]``, differentiable in
    ``hidden`` and ``weight``; the matmul in autocast's dtype where it is on. ``fuse``: compiled statistics."""
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype  # as F.linear's
    logp, ent = _HeadLogProbs.apply(hidden, weight, targets, float(temperature), int(chunk), bool(with_entropy),
                                    dtype, bool(fuse))
    return logp, (ent if with_entropy else None)


def response_rows(hidden: torch.Tensor, response_start: torch.Tensor, width: int) -> torch.Tensor:
    """Rows scoring the response tokens, ``[B, L, H]`` -> ``[B * width, H]`` (token ``t`` at ``start - 1 + t``)."""
    B, L, H = hidden.shape
    pos = (response_start[:, None] - 1 + torch.arange(width, device=hidden.device)[None, :]).clamp(0, L - 1)
    return hidden.gather(1, pos[..., None].expand(B, width, H)).reshape(B * width, H)


def fusable_head(model: torch.nn.Module) -> Optional[torch.nn.Linear]:
    """The model's LM head where :func:`fused_head` can stand in for it: a plain bias-free ``nn.Linear``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if type(head) is torch.nn.Linear and head.bias is None else None


@contextlib.contextmanager
def fused_head(head: torch.nn.Linear, response_start: torch.Tensor, response_ids: torch.Tensor,
               temperature: float, with_entropy: bool, entropy_grad: bool = True,
               chunk: int = HEAD_CHUNK_ROWS, fuse: bool = False) -> Iterator[None]:
    """Within it, ``head`` returns ``[B, T, 2]`` float32 (log-probs, entropies or zeros) instead of logits."""
    B, T = response_ids.shape

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        rows = response_rows(hidden, response_start, T)
        lp, ent = head_log_probs(rows, head.weight, response_ids.reshape(-1), temperature, with_entropy, chunk, fuse)
        if ent is None:
            ent = torch.zeros_like(lp)
        elif not entropy_grad:
            ent = ent.detach()
        return torch.stack([lp, ent], -1).view(B, T, 2)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward
