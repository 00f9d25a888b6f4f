"""Failures a rollout survives, counted in the metric ``rollout/<what>_count`` (drained per rollout); the first
in a process is logged at WARNING. Which failures are counted is the rule in :mod:`slime_hydra.rewards.hub`."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Dict

log = logging.getLogger("slime_hydra.rewards")

_lock = threading.Lock()  # math rewards may be counted from worker threads (the no-process fallback)
_counts: Counter = Counter()
_warned: set = set()


def count(what: str, message: str) -> None:
    """One more ``what``; ``message`` (with the sample's identity) is logged at WARNING the first time."""
    with _lock:
        _counts[what] += 1
        first = what not in _warned
        _warned.add(what)
    if first:
        log.warning("%s (counted in rollout/%s_count; later ones are logged at DEBUG)", message, what)
    else:
        log.debug("%s", message)


def drain() -> Dict[str, float]:
    """The counts since the last drain, as metrics (``rollout/<what>_count``), and reset them."""
    with _lock:
        out = {f"rollout/{k}_count": float(v) for k, v in sorted(_counts.items())}
        _counts.clear()
    return out
