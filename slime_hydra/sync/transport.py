"""The wire formats of weight sync, shared by the trainer (sender) and the embedded engine (receiver).

- Process groups for ``update_weights_from_distributed``: a *separate* torch.distributed group that
  joins the trainer's rank 0 (rank 0) with every engine GPU (ranks 1..N), made the way SGLang makes
  it (``rendezvous`` on ``tcp://addr:port``, a ``PrefixStore`` keyed by the group name, then
  ``_new_process_group_helper``), so the trainer side interoperates with real SGLang servers. It
  does not touch the default process group. Backend: nccl on GPUs, gloo on CPU.
- Tensor handles for ``update_weights_from_tensor``: SGLang's ``MultiprocessingSerializer`` format,
  base64 of a ``ForkingPickler`` dump of a list of (name, tensor) pairs, so a colocated receiver maps
  the sender's memory instead of copying it through HTTP (CUDA IPC on GPUs; shared-memory files on
  CPU, with torch's ``file_system`` sharing strategy).
"""

from __future__ import annotations

import base64
import io
import math
from datetime import timedelta
from typing import Iterable, Iterator, List, Sequence, Tuple

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
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(group) -> None:
    dist.destroy_process_group(group)


def broadcast_send(group, tensors: Sequence[torch.Tensor], flattened: bool = False) -> None:
    """Trainer side: broadcast ``tensors`` from rank 0 of ``group``: each in order, or (SGLang's
    ``load_format="flattened_bucket"``, tensors of one dtype) concatenated into one buffer, one
    broadcast (gloo: 36 small tensors took 20 ms one by one, measured)."""
    if flattened:
        dist.broadcast(torch.cat([t.detach().reshape(-1) for t in tensors]), src=0, group=group)
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
    if len(set(map(dtype_from_str, dtypes))) > 1:
        raise ValueError(f"a flattened bucket holds one dtype, got {sorted(set(map(str, dtypes)))}")
    numels = [math.prod(s) for s in shapes]
    flat = torch.empty(sum(numels), dtype=dtype_from_str(dtypes[0]), device=device)
    dist.broadcast(flat, src=0, group=group)
    return [part.view(list(s)) for part, s in zip(flat.split(numels), shapes)]


# --------------------------------------------------------------------------- tensor handles
def serialize(obj) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True)."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def deserialize(data: str | bytes):
    from multiprocessing.reduction import ForkingPickler

    if isinstance(data, str):
        data = base64.b64decode(data)
    return ForkingPickler.loads(data)


def buckets(named: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of at most ``bucket_bytes`` (a larger tensor goes alone)
    and of one dtype each, so that each list flattens into one buffer."""
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
