"""Log-probs and entropy of chosen tokens from vocab-parallel logits, chunked. As megatron's
``vocab_parallel_cross_entropy``: softmax statistics all-reduced over the TP group, float32 ``chunk`` rows at a
time, padding columns excluded. Only the response rows (``index``) are gathered; their gradient is scattered
back. ``fuse`` (``trainer.compile``): the compiled statistics of ``slime_hydra/train/logprobs.py``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from slime_hydra.train.logprobs import chunk_slices, compiled, row_max, softmax_grad, softmax_sums

DEFAULT_CHUNK_BYTES = 256 * 2**20


def _chunk_rows(vocab_local: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // max(1, 4 * 3 * vocab_local))  # about three float32 temporaries per row


def _allreduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, index, targets, inv_temp, vocab_start, n_valid, group, chunk, with_entropy, fuse):
        ctx.set_materialize_grads(False)  # an entropy that is only a metric: no gradient pass over it
        x = logits if index is None else logits.index_select(0, index)  # the rows scored, [R, V_local]
        rows = x.shape[0]
        dev = logits.device
        in_range = (targets >= vocab_start) & (targets < vocab_start + n_valid)
        local_t = torch.where(in_range, targets - vocab_start, 0)
        # the chunks' statistics: eager, or compiled with fuse (slime_hydra/train/logprobs.py says why)
        run = compiled if fuse else (lambda fn: fn)
        slices = chunk_slices(rows, chunk, fuse) if n_valid else []
        m = torch.full((rows,), float("-inf"), device=dev)  # pass 1: row maxima
        for sl in slices:
            m[sl] = run(row_max)(x[sl, :n_valid], inv_temp)
        _allreduce(m, dist.ReduceOp.MAX, group)
        stats = torch.zeros(3, rows, device=dev)  # pass 2: sum exp, the chosen logit, sum exp * logit
        for sl in slices:
            stats[:, sl] = run(softmax_sums)(x[sl, :n_valid], m[sl], local_t[sl], in_range[sl], inv_temp, with_entropy)
        _allreduce(stats, dist.ReduceOp.SUM, group)
        lse = m + torch.log(stats[0])
        logp = stats[1] - lse
        entropy = lse - stats[2] / stats[0] if with_entropy else None
        ctx.save_for_backward(x, index, local_t, in_range, lse, entropy if with_entropy else lse)
        ctx.args = (logits.shape[0], inv_temp, n_valid, chunk, with_entropy, fuse)
        return (logp, entropy) if with_entropy else (logp, torch.zeros_like(logp))

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        x, index, local_t, in_range, lse, entropy = ctx.saved_tensors
        n, inv_temp, n_valid, chunk, with_entropy, fuse = ctx.args
        grad = x.new_zeros(n, x.shape[1])  # rows that are not scored (prompts) and padding columns get none
        if not n_valid:
            return grad, *(None,) * 9
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        g_ent = g_ent if with_entropy else None
        for sl in chunk_slices(x.shape[0], chunk, fuse):
            if fuse:
                dx = compiled(softmax_grad)(x[sl, :n_valid], local_t[sl], in_range[sl], lse[sl], entropy[sl],
                                            g_logp[sl], None if g_ent is None else g_ent[sl], inv_temp, grad.dtype)
            else:
                z = x[sl, :n_valid].float() * inv_temp
                p = torch.exp(z - lse[sl, None])
                dx = -p * g_logp[sl, None]
                dx.scatter_add_(-1, local_t[sl, None], (g_logp[sl] * in_range[sl])[:, None])
                if g_ent is not None:  # dH/dz_k = -p_k (log p_k + H)
                    dx -= g_ent[sl, None] * p * (z - lse[sl, None] + entropy[sl, None])
                dx = (dx * inv_temp).to(grad.dtype)
            grad[sl if index is None else index[sl], :n_valid] = dx  # distinct rows: a scatter, no accumulation
        return grad, *(None,) * 9


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, *, index: Optional[torch.Tensor] = None,
                             vocab_size: Optional[int] = None, temperature: float = 1.0, tp_group=None,
                             with_entropy: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES, fuse: bool = False
                             ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log softmax(logits / temperature)[target] and, if asked, the entropy of that distribution, per row.
    logits: [N, V_local], TP rank r's columns ``[r * V_local, (r + 1) * V_local)`` of the padded vocabulary;
    index: [R] distinct rows to score (None: all); targets: [R] global token ids; vocab_size: the true
    vocabulary (columns past it are padding). Float32 [R], differentiable in ``logits``."""
    v_local = logits.shape[-1]
    rank = dist.get_rank(group=tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
    start = rank * v_local
    if vocab_size is None:
        vocab_size = v_local * (dist.get_world_size(tp_group) if tp_group is not None else 1)
    n_valid = max(0, min(v_local, vocab_size - start))
    chunk = _chunk_rows(v_local, chunk_bytes)
    scored = logits.shape[0] if index is None else index.shape[0]
    if targets.shape[0] != scored:
        raise ValueError(f"{targets.shape[0]} targets for {scored} rows of logits"
                         + ("" if index is None else f" (the index's length; the logits have {logits.shape[0]} rows)"))
    logp, ent = _VocabParallelLogProbs.apply(logits, index, targets, 1.0 / temperature, start, n_valid, tp_group,
                                             chunk, with_entropy, fuse)
    return logp, (ent if with_entropy else None)


def packed_response_log_probs(output: torch.Tensor, batch, *, vocab_size: int, temperature: float = 1.0,
                              tp_group=None, with_entropy: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                              fuse: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropies) of a ``packing.PackedBatch``'s response tokens from the model's
    vocab-parallel output ``[T, 1, V_local]`` (or ``[1, T, V_local]``): flat ``[R]`` tensors in
    ``batch`` order; ``batch.per_sample`` lays them out ``[B, T]``."""
    flat = output.reshape(-1, output.shape[-1]) if output.shape[1] == 1 else output[0]
    return vocab_parallel_log_probs(flat, batch.targets, index=batch.logit_index, vocab_size=vocab_size,
                                    temperature=temperature, tp_group=tp_group, with_entropy=with_entropy,
                                    chunk_bytes=chunk_bytes, fuse=fuse)
