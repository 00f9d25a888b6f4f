"""Hugging Face weights into megatron model chunks, and megatron weights back out as Hugging Face tensors
gathered over TP / PP / EP and streamed in buckets (weight sync, ``hf/`` checkpoints). As slime's
``update_weight``: the owning stage all-gathers each parameter over TP (experts: expert-TP, then EP) and
broadcasts it over the pipeline group; all ranks walk the same list in the same order.
"""

from __future__ import annotations

from typing import Iterator, List, Mapping, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from slime_hydra.train.backends.megatron.convert import (
    COL,
    GLU,
    REP,
    ROW,
    VOCAB,
    HFCheckpoint,
    Layout,
    Shard,
    buckets,
    gather_tp,
    iter_hf_to_megatron,
    local_names,
    megatron_to_hf,
    split_kind,
    to_global,
)

DEFAULT_BUCKET_BYTES = 512 * 2**20  # slime's --update-weight-buffer-size

Chunk = Tuple[Mapping[str, torch.Tensor], Shard]  # a model chunk's state_dict (local names) and its shard


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside megatron's DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def load_hf_weights(model_chunks: Sequence[torch.nn.Module], hf: Union[str, Mapping[str, torch.Tensor]],
                    layout: Layout, shards: Sequence[Shard]) -> None:
    """Copy a Hugging Face checkpoint (a directory or a name -> tensor mapping) into each model chunk.
    Each rank reads only its shard's tensors, one at a time. Call it before the optimizer copies the
    parameters (its float32 main weights start from them)."""
    source = HFCheckpoint(hf) if isinstance(hf, str) else hf
    for chunk, shard in zip(model_chunks, shards):
        own = unwrap(chunk).state_dict()
        want = set(local_names(layout, shard))
        have = {k for k in own if not k.endswith("_extra_state")}
        if have != want:
            raise ValueError(f"conversion and model disagree: model-only {sorted(have - want)[:5]}, "
                             f"conversion-only {sorted(want - have)[:5]}")
        with torch.no_grad():
            for k, t in iter_hf_to_megatron(source, layout, shard):
                if own[k].shape != t.shape:
                    raise ValueError(f"{k}: model shape {tuple(own[k].shape)}, converted {tuple(t.shape)}")
                own[k].copy_(t)


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_gather(t: torch.Tensor, group) -> List[torch.Tensor]:
    if _size(group) == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _full_shape(shape: Tuple[int, ...], split: str, size: int) -> Tuple[int, ...]:
    dim = {COL: 0, VOCAB: 0, GLU: 0, ROW: 1, REP: None}[split]
    return shape if dim is None else (*shape[:dim], shape[dim] * size, *shape[dim + 1:])


def _local_items(chunks: Sequence[Chunk], layout: Layout, tp: int, etp: int):
    """(global name, local tensor, split, is expert, full shape) of this rank's parameters, in order."""
    items = []
    for state, shard in chunks:
        for local, t in state.items():
            if local.endswith("_extra_state") or t is None:
                continue
            name = to_global(local, layout, shard)
            if name == "output_layer.weight" and layout.tied:
                continue  # the last stage's copy of a tied embedding
            split, expert = split_kind(layout, name)
            items.append((name, t, split, expert, _full_shape(tuple(t.shape), split, etp if expert else tp)))
    return items


def export_hf_weights(chunks: Sequence[Chunk], layout: Layout, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      tp_group=None, pp_group=None, ep_group=None, etp_group=None,
                      ) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Every rank gets the whole model as Hugging Face (name, tensor) buckets of at most
    ``bucket_bytes``. ``chunks``: this rank's model chunks as (``state_dict()``, ``Shard``); the groups
    are megatron's (None: that parallelism is off). Expert-TP defaults to the TP group."""
    etp_group = tp_group if etp_group is None else etp_group
    ep, pp = _size(ep_group), _size(pp_group)
    mine = _local_items(chunks, layout, _size(tp_group), _size(etp_group))
    # every stage learns every stage's list: (name, full shape, dtype, expert)
    meta = [(n, shape, str(t.dtype).removeprefix("torch."), expert) for n, t, _, expert, shape in mine]
    stages = [meta]
    if pp > 1:
        stages = [None] * pp
        dist.all_gather_object(stages, meta, group=pp_group)
    my_stage = dist.get_rank(pp_group) if pp > 1 else 0
    local = {n: (t, split) for n, t, split, _, _ in mine}
    device = mine[0][1].device if mine else torch.device("cpu")
    n_local_experts = layout.num_experts // ep if layout.num_experts else 0

    def full_tensors() -> Iterator[Tuple[str, torch.Tensor]]:
        for stage, entries in enumerate(stages):
            for name, shape, dtype, expert in entries:
                if stage == my_stage:
                    t, split = local[name]
                    full = gather_tp(_all_gather(t, etp_group if expert else tp_group), split)
                    pieces = _all_gather(full, ep_group) if expert else [full]
                else:
                    pieces = [torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                              for _ in range(ep if expert else 1)]
                if pp > 1:
                    src = dist.get_global_rank(pp_group, stage)
                    for p in pieces:
                        dist.broadcast(p, src=src, group=pp_group)
                if not expert:
                    yield name, pieces[0]
                    continue
                for ep_rank, p in enumerate(pieces):  # rename the sender's expert id to each EP rank's
                    yield _expert_renamed(name, ep_rank, n_local_experts), p

    yield from buckets((pair for name, t in full_tensors() for pair in megatron_to_hf(name, t, layout)), bucket_bytes)


def _expert_renamed(name: str, ep_rank: int, n_local: int) -> str:
    """``...local_experts.<e>...`` (e: the global id on the sending EP rank) -> the id on ``ep_rank``."""
    head, rest = name.split(".mlp.experts.local_experts.")
    e, tail = rest.split(".", 1)
    return f"{head}.mlp.experts.local_experts.{int(e) % n_local + ep_rank * n_local}.{tail}"


def model_chunks_state(model_chunks: Sequence[torch.nn.Module], shards: Sequence[Shard]) -> List[Chunk]:
    """``export_hf_weights``' input from live model chunks."""
    return [(unwrap(m).state_dict(), s) for m, s in zip(model_chunks, shards)]
