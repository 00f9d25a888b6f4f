"""Moving a model and its optimiser state between GPU and host while colocated engines generate: each tensor
to a pinned host buffer allocated once. Moving ``.data`` gives a parameter a new gradient accumulator without
DDP's hooks, so DDP is built again after an onload that moved something (:func:`data_parallel`).
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator

import torch
from torch import nn


def _state(opt: torch.optim.Optimizer, extra: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """What the weight push does not read: AdamW's moments and ``extra`` (the reference's weights)."""
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:
                yield v
    yield from extra


def pinned_buffer(cache: Dict[int, torch.Tensor], key: int, like: torch.Tensor) -> torch.Tensor:
    """The pinned host buffer ``cache[key]`` shaped like ``like``, allocated once (again if shape or dtype change)."""
    buf = cache.get(key)
    if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
        buf = cache[key] = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
    return buf


def data_parallel(model: nn.Module, device: torch.device, init_sync: bool = True) -> nn.Module:
    """``model`` under DDP (hooks on the current gradient accumulators); ``init_sync=False`` after an onload."""
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                               init_sync=init_sync)


def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer, extra: Iterable[torch.Tensor]
             ) -> Iterator[torch.Tensor]:
    yield from model.parameters()  # each once: a tied weight is one parameter
    yield from model.buffers()
    yield from _state(opt, extra)


class Offloader:
    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device,
                 extra: Iterable[torch.Tensor] = ()):
        """``extra``: more tensors that move with the model (the reference model's weights)."""
        self.model, self.opt, self.device, self.extra = model, opt, device, list(extra)
        self.host: Dict[int, torch.Tensor] = {}  # id(tensor) -> its pinned host buffer
        self.moved = False  # offload moved tensors to the host that onload has not brought back

    def offload(self, keep_weights: bool = False) -> None:
        """``keep_weights``: the optimiser state and ``extra`` only, gradients freed (the push reads the weights)."""
        if self.device.type != "cuda":
            return
        for p in self.model.parameters():
            p.grad = None  # gradients are zeroed before every step anyway
        tensors = _state(self.opt, self.extra) if keep_weights else _tensors(self.model, self.opt, self.extra)
        for t in tensors:
            if t.device.type != "cuda":
                continue
            buf = pinned_buffer(self.host, id(t), t)
            buf.copy_(t.data, non_blocking=True)
            t.data = buf
            self.moved = True
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def onload(self) -> bool:
        """True when tensors came back: their gradient accumulators are new (see the module's doc)."""
        moved, self.moved = self.moved, False
        if self.device.type != "cuda":
            return moved
        for t in _tensors(self.model, self.opt, self.extra):
            if t.device.type == "cpu":
                t.data = t.data.to(self.device, non_blocking=True)
        torch.cuda.synchronize()
        return moved
