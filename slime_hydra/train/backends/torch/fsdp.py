"""FSDP2 for the torch backend (``trainer.strategy=fsdp``): ``fully_shard`` per decoder layer and on the root.
Only what touches whole parameters differs from DDP: gradient clipping, the weights gathered one tensor at a
time for the engines, offload, and checkpoints through torch.distributed.checkpoint (docs/backends.md).
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, Iterable, Iterator, List, Tuple

import torch
import torch.distributed as dist

DCP_DIR = "dcp"  # in a run checkpoint: torch.distributed.checkpoint's files, one per rank


def ensure_process_group(device: torch.device) -> None:
    """``fully_shard`` needs a process group, also for one rank (which the actor does not create)."""
    if dist.is_initialized():
        return
    from slime_hydra.utils.proc import free_port

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}", rank=0, world_size=1)


def decoder_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules Hugging Face says not to split (its ``_no_split_modules``: the decoder layers)."""
    names = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules) to shard by")
    return layers


def shard(model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype, cpu_offload: bool,
          trainable: bool = True) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root, over every rank; layers move to ``device`` as sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    ensure_process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mixed = device.type == "cuda" and compute_dtype != torch.float32
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype if mixed else None,
                              reduce_dtype=torch.float32 if mixed else None)
    kw = {"mesh": mesh, "mp_policy": mp, "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy()}
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    if not trainable:
        model.requires_grad_(False)
    return model


def full(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole tensor of a DTensor (an all-gather: every rank calls it, in order) or a plain one, on ``device``."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    if isinstance(t, DTensor):
        if t.device != device:  # CPU offload / offloaded for the engines: NCCL gathers on the GPU
            t = t.to(device)
        return t.full_tensor()
    return t.to(device)


def unique_state(model: torch.nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """The state dict's tensors with each parameter once (a tied LM head is the embedding), in order."""
    params = dict(model.named_parameters())  # the first name of a shared parameter only
    shared = {id(p) for p in params.values()}
    for name, t in model.state_dict(keep_vars=True).items():
        if name in params or id(t) not in shared:
            yield name, t


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, device: torch.device) -> float:
    """``torch.nn.utils.clip_grad_norm_`` over sharded gradients: the squares of the local shards summed
    over the ranks on ``device`` (CPU-offloaded gradients live on the host, which NCCL cannot reduce)."""
    local = [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in params) if g is not None]
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in local:
        sq += g.detach().float().pow(2).sum().to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    norm = math.sqrt(float(sq))
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for g in local:
            g.mul_(coef)
    return norm


@torch.no_grad()
def offload(models: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Shards and AdamW state to the host (FSDP2 re-registers its shards after ``Module.to``, as in verl)."""
    for m in models:
        m.to("cpu")
    for opt in optimizers:
        _move_optimizer(opt, torch.device("cpu"))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@torch.no_grad()
def onload(models: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer],
           device: torch.device) -> None:
    for m in models:
        m.to(device)
    for opt in optimizers:
        _move_optimizer(opt, device)
    torch.cuda.synchronize()


def _move_optimizer(opt: torch.optim.Optimizer, device: torch.device) -> None:
    for state in opt.state.values():
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() > 0:
                state[k] = v.to(device, non_blocking=True)


def _options(trainable_only: bool):
    """LoRA: the adapters only (the frozen base is ``model.path``), so loading them is not strict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, ref: torch.nn.Module | None,
           trainable_only: bool) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt, options=_options(trainable_only))
    return {"model": msd, "optim": osd, **({} if ref is None else {"ref": ref.state_dict()})}


def save(out_dir: str, model: torch.nn.Module, opt: torch.optim.Optimizer, ref: torch.nn.Module | None,
         trainable_only: bool) -> None:
    """``out_dir/dcp``: every rank's shards of the policy (LoRA: its trainable part), AdamW state and reference."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, opt, ref, trainable_only), checkpoint_id=os.path.join(out_dir, DCP_DIR))


def load(ckpt_dir: str, model: torch.nn.Module, opt: torch.optim.Optimizer, ref: torch.nn.Module | None,
         trainable_only: bool) -> None:
    """Restore :func:`save`'s shards into this run's layout (any number of ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = os.path.join(ckpt_dir, DCP_DIR)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{ckpt_dir} has no {DCP_DIR}/: it was not saved with trainer.strategy=fsdp (resume "
                                "it with the strategy it was saved with, or start a new run from its hf/ with "
                                "model.path)")
    state = _state(model, opt, ref, trainable_only)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options(trainable_only))
    if ref is not None:
        ref.load_state_dict(state["ref"])
