"""The torch backend's optimiser pieces, shared by the policy and the PPO critic: AdamW and its LR
schedule from ``AlgoConfig``, mixed precision, and one optimiser step accumulated over micro-batches
under DDP."""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch

from slime_hydra.train.backend import MicroBatch, StepResult


def adamw(params: Iterable[torch.nn.Parameter], algo, lr: float) -> torch.optim.AdamW:
    """AdamW: torch's fused kernel on GPUs, its default on CPUs."""
    params = list(params)
    return torch.optim.AdamW(params, lr=lr, betas=(algo.adam_beta1, algo.adam_beta2), eps=algo.adam_eps,
                             weight_decay=algo.weight_decay, fused=all(p.is_cuda for p in params) or None)


def lr_lambda(algo, total_steps: int) -> Callable[[int], float]:
    """``algo``'s warm-up then constant, linear or cosine decay to ``min_lr`` over ``total_steps``, as a
    factor of the optimiser's base rate (the critic's schedule has the same shape at ``critic_lr``)."""

    def f(step: int) -> float:
        if step < algo.lr_warmup_steps:
            return (step + 1) / algo.lr_warmup_steps
        if algo.lr_decay == "constant" or total_steps <= algo.lr_warmup_steps:
            return 1.0
        frac = min(1.0, (step - algo.lr_warmup_steps) / max(1, total_steps - algo.lr_warmup_steps))
        floor = algo.min_lr / algo.lr
        if algo.lr_decay == "linear":
            return floor + (1 - floor) * (1 - frac)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


def schedule(opt: torch.optim.Optimizer, algo, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(algo, total_steps))


def load_schedule(sched: torch.optim.lr_scheduler.LambdaLR, state: Dict[str, object]) -> None:
    """Restore a checkpoint's schedule position into ``sched``, keeping ``sched``'s own length (a resume may
    raise ``trainer.num_rollout``): each group's rate is set to this schedule's at the restored step."""
    # not the saved lambdas: a callable object's state would bring back the old length
    sched.load_state_dict({**state, "lr_lambdas": [None] * len(sched.lr_lambdas)})
    lrs = [base * f(sched.last_epoch) for base, f in zip(sched.base_lrs, sched.lr_lambdas)]
    for group, lr in zip(sched.optimizer.param_groups, lrs):
        group["lr"] = lr
    sched._last_lr = lrs


def autocast(device: torch.device, dtype: torch.dtype):
    """GPUs keep float32 master weights and run forward/backward in ``dtype``; CPU runs as is."""
    mixed = device.type == "cuda" and dtype != torch.float32
    return torch.autocast("cuda", dtype=dtype) if mixed else contextlib.nullcontext()


def accumulated_step(net: torch.nn.Module, model: torch.nn.Module, opt: torch.optim.Optimizer,
                     sched: torch.optim.lr_scheduler.LRScheduler, mbs: Sequence[MicroBatch],
                     loss_of: Callable[[MicroBatch], Tuple[torch.Tensor, Dict[str, torch.Tensor]]],
                     world_size: int, clip_grad: float,
                     clip: Optional[Callable[[Iterable[torch.nn.Parameter], float], float]] = None,
                     accumulate_unsynced: bool = True) -> StepResult:
    """Zero the gradients, backward ``loss_of(mb)`` for each micro-batch (DDP synchronises on the last one
    only), clip, step the optimiser and the schedule. ``net`` is ``model`` or its DDP wrapper. Each loss is
    multiplied by ``world_size`` (DDP averages over ranks; the gradient must be that of the sum). FSDP2
    passes its own ``clip`` and ``accumulate_unsynced=False`` (it reduce-scatters every micro-batch)."""
    model.train()
    opt.zero_grad(set_to_none=True)
    per_mb = []
    for k, mb in enumerate(mbs):
        sync = k == len(mbs) - 1 or world_size == 1 or not accumulate_unsynced
        with contextlib.nullcontext() if sync else net.no_sync():
            loss, metrics = loss_of(mb)
            (loss * world_size).backward()
        per_mb.append(metrics)
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    grad_norm = (clip or torch.nn.utils.clip_grad_norm_)(params, clip_grad)
    opt.step()
    sched.step()
    return StepResult(grad_norm=float(grad_norm), metrics=read_metrics(per_mb))


def read_metrics(per_mb: Iterable[Dict[str, torch.Tensor]]) -> Dict[str, float]:
    """Micro-batches' 0-dim metric tensors summed on the device, then read in one copy (one wait for the GPU)."""
    sums: Dict[str, torch.Tensor] = {}
    for metrics in per_mb:
        for k, v in metrics.items():
            v = v.detach().float().reshape(())
            sums[k] = sums[k] + v if k in sums else v
    if not sums:
        return {}
    keys = sorted(sums)
    return dict(zip(keys, torch.stack([sums[k].to(sums[keys[0]].device) for k in keys]).cpu().tolist()))
