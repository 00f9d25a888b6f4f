"""What the GPU benches share while a ``run.py`` goes: an nvidia-smi sampler (memory and utilisation per
GPU over time), the run's metrics rows as they appear, and a timestamped log line."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from typing import Any, Dict, Iterator, List, Tuple


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def read_rows(path: str) -> List[Dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` written so far ([] before it exists or while a line is half-written)."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


class GpuSampler:
    """nvidia-smi every ``interval_ms`` into ``path``: each GPU's memory and utilisation over time."""

    QUERY = "timestamp,index,memory.used,utilization.gpu"

    def __init__(self, path: str, interval_ms: int = 200, start: bool = True):
        self.path = path
        self.proc = None
        if start:
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                          "-lms", str(interval_ms)], stdout=open(path, "w"), stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()

    def samples(self) -> Iterator[Tuple[float, str, float, float]]:
        """(wall time, "gpu<i>", MiB used, utilisation %) per line; unparsable lines are skipped."""
        with open(self.path) as f:
            for line in f:
                parts = [p.strip() for p in line.split(",")]
                if len(parts) != 4:
                    continue
                try:
                    stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
                    yield stamp, f"gpu{int(parts[1])}", float(parts[2]), float(parts[3])
                except ValueError:
                    continue

    def peaks(self) -> Dict[str, Dict[str, float]]:
        """Each GPU's peak memory (GiB) and mean utilisation over the whole run."""
        per: Dict[str, List[Tuple[float, float]]] = {}
        for _, gpu, mib, util in self.samples():
            per.setdefault(gpu, []).append((mib, util))
        return {g: {"peak_gib": round(max(m for m, _ in v) / 1024, 1),
                    "mean_util": round(statistics.mean(u for _, u in v), 1)} for g, v in per.items()}

    def idle_share(self, since_wall: float) -> Dict[str, Dict[str, float]]:
        """From ``since_wall`` on: each GPU's share of samples under 5 % utilisation, and its mean."""
        per: Dict[str, List[float]] = {}
        for stamp, gpu, _, util in self.samples():
            if stamp >= since_wall:
                per.setdefault(gpu, []).append(util)
        return {g: {"samples": len(u), "idle_share": sum(x < 5 for x in u) / len(u), "mean_util": statistics.mean(u)}
                for g, u in per.items() if u}
