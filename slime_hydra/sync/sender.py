"""Trainer -> engines weight push over SGLang's weight-update endpoints (docs/architecture.md, "The three
weight-sync paths"). One ``WeightSender`` lives on the pushing trainer rank: a push pauses generation, flushes
the prefix caches, sends the HF-named tensors in buckets over ``sync.transport`` (distributed | tensor | disk),
checks every engine's weight version and continues. A push that does not arrive raises ``WeightSyncError``; each
blocking part of it ends at ``timeout_s`` (``sync.push_timeout_s``). With the tensor transport an engine on several
GPUs gets one handle per tensor-parallel rank, each to a copy on that rank's GPU (``take_part_in_tensor_push``).
A tied LM head travels once, as the embedding it shares (SGLang's loaders tie it)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, Iterable, List, Tuple

import torch

from slime_hydra.sync import WeightSyncError, transport
from slime_hydra.utils.http import EngineError, EngineUnreachable, control, weight_version
from slime_hydra.utils.testpoint import hold

log = logging.getLogger(__name__)
GROUP_NAME = "slime_hydra_weights"


@dataclass
class Endpoint:
    url: str
    gpus: int = 1
    first_gpu: int = 0  # the physical GPU of its tensor-parallel rank 0; rank j is on first_gpu + j


def needs_every_rank(kind: str, endpoints: List[Endpoint], device: torch.device) -> bool:
    """Whether a push needs a bucket copy from every trainer rank: CUDA IPC to engines on several GPUs."""
    return kind == "tensor" and device.type == "cuda" and any(e.gpus > 1 for e in endpoints)


def _all_handles(blob: str, device: torch.device) -> Dict[Tuple[str, int], str]:
    """(node, GPU) -> every trainer rank's handle to its copy of the current bucket."""
    import torch.distributed as dist

    from slime_hydra.utils.proc import node_ip

    out: List = [None] * dist.get_world_size()
    dist.all_gather_object(out, ((node_ip(), device.index), blob))
    return dict(out)


def take_part_in_tensor_push(named: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int,
                             device: torch.device) -> None:
    """A rank that does not push, when engines span several GPUs: each bucket copied to this rank's GPU, its
    handle to the pushing rank, the copy kept until the engines have read it."""
    import torch.distributed as dist

    for bucket in transport.buckets(named, bucket_bytes):
        payload = transport.flattened_bucket(bucket, device)
        torch.cuda.current_stream(device).synchronize()
        _all_handles(transport.serialize(payload), device)
        dist.barrier()  # the pushing rank's POST has returned: every engine rank copied its bucket
        del payload
    torch.cuda.ipc_collect()


class WeightSender:
    def __init__(self, kind: str, endpoints: List[Endpoint], device: torch.device, bucket_mb: int, disk_dir: str,
                 model_path: str, master_address: str = "127.0.0.1", trust_remote_code: bool = False,
                 timeout_s: float = 600.0):
        if kind not in ("distributed", "tensor", "disk"):
            raise ValueError(f"unknown weight transport {kind!r}")
        self.kind, self.endpoints, self.device = kind, endpoints, device
        self.every_rank = needs_every_rank(kind, endpoints, device)  # handles from every trainer rank's GPU
        self.bucket_bytes, self.disk_dir, self.timeout_s = bucket_mb << 20, disk_dir, timeout_s
        self.model_path, self.trust_remote_code = model_path, trust_remote_code  # config and tokenizer for disk pushes
        self.master_address = master_address
        self.group = None
        self.pool = ThreadPoolExecutor(max_workers=max(4, len(endpoints)))
        if kind == "tensor" and device.type == "cpu":
            # named shared-memory files any local process can open (file descriptors pass only to forked children)
            torch.multiprocessing.set_sharing_strategy("file_system")

    def _all(self, path: str, payload_for) -> list:
        """POST to every engine at once (a single one from this thread); ``payload_for(i)`` builds engine i's body."""
        if len(self.endpoints) == 1:
            return [control(self.endpoints[0].url, path, payload_for(0), timeout=self.timeout_s)]
        futs = [self.pool.submit(control, e.url, path, payload_for(i), timeout=self.timeout_s)
                for i, e in enumerate(self.endpoints)]
        return [f.result() for f in futs]

    def connect(self) -> None:
        if self.kind == "disk":
            write_model_files(self.model_path, os.path.join(self.disk_dir, "config"), self.trust_remote_code)
        if self.kind != "distributed" or self.group is not None or not self.endpoints:  # none: all restarting
            return
        from slime_hydra.utils.proc import free_port

        self._destroy_engine_groups()  # an engine may still be in the group of a trainer that died
        port = free_port(self.master_address)
        world = 1 + sum(e.gpus for e in self.endpoints)
        offsets = [1 + sum(e.gpus for e in self.endpoints[:i]) for i in range(len(self.endpoints))]
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        futs = [self.pool.submit(control, e.url, "/init_weights_update_group", {
            "master_address": self.master_address, "master_port": port, "rank_offset": offsets[i],
            "world_size": world, "group_name": GROUP_NAME, "backend": backend}, timeout=self.timeout_s)
            for i, e in enumerate(self.endpoints)]
        # the trainer's side of the rendezvous beside the engines' calls: an engine that cannot join fails at once
        own = self.pool.submit(transport.init_group, self.master_address, port, 0, world, GROUP_NAME, backend,
                               timeout=timedelta(seconds=self.timeout_s))
        done, _ = wait([own, *futs], timeout=self.timeout_s + 5, return_when=FIRST_EXCEPTION)
        errors = [f.exception() for f in done if f.exception() is not None]
        if errors or own not in done:
            raise WeightSyncError(f"engines could not join the weight-update group: "
                                  f"{[str(e) for e in errors] or 'no answer within sync.push_timeout_s'}")
        self.group = own.result()
        log.info("weight-update group %s: trainer + %d engine ranks over %s", GROUP_NAME, world - 1, backend)

    def _destroy_engine_groups(self) -> None:
        for e in self.endpoints:  # an error: none to leave (the usual case), or a dead engine (the rendezvous says so)
            with contextlib.suppress(EngineError):
                control(e.url, "/destroy_weights_update_group", {"group_name": GROUP_NAME}, timeout=30)

    def close(self) -> None:
        if self.group is not None:
            # the trainer's side first: an engine still in a failed push's broadcast then fails at once
            transport.destroy_group(self.group)
            self.group = None
            self._destroy_engine_groups()
        self.pool.shutdown(wait=False)

    def push(self, named: Iterable[Tuple[str, torch.Tensor]], version: int) -> Dict[str, float]:
        """Send all weights; returns {"bytes", "seconds", "transfer_seconds"} (the weights' own transfer). Raises
        WeightSyncError if it fails. Generation continues while the engines' weight versions are read."""
        t0, nbytes, v = time.perf_counter(), 0, str(version)
        if not self.endpoints:  # every engine is restarting (fault tolerance): nothing to push to now
            return {"bytes": 0.0, "seconds": 0.0, "transfer_seconds": 0.0}
        resumed = []
        try:
            try:
                self._all("/pause_generation", lambda i: {"mode": "in_place"})
                hold("push", version)  # a test hook (utils/testpoint.py)
                self._flush_caches()
                t_transfer = time.perf_counter()
                if self.kind == "disk":
                    nbytes = self._push_disk(named, v)
                else:
                    for bucket in transport.buckets(named, self.bucket_bytes):
                        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                        (self._push_distributed if self.kind == "distributed" else self._push_tensor)(bucket, v)
                t_transfer = time.perf_counter() - t_transfer
            except (EngineError, RuntimeError) as e:
                raise WeightSyncError(f"weight push v{v} over {self.kind} failed: {e}") from e
            finally:
                resumed = [self.pool.submit(_continue_generation, e.url) for e in self.endpoints]
            try:
                got = [weight_version(e.url, timeout=self.timeout_s) for e in self.endpoints]
            except EngineError as e:
                raise WeightSyncError(f"weight push v{v} over {self.kind}: the engines' versions could not be "
                                      f"read: {e}") from e
        finally:
            for f in resumed:
                f.result()
        stale = [(ep.url, g) for ep, g in zip(self.endpoints, got) if g != v]
        if stale:
            raise WeightSyncError(f"weights did not arrive: engines report versions {stale}, expected {v}")
        return {"bytes": float(nbytes), "seconds": time.perf_counter() - t0, "transfer_seconds": t_transfer}

    def _flush_caches(self, timeout_s: float = 60.0) -> None:
        """Empty every engine's prefix cache (KV of the old weights), asking again while a request still runs on it;
        an engine that does not answer at all fails the push at once."""
        deadline = time.monotonic() + timeout_s
        for e in self.endpoints:
            while True:
                try:
                    control(e.url, "/flush_cache", timeout=min(30.0, self.timeout_s))
                    break
                except EngineUnreachable:
                    raise
                except EngineError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)

    def _push_distributed(self, bucket: List[Tuple[str, torch.Tensor]], v: str) -> None:
        body = {"names": [n for n, _ in bucket], "dtypes": [transport.dtype_to_str(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": GROUP_NAME, "flush_cache": False,
                "weight_version": v, "load_format": "flattened_bucket"}
        futs = [self.pool.submit(control, e.url, "/update_weights_from_distributed", body, timeout=self.timeout_s)
                for e in self.endpoints]
        transport.broadcast_send(self.group, [t for _, t in bucket], flattened=True, device=self.device)
        for f in futs:
            f.result()

    def _push_tensor(self, bucket: List[Tuple[str, torch.Tensor]], v: str) -> None:
        # a fresh buffer on the device, never reused (the engine may still read it after answering); an offloaded
        # trainer's weights travel to the GPU one bucket at a time
        payload = transport.flattened_bucket(bucket, self.device)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the copies land before the engine reads
        blob = transport.serialize(payload)
        try:
            if self.every_rank:
                by_gpu = _all_handles(blob, self.device)
                handles = [self._engine_handles(e, by_gpu) for e in self.endpoints]
            else:
                handles = [[blob] * e.gpus for e in self.endpoints]
            self._all("/update_weights_from_tensor",
                      lambda i: {"serialized_named_tensors": handles[i], "flush_cache": False,
                                 "weight_version": v, "load_format": "flattened_bucket"})
        finally:
            if self.every_rank:
                import torch.distributed as dist

                dist.barrier()  # the other ranks may free their copies
        del payload
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()

    @staticmethod
    def _engine_handles(e: Endpoint, by_gpu: Dict[Tuple[str, int], str]) -> List[str]:
        """The handles for engine ``e``'s tensor-parallel ranks, in rank order: each to the copy on its GPU."""
        from urllib.parse import urlparse

        host = urlparse(e.url).hostname
        gpus = [(host, e.first_gpu + j) for j in range(e.gpus)]
        missing = [g for g in gpus if g not in by_gpu]
        if missing:
            raise WeightSyncError(f"engine {e.url} runs on GPUs {[g for _, g in gpus]} of {host}, but no trainer "
                                  f"rank sits on GPU(s) {[g for _, g in missing]} (trainer ranks are on "
                                  f"{sorted(by_gpu)}): the tensor transport needs a trainer rank on every GPU of "
                                  "a colocated engine")
        return [by_gpu[g] for g in gpus]

    def _push_disk(self, named: Iterable[Tuple[str, torch.Tensor]], v: str) -> int:
        from safetensors.torch import save_file

        out = os.path.join(self.disk_dir, f"weights_v{int(v):06d}")
        tmp = out + ".tmp"
        os.makedirs(tmp, exist_ok=True)
        seen, held, tensors = set(), [], {}
        for name, t in named:
            # host tensors sharing storage (tied weights) go once, as safetensors wants; held, so that an address
            # cannot come back for another tensor (device tensors' copies may reuse theirs at once)
            if t.device.type == "cpu":
                key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
                if key in seen:
                    continue
                seen.add(key)
                held.append(t)
            tensors[name] = t.detach().cpu().contiguous()
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        for f in os.listdir(os.path.join(self.disk_dir, "config")):  # config and tokenizer, copied in connect()
            shutil.copy(os.path.join(self.disk_dir, "config", f), tmp)
        shutil.rmtree(out, ignore_errors=True)  # this version pushed before (a resumed run pushes its step again)
        os.replace(tmp, out)
        self._all("/update_weights_from_disk", lambda i: {"model_path": out, "weight_version": v, "flush_cache": False})
        for old in os.listdir(self.disk_dir):
            if old.startswith("weights_v") and old != os.path.basename(out):
                shutil.rmtree(os.path.join(self.disk_dir, old), ignore_errors=True)
        return sum(t.numel() * t.element_size() for t in tensors.values())


def _continue_generation(url: str) -> None:
    """Let a paused engine generate again; a failure is logged (the push's own outcome is what raises)."""
    try:
        control(url, "/continue_generation", {})
    except EngineError as e:
        log.error("continue_generation failed: %s", e)


def write_model_files(model_path: str, out: str, trust_remote_code: bool = False) -> None:
    """Everything but the weights of ``model_path`` (a local checkpoint, or a hub id's config and tokenizer)
    into ``out``, so that ``out`` plus a weights file loads as a checkpoint."""
    os.makedirs(out, exist_ok=True)
    if not os.path.isdir(model_path):
        save_config_and_tokenizer(model_path, out, trust_remote_code)
        return
    for f in os.listdir(model_path):
        if not f.endswith((".safetensors", ".bin", ".pt")) and os.path.isfile(os.path.join(model_path, f)):
            shutil.copy(os.path.join(model_path, f), out)


def save_config_and_tokenizer(name_or_path: str, out: str, trust_remote_code: bool = False) -> None:
    from transformers import AutoConfig, AutoTokenizer

    AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code).save_pretrained(out)
    AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code).save_pretrained(out)
