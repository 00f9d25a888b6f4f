"""The embedded engine: a Hugging Face transformers model behind SGLang's HTTP protocol (``server.py``), for CPUs
and small GPU runs. Its flags are SGLang's names, plus ``--num-threads`` (torch CPU threads)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, List, Optional

from slime_hydra.rollout.engines.base import Engine, to_flags

if TYPE_CHECKING:
    from slime_hydra.config.schema import RunConfig


class EmbeddedEngine(Engine):
    @classmethod
    def check(cls, cfg: "RunConfig") -> List[str]:
        p = cfg.parallelism
        if p.gpus_per_engine != 1:
            return ["parallelism.gpus_per_engine: must be 1 for rollout.engine=embedded (it has no tensor "
                    f"parallelism), got {p.gpus_per_engine}"]
        return []

    def command(self, host: str, port: int, base_gpu_id: int = 0, nccl_port: Optional[int] = None) -> List[str]:
        s = self.spec
        args = {**self.common_args(host, port, base_gpu_id), "dtype": s.dtype, "device": s.device,
                "max_running_requests": s.max_batch, "num_threads": s.num_threads,
                "enable_memory_saver": s.memory_saver}
        return [sys.executable, "-m", "slime_hydra.rollout.engines.embedded.server", *to_flags(args)]
