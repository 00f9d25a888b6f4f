"""A trainer rank as a Ray actor: process-group set-up, the backend, the weight push (rank 0), and
checkpoints. ``TrainerGroup`` (driver side) fans calls out to every rank."""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional

import torch

from slime_hydra.config.schema import RunConfig

log = logging.getLogger(__name__)


class TrainerActor:
    def __init__(self, cfg: RunConfig, rank: int, world_size: int, model_path: str):
        self.cfg, self.rank, self.world_size, self.model_path = cfg, rank, world_size, model_path
        self.backend = None
        self.sender = None

    def master_address(self) -> str:
        from slime_hydra.utils.proc import free_port, node_ip

        ip = node_ip()
        return f"{ip}:{free_port(ip)}"

    def init(self, master: str) -> None:
        import torch.distributed as dist

        from slime_hydra.train.torch_backend import TorchTrainer

        torch.manual_seed(self.cfg.seed + self.rank)
        cuda = self.cfg.parallelism.device == "cuda"
        if not cuda:
            torch.set_num_threads(self.cfg.parallelism.cpu_threads)
        device = torch.device("cpu")
        if cuda:
            import ray

            device = torch.device("cuda", int(ray.get_gpu_ids()[0]))
            torch.cuda.set_device(device)
        if self.world_size > 1:
            dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{master}",
                                    rank=self.rank, world_size=self.world_size)
        self.device = device
        self.backend = TorchTrainer(self.cfg, self.model_path, self.rank, self.world_size, device)

    def set_num_rollout(self, num_rollout: int) -> None:
        self.backend.set_num_rollout(num_rollout)

    def connect(self, endpoints: List[Dict[str, Any]]) -> None:
        """Rank 0 connects to the engines for weight pushes."""
        if self.rank != 0:
            return
        from slime_hydra.sync.sender import Endpoint, WeightSender
        from slime_hydra.utils.proc import node_ip

        self.sender = WeightSender(self.cfg.sync.transport, [Endpoint(**e) for e in endpoints], self.device,
                                   self.cfg.sync.bucket_mb, os.path.join(self.cfg.output_dir, "weight_sync"),
                                   self.model_path, node_ip(), trust_remote_code=self.cfg.model.trust_remote_code)
        self.sender.connect()

    def update_weights(self, version: int) -> Dict[str, float]:
        if self.rank != 0:
            return {}
        return self.sender.push(self.backend.named_weights(), version)

    def train(self, data: Dict[str, list]) -> Dict[str, float]:
        return self.backend.train(data)

    def offload(self) -> None:
        self.backend.offload()

    def onload(self) -> None:
        self.backend.onload()

    def save(self, out_dir: str, tokenizer_dir: Optional[str]) -> None:
        if self.rank == 0:
            self.backend.save(out_dir, tokenizer_dir)

    def load(self, ckpt_dir: str) -> None:
        self.backend.load(ckpt_dir)

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
