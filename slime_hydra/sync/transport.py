"""The wire formats of weight sync, shared by the trainer (sender) and the embedded engine (receiver), as
SGLang 0.5.17 reads them:
- process groups for ``update_weights_from_distributed``: a separate group of the trainer's pushing rank (rank 0)
  and every engine GPU (1..N), made as SGLang makes it (rendezvous, a ``PrefixStore`` keyed by the group name);
- flattened buckets (``load_format="flattened_bucket"``): a bucket's tensors (one dtype) end to end as bytes;
- tensor handles for ``update_weights_from_tensor``: SGLang's ``MultiprocessingSerializer`` format (base64 of a
  ``ForkingPickler`` dump: CUDA IPC naming the GPU by UUID, shared-memory files on CPU), read under the rules of
  SGLang's ``SafeUnpickler``; bucket metadata are ``SimpleNamespace``s of ``FlattenedTensorMetadata``'s fields."""

from __future__ import annotations

import base64
import inspect
import io
import math
import pickle
import types
from datetime import timedelta
from typing import Any, Dict, Iterable, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

TIMEOUT = timedelta(minutes=10)


def dtype_from_str(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def init_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout: timedelta = TIMEOUT):
    """A stand-alone process group (not the default one) over tcp://master_address:master_port."""
    init_method = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store, group_name=group_name,
                                           timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(group) -> None:
    dist.destroy_process_group(group)


def broadcast_send(group, tensors: Sequence[torch.Tensor], flattened: bool = False,
                   device: torch.device | None = None) -> None:
    """Trainer side: broadcast ``tensors`` from rank 0 of ``group``, each in order, or ``flattened`` in one buffer
    on ``device`` (default: the first tensor's)."""
    if flattened:
        dist.broadcast(flatten(tensors, device or tensors[0].device), src=0, group=group)
        return
    works = [dist.broadcast(t.contiguous(), src=0, group=group, async_op=True) for t in tensors]
    for w in works:
        w.wait()


def receive_broadcast(group, dtypes: Sequence[str], shapes: Sequence[Sequence[int]], device: torch.device,
                      flattened: bool = False) -> List[torch.Tensor]:
    """Engine side: receive what :func:`broadcast_send` sends, as tensors of ``dtypes``/``shapes``."""
    if not flattened:
        bufs = [torch.empty(list(s), dtype=dtype_from_str(d), device=device) for d, s in zip(dtypes, shapes)]
        works = [dist.broadcast(b, src=0, group=group, async_op=True) for b in bufs]
        for w in works:
            w.wait()
        return bufs
    metadata = bucket_metadata([(str(i), dtype_from_str(d), s) for i, (d, s) in enumerate(zip(dtypes, shapes))])
    flat = torch.empty(metadata[-1].end_idx if metadata else 0, dtype=torch.uint8, device=device)
    dist.broadcast(flat, src=0, group=group)
    return [t for _, t in unflatten(flat, metadata)]


def bucket_metadata(entries: Sequence[Tuple[str, torch.dtype, Sequence[int]]]) -> List[types.SimpleNamespace]:
    """(name, dtype, shape) -> SGLang's FlattenedTensorMetadata fields, byte offsets end to end."""
    out, offset = [], 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(types.SimpleNamespace(name=name, shape=torch.Size(shape), dtype=dtype, start_idx=offset,
                                         end_idx=offset + nbytes, numel=nbytes))
        offset += nbytes
    return out


def flatten(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' bytes end to end in one fresh uint8 buffer on ``device``."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    offset = 0
    for t, n in zip(tensors, sizes):
        flat[offset:offset + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8), non_blocking=True)
        offset += n
    return flat


def unflatten(flat: torch.Tensor, metadata: Sequence[Any]) -> List[Tuple[str, torch.Tensor]]:
    """SGLang's FlattenedTensorBucket.reconstruct_tensors: views into ``flat``."""
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]


def flattened_bucket(named: Sequence[Tuple[str, torch.Tensor]], device: torch.device) -> Dict[str, Any]:
    """The payload SGLang's ``update_weights_from_tensor(load_format="flattened_bucket")`` reads."""
    metadata = bucket_metadata([(n, t.dtype, t.shape) for n, t in named])
    return {"flattened_tensor": flatten([t for _, t in named], device), "metadata": metadata}


def serialize(obj) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True), CUDA handles naming their GPU by UUID."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor
    pickler.dispatch_table[torch.nn.Parameter] = _reduce_tensor
    pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def deserialize(data: str | bytes):
    """SGLang's MultiprocessingSerializer.deserialize: its SafeUnpickler's rules, GPUs named by UUID."""
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    return _SafeUnpickler(io.BytesIO(data)).load()


def _device_index(name: str) -> int:
    return list(inspect.signature(_reductions().rebuild_cuda_tensor).parameters).index(name)


def _reductions():
    from torch.multiprocessing import reductions

    return reductions


def _reduce_tensor(t: torch.Tensor):
    fn, args = _reductions().reduce_tensor(t)
    if fn is _reductions().rebuild_cuda_tensor:
        i = _device_index("storage_device")
        args = (*args[:i], str(torch.cuda.get_device_properties(args[i]).uuid), *args[i + 1:])
    return fn, args


def _rebuild_cuda_tensor(*args):
    i = _device_index("storage_device")
    device = args[i]
    if isinstance(device, str):
        by_uuid = {str(torch.cuda.get_device_properties(d).uuid): d for d in range(torch.cuda.device_count())}
        if device not in by_uuid:
            raise RuntimeError(f"a CUDA handle names GPU {device}, which this process does not see")
        args = (*args[:i], by_uuid[device], *args[i + 1:])
    return _reductions().rebuild_cuda_tensor(*args)


class _SafeUnpickler(pickle.Unpickler):
    """SGLang 0.5.17's SafeUnpickler (sglang/srt/utils/common.py), for what a weight payload holds."""

    ALLOWED = ("builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.",
               "weakref.", "torch.", "multiprocessing.resource_sharer.", "multiprocessing.reduction.")
    DENIED = {("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile"), ("types", "CodeType"),
              ("types", "FunctionType")}

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor
        if (module, name) in self.DENIED or not any((module + ".").startswith(p) for p in self.ALLOWED):
            raise pickle.UnpicklingError(f"weight payloads may not load {module}.{name} (SGLang's SafeUnpickler "
                                         "refuses it too)")
        return super().find_class(module, name)


def buckets(named: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """(name, tensor) pairs in lists of one dtype and at most ``bucket_bytes`` (a larger tensor goes alone)."""
    cur: List[Tuple[str, torch.Tensor]] = []
    size, dtype = 0, None
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if cur and (size + nbytes > bucket_bytes or t.dtype != dtype):
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += nbytes
        dtype = t.dtype
    if cur:
        yield cur
