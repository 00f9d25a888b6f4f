"""Sequence packing, and micro-batches by token budget (slime's ``--use-dynamic-batch-size``). A micro-batch
is one row of concatenated samples (THD): attention stays inside each sample through ``cu_seqlens``, positions
restart at 0, a short tail pads to a multiple of the TP size. Only the rows of ``PackedBatch.logit_index``
(those predicting a response token) reach the log-softmax.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch


def token_budget_micro_batches(lengths: Sequence[int], max_tokens: int, min_micro_batches: int = 1) -> List[List[int]]:
    """Split samples (their token counts ``lengths``) into the fewest micro-batches of at most
    ``max_tokens`` tokens each (at least ``min_micro_batches``, e.g. the most any data-parallel rank
    needs), balancing the token counts. Returns sample indices per micro-batch, ascending."""
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"sample {i} has {n} tokens, more than the micro-batch token budget {max_tokens}")
    if not lengths:
        return []
    if min_micro_batches > len(lengths):
        raise ValueError(f"{len(lengths)} samples cannot fill {min_micro_batches} micro-batches")
    k = max(min_micro_batches, _first_fit_bins(lengths, max_tokens))
    while True:
        parts = _balanced(lengths, k, max_tokens)
        if parts is not None:  # k <= len(lengths): every part got a sample
            return [sorted(p) for p in sorted(parts, key=min)]
        k += 1


def contiguous_budget_groups(lengths: Sequence[int], max_tokens: Optional[int], max_samples: int) -> List[List[int]]:
    """Positions ``0..n-1`` in order, cut at ``max_tokens`` tokens (None: no budget) or ``max_samples`` samples."""
    groups, cur, used = [], [], 0
    for i, n in enumerate(lengths):
        if max_tokens is not None and n > max_tokens:
            raise ValueError(f"trainer.max_tokens_per_micro_batch: a sample has {n} tokens, more than the budget "
                             f"{max_tokens}")
        if cur and ((max_tokens is not None and used + n > max_tokens) or len(cur) >= max_samples):
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


def _first_fit_bins(lengths: Sequence[int], cap: int) -> int:
    """How many bins first-fit decreasing needs (at most 11/9 of the optimum plus one)."""
    bins: List[int] = []
    for n in sorted(lengths, reverse=True):
        for j, used in enumerate(bins):
            if used + n <= cap:
                bins[j] += n
                break
        else:
            bins.append(n)
    return len(bins)


def _balanced(lengths: Sequence[int], k: int, cap: int) -> Optional[List[List[int]]]:
    """Longest first onto the least loaded of ``k`` parts; None if some part would exceed ``cap``."""
    heap = [(0, j) for j in range(k)]
    parts: List[List[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        load, j = heapq.heappop(heap)
        if load + lengths[i] > cap:
            return None
        parts[j].append(i)
        heapq.heappush(heap, (load + lengths[i], j))
    return parts


@dataclass
class PackedBatch:
    """Samples concatenated into one row, with what is needed to score their responses."""

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long, restarting at 0 for each sample
    cu_seqlens: torch.Tensor  # [n + 1] int32 segment bounds (the padding tail, if any, is one more segment)
    max_seqlen: int
    indices: List[int]  # the samples' rows in the caller's data, in packing order
    response_lengths: List[int]
    logit_index: torch.Tensor  # [R] packed positions whose logits predict a response token
    targets: torch.Tensor  # [R] those response tokens
    loss_mask: torch.Tensor  # [R] float, the samples' loss masks (0 for masked tool tokens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def packed_seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    def to(self, device) -> "PackedBatch":
        move = ("input_ids", "position_ids", "cu_seqlens", "logit_index", "targets", "loss_mask")
        kw = {k: getattr(self, k).to(device, non_blocking=True) if k in move else getattr(self, k)
              for k in self.__dataclass_fields__}
        return PackedBatch(**kw)

    def per_sample(self, values: torch.Tensor, width: Optional[int] = None) -> torch.Tensor:
        """[R] per-response-token values -> response-aligned [B, width] (rows in ``indices`` order, zero-padded)."""
        width = max(self.response_lengths, default=0) if width is None else width
        out = values.new_zeros(len(self.response_lengths), width)
        for b, piece in enumerate(values.split(self.response_lengths)):
            out[b, : piece.numel()] = piece
        return out


def pack(tokens: Sequence[Sequence[int]], response_lengths: Sequence[int], indices: Sequence[int],
         loss_masks: Optional[Sequence[Optional[Sequence[float]]]] = None, pad_to_multiple: int = 1,
         pad_id: int = 0) -> PackedBatch:
    """Pack samples ``indices`` into one row padded to a multiple of ``pad_to_multiple``; a None loss mask is ones."""
    ids, pos, logit_index, targets, mask, rlens = [], [], [], [], [], []
    bounds = [0]
    for i in indices:
        seq, r = list(tokens[i]), int(response_lengths[i])
        if r < 0 or (r > 0 and r >= len(seq)):
            raise ValueError(f"sample {i}: response length {r} for {len(seq)} tokens (the prompt must be non-empty)")
        start = len(ids)
        ids += seq
        pos += range(len(seq))
        bounds.append(len(ids))
        first = start + len(seq) - r  # packed position of the first response token
        logit_index += range(first - 1, first - 1 + r)
        targets += seq[len(seq) - r:]
        m = loss_masks[i] if loss_masks is not None else None
        if m is not None and len(m) != r:
            raise ValueError(f"sample {i}: loss mask of {len(m)} for a response of {r} tokens")
        mask += list(m) if m is not None else [1.0] * r
        rlens.append(r)
    tail = -len(ids) % pad_to_multiple
    if tail:
        ids += [pad_id] * tail
        pos += range(tail)
        bounds.append(len(ids))
    seqlens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long), position_ids=torch.tensor([pos], dtype=torch.long),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32), max_seqlen=max(seqlens, default=0),
        indices=list(indices), response_lengths=rlens, logit_index=torch.tensor(logit_index, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long), loss_mask=torch.tensor(mask, dtype=torch.float32))


def pack_micro_batches(data: dict, rows: Sequence[int], max_tokens: int, pad_to_multiple: int = 1,
                       min_micro_batches: int = 1, pad_id: int = 0) -> List[PackedBatch]:
    """``rows`` of the rollout manager's per-sample lists -> packed micro-batches of at most ``max_tokens``."""
    lengths = [len(data["tokens"][i]) for i in rows]
    groups = token_budget_micro_batches(lengths, max_tokens, min_micro_batches)
    masks = data.get("loss_masks")
    return [pack(data["tokens"], data["response_lengths"], [rows[j] for j in g], masks, pad_to_multiple, pad_id)
            for g in groups]


@dataclass
class PackedMicroBatch:
    """A packed micro-batch (on the device) and the width of the response-aligned tensors of its rows."""

    packed: PackedBatch
    width: int

    @property
    def indices(self) -> List[int]:
        return self.packed.indices
