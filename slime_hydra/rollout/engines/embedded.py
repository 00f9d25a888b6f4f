"""The embedded engine: a Hugging Face transformers model behind SGLang's HTTP protocol
(``slime_hydra.rollout.embedded.server``), for CPUs and small GPU runs. Its flags are SGLang's names,
plus ``--num-threads`` (torch CPU threads) of its own."""

from __future__ import annotations

import sys
from typing import List, Optional

from slime_hydra.rollout.engines.base import Engine, to_flags


class EmbeddedEngine(Engine):
    def command(self, host: str, port: int, base_gpu_id: int = 0, nccl_port: Optional[int] = None) -> List[str]:
        s = self.spec
        args = {**self.common_args(host, port, base_gpu_id), "dtype": s.dtype, "device": s.device,
                "max_running_requests": s.max_batch, "num_threads": s.num_threads}
        return [sys.executable, "-m", "slime_hydra.rollout.embedded.server", *to_flags(args)]
