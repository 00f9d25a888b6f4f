"""The start-up's clock: where the seconds from ``python run.py`` to the first finished step go (the driver's
parts, the rollout side's ``startup_report``), in the first step's row (``startup/*``), the console and summary.json.
``StartupWatch`` says on the console what the start-up waits for."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

log = logging.getLogger("slime_hydra")
STARTUP_REPORT_S = 10.0  # while the run starts, what it waits for is logged this often
# how the engine parts are named in the console line (their keys come from the engine class's startup_parts)
ENGINE_PART_NAMES = {"process": "process", "distributed_init": "torch.distributed", "weights": "weights",
                     "kv_cache": "KV cache", "cuda_graphs": "CUDA graphs", "http_server": "HTTP server",
                     "first_answer": "first answer"}
SIDE_PART_NAMES = {"manager_actor": "manager actor", "data": "data", "engine_actor": "engine actor",
                   "engine_server": "server"}  # the rollout side's parts, as the console line names them


def process_started() -> float:
    """``time.time()`` when this process started (``python run.py``), or now if that is unknown."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - psutil missing or no procfs: the clock starts at its creation
        return time.time()


class StartupClock:
    """Seconds of each part of the start-up, in the order they were first timed."""

    def __init__(self, launched: Optional[float] = None):
        self.launched = launched if launched is not None else process_started()
        self.parts: Dict[str, float] = {}
        self.engines: Dict[str, float] = {}  # the rollout side's parts (add_rollout_side)
        self.done_at: Optional[float] = None  # time.time() when the first step finished

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time the block as ``name`` until the start-up is over (a part timed again adds up)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.done_at is None:
                self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + seconds

    def add_rollout_side(self, report: Dict[str, Any], created_at: float) -> None:
        """The rollout manager's ``startup_report`` (the manager created at ``created_at``, ``time.time()``)."""
        e: Dict[str, float] = {}
        if report.get("created"):
            e["manager_actor"] = report["created"] - created_at  # a Ray worker, the manager's imports
        if report.get("launched") and report.get("created"):
            e["engines_launch"] = report["launched"] - report["created"]
        if report.get("data_s") is not None:
            e["data"] = report["data_s"]
        if report.get("up"):
            e["rollout_side"] = report["up"] - created_at
        engines = [x for x in report.get("engines") or [] if x.get("started") and x.get("ready")]
        if engines:
            slowest = max(engines, key=lambda x: x["ready"] - x["started"])
            if report.get("launched"):
                e["engine_actor"] = max(x["started"] for x in engines) - report["launched"]
            e["engine_server"] = slowest["ready"] - slowest["started"]
            e.update({f"engine_{k.removesuffix('_s')}": v for k, v in (slowest.get("parts") or {}).items()})
            # the kernels built beside the servers: one engine's per node
            built = [x["prebuild"]["seconds"] for x in engines if (x.get("prebuild") or {}).get("kernels")]
            if built:
                e["engine_prebuild"] = max(built)
        self.engines = e

    def first_row(self, metrics: Dict[str, Any]) -> None:
        """A step's row: the first one ends the start-up, and its parts go to the console and to this row."""
        if self.done_at is not None:
            return
        self.add("first_step", metrics["perf/step_time"])
        self.done_at = time.time()
        metrics.update(self.metrics())
        log.info("%s", self.line())

    def total(self) -> float:
        return (self.done_at or time.time()) - self.launched

    def metrics(self) -> Dict[str, float]:
        """``startup/<part>_s`` and ``startup/total_s`` (launch to the first finished step)."""
        out = {f"startup/{k}{'' if k.endswith('_tokens') else '_s'}": round(v, 2)
               for k, v in {**self.parts, **self.engines}.items()}
        out["startup/total_s"] = round(self.total(), 2)
        return out

    def line(self) -> str:
        """The console's one-line account."""
        driver = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in self.parts.items())
        e = self.engines
        extra = [f"{e['engine_kv_tokens']:,} tokens of KV cache"] if "engine_kv_tokens" in e else []
        extra += [f"its kernel prebuild beside it {e['engine_prebuild']:.1f}"] if "engine_prebuild" in e else []
        engine_parts = ", ".join([f"{name} {e['engine_' + k]:.1f}" for k, name in ENGINE_PART_NAMES.items()
                                  if "engine_" + k in e] + extra)
        side = [f"{name} {e[k]:.1f}" + (f" ({engine_parts})" if k == "engine_server" and engine_parts else "")
                for k, name in SIDE_PART_NAMES.items() if k in e]
        rollout = f"; rollout side {e['rollout_side']:.1f} from its creation: " + ", ".join(side) \
            if "rollout_side" in e else ""
        return f"start-up: {self.total():.1f}s from launch to the first step done: {driver}{rollout}"


def engine_log_status(log_dir: str) -> List[str]:
    """``engine <rank>: <its log's last line>`` for each engine log in ``log_dir`` (this node's)."""
    from slime_hydra.utils.proc import tail  # imports httpx: not for a dry run, which imports this module

    out = []
    for path in sorted(glob.glob(os.path.join(log_dir, "engine_*.log"))):
        lines = [ln.split("\r")[-1].strip() for ln in tail(path, 5).splitlines()]
        last = next((ln for ln in reversed(lines) if ln), "")
        last = re.sub(r"^\[[^\]]*\]\s*", "", last)
        name = os.path.basename(path).removesuffix(".log").replace("_", " ")
        out.append(f"{name}: {last[-140:] if not last.startswith('$ ') else 'started, no output yet'}")
    return out


class StartupWatch:
    """Until the first step is done: every ``interval`` s, what the start-up waits for, and each engine's log."""

    def __init__(self, clock: StartupClock, waiting: Callable[[], str], log_dir: str,
                 interval: float = STARTUP_REPORT_S,
                 note: Callable[[str, float], Optional[str]] = lambda status, stood: None):
        self.clock, self.waiting, self.log_dir, self.interval, self.note = clock, waiting, log_dir, interval, note
        self._first_seen: Dict[str, float] = {}  # an engine's status line -> when it was first reported
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="startup-watch", daemon=True)

    def __enter__(self) -> "StartupWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and self.clock.done_at is None:
            try:
                what = self.waiting()
                engines = engine_log_status(self.log_dir) if "rollout side" in what or "engine" in what else []
                engines = [self._noted(e) for e in engines]
                log.info("starting (%.0fs since launch): waiting for %s%s", time.time() - self.clock.launched,
                         what, "".join(f"\n  {e}" for e in engines))
            except Exception as e:  # noqa: BLE001 - a report must never stop the run
                log.debug("start-up report failed: %r", e)

    def _noted(self, status: str) -> str:
        """``status``, and the engine's word on why where it has stood a while (``Engine.log_note``)."""
        note = self.note(status, time.time() - self._first_seen.setdefault(status, time.time()))
        return f"{status} ({note})" if note else status
