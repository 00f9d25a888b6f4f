"""A trainer rank as a Ray actor: the process group, the backend named by ``trainer.backend``, the RL
step over it, and the weight push on the rank the backend chooses. ``TrainerGroup``
(:mod:`slime_hydra.launch.cluster`) fans calls out to every rank."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

if TYPE_CHECKING:
    from slime_hydra.config.schema import AlgoConfig, ModelConfig, ParallelismConfig, SyncConfig, TrainerConfig
    from slime_hydra.train.backend import WarmUpShape


class TrainerActor:
    """One trainer rank, given its parts of the run config; temperature and budget come with :meth:`train`."""

    def __init__(self, rank: int, world_size: int, model_path: str, *, model: ModelConfig, algo: AlgoConfig,
                 trainer: TrainerConfig, parallelism: ParallelismConfig, sync: SyncConfig, seed: int, run_dir: str,
                 teacher: Optional[ModelConfig] = None):
        self.rank, self.world_size, self.model_path, self.teacher_cfg = rank, world_size, model_path, teacher
        self.model_cfg, self.algo, self.trainer_cfg, self.parallelism = model, algo, trainer, parallelism
        self.sync, self.seed, self.run_dir = sync, seed, run_dir
        self.backend = self.rl = self.sender = None
        self.every_rank_pushes = False

    def master_address(self) -> str:
        from slime_hydra.utils.proc import free_port, node_ip

        ip = node_ip()
        return f"{ip}:{free_port(ip)}"

    def init(self, master: str) -> Dict[str, Any]:
        """Join the process group, build the backend; returns where this rank sits (``dp_rank``, ``dp_size``, ...)."""
        import torch.distributed as dist

        from slime_hydra.train import algorithms as A
        from slime_hydra.train.backend import BACKENDS
        from slime_hydra.train.trainer import RLTrainer

        torch.manual_seed(self.seed + self.rank)
        cuda = self.parallelism.device == "cuda"
        device = torch.device("cpu")
        if cuda:
            import ray

            device = torch.device("cuda", int(ray.get_gpu_ids()[0]))
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(self.parallelism.cpu_threads)
        if self.world_size > 1:
            dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{master}",
                                    rank=self.rank, world_size=self.world_size)
        self.device = device
        self.backend = BACKENDS[self.trainer_cfg.backend](
            model=self.model_cfg, algo=self.algo, trainer=self.trainer_cfg, parallelism=self.parallelism,
            model_path=self.model_path, rank=self.rank, world_size=self.world_size, device=device)
        teacher = None
        if A.needs_teacher(self.algo):
            from slime_hydra.train.teacher import Teacher

            teacher = Teacher(self.teacher_cfg, device, self.trainer_cfg.micro_batch_size)
        self.rl = RLTrainer(self.backend, self.algo, self.trainer_cfg.num_steps_per_rollout, teacher=teacher)
        return {k: getattr(self.backend, k) for k in ("dp_rank", "dp_size", "pushes_weights", "reports_metrics")}

    def set_num_rollout(self, num_rollout: int) -> None:
        self.backend.set_num_rollout(num_rollout)

    def connect(self, endpoints: List[Dict[str, Any]]) -> None:
        """The pushing rank connects to the engines; every rank learns if a push needs its GPU's copy of a bucket."""
        from slime_hydra.sync.sender import Endpoint, WeightSender, needs_every_rank
        from slime_hydra.utils.proc import node_ip

        targets = [Endpoint(**e) for e in endpoints]
        self.every_rank_pushes = needs_every_rank(self.sync.transport, targets, self.device)
        if not self.backend.pushes_weights:
            return
        self.sender = WeightSender(self.sync.transport, targets, self.device,
                                   self.sync.bucket_mb, os.path.join(self.run_dir, "weight_sync"),
                                   self.model_path, node_ip(), trust_remote_code=self.model_cfg.trust_remote_code,
                                   timeout_s=self.sync.push_timeout_s)
        self.sender.connect()

    def update_weights(self, version: int) -> Dict[str, float]:
        """Every rank streams the weights (a sharded backend gathers); the pushing rank sends them."""
        weights = self.backend.hf_weights(every_rank=self.every_rank_pushes)
        if not self.backend.pushes_weights:
            if self.every_rank_pushes:
                from slime_hydra.sync.sender import take_part_in_tensor_push

                take_part_in_tensor_push(weights, self.sync.bucket_mb << 20, self.device)
            else:
                for _ in weights:  # take part in the gathers
                    pass
            return {}
        if self.sender is None:
            raise RuntimeError("update_weights before connect: the pushing rank has no engines to send to")
        return self.sender.push(weights, version)

    def train(self, data: Dict[str, list], temperature: float, max_response_len: int) -> Dict[str, float]:
        """The RL step's metrics, ``actor_time`` (seconds) and, on a GPU, ``gpu_peak_gib`` (torch's peak allocation)."""
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        metrics = self.rl.train(data, temperature=temperature, max_response_len=max_response_len)
        if cuda:
            metrics["gpu_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2 ** 30
        metrics["actor_time"] = time.perf_counter() - t0  # the metrics were read from the device: it is done
        return metrics

    def offload(self, keep_weights: bool = False) -> None:
        self.backend.offload(keep_weights=keep_weights)

    def onload(self) -> None:
        self.backend.onload()

    def free_cache(self) -> None:
        self.backend.free_cache()

    def warm_up(self, temperature: float, shape: WarmUpShape) -> None:
        self.backend.warm_up(temperature, shape)

    def save(self, out_dir: str, tokenizer_dir: Optional[str]) -> None:
        """``out_dir/hf`` (every run checkpoint has one) and the backend's resumable state."""
        self.backend.export_hf(os.path.join(out_dir, "hf"), tokenizer_dir)
        self.backend.save(out_dir, self.rl.state_dict())

    def load(self, ckpt_dir: str) -> None:
        self.rl.load_state_dict(self.backend.load(ckpt_dir))

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
