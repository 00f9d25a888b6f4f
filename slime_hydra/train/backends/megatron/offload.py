"""Host offload of the megatron backend while colocated engines generate. DDP's parameter buffer goes to a
pinned host copy the parameters point at meanwhile (without the distributed optimizer: each parameter), the
gradient buffers are freed, and the optimizer's main weights and Adam moments move to pinned buffers allocated
once. Adam's step counts stay on the GPU (the fused kernel rejects host counts), hence no
``MegatronOptimizer.offload_to_cpu``. Small buffers (rotary tables) stay.
"""

from __future__ import annotations

from typing import Dict, Iterator, List

import torch

from slime_hydra.train.backends.megatron.model import inner_optimizers, parameters
from slime_hydra.train.backends.torch.offload import pinned_buffer


class Offload:
    """Moves one rank's model chunks (megatron DDP modules) and optimizer between GPU and host."""

    def __init__(self, chunks: List[torch.nn.Module], opt, device: torch.device, distributed_optimizer: bool):
        self.chunks, self.opt, self.device, self.distributed_optimizer = chunks, opt, device, distributed_optimizer
        self.weights = False  # the weights are on the host
        self.state = False  # gradients freed, optimizer state on the host
        self._host: Dict[int, torch.Tensor] = {}  # id(buffer or parameter) -> its pinned host copy
        self._views: Dict[int, torch.Tensor] = {}  # id(parameter) -> its view of the GPU buffer, while offloaded
        self._param_bytes: Dict[int, int] = {}

    def _buffers(self):
        for c in self.chunks:
            yield from c.buffers + c.expert_parallel_buffers

    def offload(self, keep_weights: bool = False) -> None:
        """Gradients and optimizer state to the host, then (unless ``keep_weights``) the weights."""
        if self.weights:
            return
        torch.cuda.synchronize()
        if not self.state:
            for b in self._buffers():
                b.offload_to_cpu(move_params=False, move_grads=True)
            for t in self._optimizer_tensors():  # into pinned buffers kept across steps, asynchronously
                host = pinned_buffer(self._host, id(t), t)
                host.copy_(t.data, non_blocking=True)
                t.data = host
            self.state = True
        if not keep_weights:
            self._offload_weights()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def _offload_weights(self) -> None:
        for b in self._buffers():
            if b.param_data is not None:  # the distributed optimizer's contiguous parameter buffer
                host = pinned_buffer(self._host, id(b), b.param_data)
                host.copy_(b.param_data)
                for p in b.params:
                    start, end, _ = b.param_index_map[p]
                    self._views[id(p)] = p.data
                    p.data = host[start:end].view(p.shape)
                self._param_bytes[id(b)] = b.param_data.untyped_storage().size()
                b.param_data.untyped_storage().resize_(0)
        if not self.distributed_optimizer:  # no parameter buffer: the parameters one by one
            for p in parameters(self.chunks):
                host = pinned_buffer(self._host, id(p), p)
                host.copy_(p.data)
                p.data = host
        self.weights = True

    def onload(self) -> None:
        if not (self.weights or self.state):
            return
        for b in self._buffers():
            if b.param_data is not None and self.weights:
                b.param_data.untyped_storage().resize_(self._param_bytes[id(b)])
                b.param_data.copy_(self._host[id(b)], non_blocking=True)
                for p in b.params:
                    p.data = self._views.pop(id(p))
            if self.state:
                b.reload_from_cpu(move_params=False, move_grads=True)
        if not self.distributed_optimizer and self.weights:
            for p in parameters(self.chunks):
                p.data = p.data.to(self.device, non_blocking=True)
        if self.state:
            for t in self._optimizer_tensors():
                t.data = t.data.to(self.device, non_blocking=True)
        self._rehook_grads()
        torch.cuda.synchronize()
        self.weights = self.state = False

    def _rehook_grads(self) -> None:
        """Hook megatron's DDP into the parameters' new gradient accumulators (moving ``.data`` across devices
        drops the old ones, and with them DDP's hooks: ``main_grad`` would stay zero), as its ``__init__`` does."""
        for chunk in self.chunks:
            chunk.grad_accs = []
            for param in chunk.module.parameters():
                if param.requires_grad:
                    acc = param.expand_as(param).grad_fn.next_functions[0][0]
                    acc.register_hook(chunk._make_backward_post_hook(param))
                    chunk.grad_accs.append(acc)

    def _optimizer_tensors(self) -> Iterator[torch.Tensor]:
        """The optimizer's float32 main weights and Adam moments (each once), not its step counts."""
        seen = set()
        for o in inner_optimizers(self.opt):
            opt = o.optimizer
            tensors = [p for g in opt.param_groups for p in g["params"]]
            tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
            for t in tensors:
                if id(t) not in seen:
                    seen.add(id(t))
                    yield t
