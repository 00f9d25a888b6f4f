"""The few helpers the GPU baselines share: a timestamped log line, a pass/fail check kept with the results,
a median."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Dict, Optional, Sequence


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def check(results: Dict[str, Any], name: str, ok: bool, detail: str) -> bool:
    """A pass/fail check, kept under ``results["checks"]`` and logged."""
    results.setdefault("checks", {})[name] = {"pass": bool(ok), "detail": detail}
    log(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    return bool(ok)


def median(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None
