"""Math rewards off the event loop, in worker processes: sympy can spin for minutes on a hostile answer, and a
thread can be neither interrupted nor kept off the GIL. A worker's main thread has math_verify's time limit; a
worker past the backstop is killed. Where processes cannot start, checks run in threads, without a limit.
Results are ``math_verdict``'s (reward, failure): the caller counts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import multiprocessing
import os
import weakref
from typing import Any, Optional, Tuple

from slime_hydra.rewards.math_answer import Failure, math_verdict

log = logging.getLogger(__name__)

MATH_TIMEOUT_S = 5  # math_verify's limit per parse / comparison (whole seconds)
BACKSTOP_S = 30.0  # a running check that takes longer is killed with its worker
# worker processes; 0: check in threads (no time limit). Env SLIME_HYDRA_MATH_WORKERS overrides.
WORKERS = int(os.environ.get("SLIME_HYDRA_MATH_WORKERS", max(1, min(4, os.cpu_count() or 1))))

_pool: Optional[concurrent.futures.ProcessPoolExecutor] = None
_use_threads = False
_slots: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = weakref.WeakKeyDictionary()


def _get_pool() -> Optional[concurrent.futures.ProcessPoolExecutor]:
    global _pool, _use_threads
    if _pool is None and not _use_threads and WORKERS > 0:
        try:
            # spawn, not fork: the parent has threads (event loop helpers, Ray) that fork would break
            _pool = concurrent.futures.ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn"))
        except (OSError, AssertionError, ValueError) as e:
            log.warning("math reward: cannot start worker processes (%s); checking in threads, without a time limit", e)
            _use_threads = True
    return _pool


def _kill_pool(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    global _pool
    if _pool is pool:
        _pool = None
    for p in list(getattr(pool, "_processes", {}).values()):  # no public API to kill a busy worker
        p.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def shutdown() -> None:
    """Stop the worker processes (they are also stopped at exit)."""
    if _pool is not None:
        _kill_pool(_pool)


async def math_verdict_async(response: str, label: Any) -> Tuple[float, Failure]:
    """``math_verdict`` in a worker process; at most WORKERS are submitted at once (the backstop times runs)."""
    loop = asyncio.get_running_loop()
    slots = _slots.get(loop) or _slots.setdefault(loop, asyncio.Semaphore(max(WORKERS, 1)))
    async with slots:
        pool = _get_pool()
        if pool is None:
            return await asyncio.to_thread(math_verdict, response, label)
        job = functools.partial(math_verdict, response, label, MATH_TIMEOUT_S)
        try:
            return await asyncio.wait_for(loop.run_in_executor(pool, job), BACKSTOP_S)
        except asyncio.TimeoutError:
            _kill_pool(pool)
            why = f"math reward: checking {response[-200:]!r} ran over {BACKSTOP_S}s; its worker was killed, scored 0"
            return 0.0, ("reward_verifier_timeout", why)
        except concurrent.futures.process.BrokenProcessPool:
            _kill_pool(pool)  # a worker died (killed for another answer, or out of memory): retry once
            return await loop.run_in_executor(_get_pool(), job)
