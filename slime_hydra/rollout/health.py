"""The engines' health and restarts (``rollout.fault_tolerance``), mixed into ``EngineFleet``.

Without fault tolerance an engine that dies fails the rollout within ``ENGINE_POLL_S``. With it, while a
rollout or an eval runs, an engine whose process exits or whose ``/health_generate`` misses its deadline is
removed from the router, SIGKILLed and restarted on the same GPUs; its failed requests are re-queued
(:meth:`FleetHealth.requeue`) and sent again once an engine serves. A restarted engine takes no traffic until
the driver has pushed it the current weights (``awaiting_weights`` -> push -> ``weights_pushed``). A dead
router is restarted on the same port. A restart budget turns a crash loop into an error naming what failed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from slime_hydra.rollout.engines.actor import join_nodes
from slime_hydra.utils.http import EngineError, control, weight_version
from slime_hydra.utils.proc import tail

log = logging.getLogger(__name__)

ENGINE_POLL_S = 1.0  # how often rollouts and evals check that every engine still runs
SERVING, RESTARTING, AWAITING_WEIGHTS = "serving", "restarting", "awaiting_weights"
RESTART_WINDOW_S = 3600.0  # rollout.max_engine_restarts_per_hour counts restarts within this window
# pauses before each look for a failed request's engine exit (a killed process closes its sockets first)
EXIT_CHECK_PAUSES_S = (0.0, 0.1, 0.4)


class WeightsChanged(RuntimeError):
    """Every engine failed during a rollout and came back with newer weights: the rollout starts again."""

    def __init__(self, version: int):
        super().__init__(f"the engines now run weights v{version}")
        self.version = version


@dataclass
class FaultTolerance:
    """``rollout.fault_tolerance`` and its settings (``rollout.health_check_*``, the restart budget)."""

    health_check_interval_s: float = 10.0
    health_check_timeout_s: float = 30.0
    max_restarts_per_hour: int = 3

    @classmethod
    def from_config(cls, rollout) -> Optional["FaultTolerance"]:
        if not rollout.fault_tolerance:
            return None
        return cls(rollout.health_check_interval_s, rollout.health_check_timeout_s,
                   rollout.max_engine_restarts_per_hour)


@dataclass
class EngineHandle:
    """One running engine: its URL (node 0's server), GPUs, and its Ray actors (one per node) with their logs."""

    rank: int
    url: str
    gpus: int = 1
    first_gpu: int = 0  # the physical GPU of its tensor-parallel rank 0 (rank j on first_gpu + j)
    actors: List[Any] = field(default_factory=list)
    logs: List[str] = field(default_factory=list)
    state: str = SERVING
    restarts: List[float] = field(default_factory=list)  # monotonic times of its restarts (the budget)
    startup: Dict[str, Any] = field(default_factory=dict)  # its first start (EngineActor.startup_report)


class FleetHealth:
    """The health and restart half of ``EngineFleet`` (which sets ``engines``, ``router``, ``memory``,
    ``new_actors``, ``_lock``, ``_router_cfg``, ``_router_log`` and ``_register``)."""

    def __init__(self, fault_tolerance: Optional[FaultTolerance] = None):
        self.ft = fault_tolerance
        self.counters: Counter = Counter()  # engine_restarts, requeued_requests: read by take_counters()
        self.fatal: Optional[EngineError] = None  # the restart budget is spent: every later call raises it
        self._serving = asyncio.Event()  # some engine takes requests (fault tolerance)
        self._serving.set()
        self._taking_out = 0  # failed engines being removed from the router right now
        self._last_out = -math.inf  # when the last failed engine had left the router
        self._check: Optional[asyncio.Future] = None
        self._check_started = -math.inf
        self._restarting: Dict[int, asyncio.Future] = {}
        self.version: Optional[int] = None  # the weights the serving engines run (the last push)
        self.rollout_version: Optional[int] = None  # the weights the running rollout asked for
        self._router_restarts: List[float] = []  # monotonic times (the budget)

    def _restart_at_startup(self, e: EngineHandle, err: Exception) -> None:
        """An engine that died while it started is started again, each try within the restart budget."""
        import ray

        while True:
            reason = f"engine {e.rank} failed while starting: {err}"
            self.counters["engine_restarts"] += 1
            self._charge_restart(e, reason)  # raises once the budget is spent
            log.warning("%s\n-> starting it again", reason)
            if isinstance(err, ray.exceptions.RayActorError):
                for a in e.actors:
                    ray.kill(a)
                e.actors = []
            try:
                self._start_again(e)
                e.state = SERVING
                return
            except Exception as again:  # noqa: BLE001 - counted above, tried again within the budget
                err = again

    def dead_engines(self) -> List[str]:
        """Why each dead engine died (an actor too busy to answer within ENGINE_POLL_S counts as alive)."""
        return [reason for _, reason in self._exited()]

    def _exited(self) -> List[Tuple[EngineHandle, str]]:
        """The running engines whose server process or Ray actor has ended, with how."""
        import ray

        watched = [(e, a, log_path) for e in self.engines if e.state in (SERVING, AWAITING_WEIGHTS)
                   for a, log_path in zip(e.actors, e.logs)]
        if not watched:
            return []
        refs = [a.failure.remote() for _, a, _ in watched]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ENGINE_POLL_S)
        out: List[Tuple[EngineHandle, str]] = []
        for ref, (e, _, log_path) in zip(refs, watched):
            if ref not in ready or any(e is f for f, _ in out):
                continue
            try:
                failure = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:  # unreachable for now, not dead
                continue
            except ray.exceptions.RayActorError as err:
                name = os.path.basename(log_path).removesuffix(".log")
                failure = f"{name}: its actor died ({err!r}); last lines of {log_path}:\n{tail(log_path)}"
            if failure:
                out.append((e, failure))
        return out

    async def _unhealthy(self) -> List[Tuple[EngineHandle, str]]:
        """The serving engines whose /health_generate (one real generation) fails or misses the deadline."""
        timeout = self.ft.health_check_timeout_s

        async def probe(e: EngineHandle) -> Optional[str]:
            try:
                await asyncio.to_thread(control, e.url, "/health_generate", method="GET", timeout=timeout)
                return None
            except EngineError as err:
                return (f"engine {e.rank} ({e.url}) failed its health check (no answer from /health_generate "
                        f"within rollout.health_check_timeout_s={timeout:g}s: {err}); last lines of "
                        f"{e.logs[0] if e.logs else 'its log'}:\n{tail(e.logs[0]) if e.logs else ''}")

        serving = [e for e in self.engines if e.state == SERVING]
        reasons = await asyncio.gather(*(probe(e) for e in serving))
        return [(e, r) for e, r in zip(serving, reasons) if r]

    async def watched(self, coro):
        """Await ``coro`` while watching the engines: if one dies, fail within ``ENGINE_POLL_S`` with its
        log's tail; with fault tolerance, take it out and restart it instead (and check health every interval)."""
        work = asyncio.ensure_future(coro)
        if not any(e.actors for e in self.engines):
            return await work
        watchdog = asyncio.ensure_future(self._watch() if self.ft is None else self._monitor())
        try:
            done, _ = await asyncio.wait({work, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            if watchdog in done:
                watchdog.result()  # raises
            return work.result()
        finally:
            work.cancel()  # after an engine died: the rollout function cancels its requests and aborts the rest
            watchdog.cancel()
            await asyncio.gather(work, watchdog, return_exceptions=True)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(ENGINE_POLL_S)
            dead = await asyncio.to_thread(self.dead_engines)
            if dead:
                raise EngineError("\n".join(dead))

    async def _monitor(self) -> None:
        next_probe = time.monotonic() + self.ft.health_check_interval_s
        while True:
            await asyncio.sleep(ENGINE_POLL_S)
            probe = time.monotonic() >= next_probe
            await self.check(probe)
            if probe:
                next_probe = time.monotonic() + self.ft.health_check_interval_s

    async def check(self, probe: bool = False, since: float = -math.inf) -> None:
        """Take out (and restart) every serving engine that has exited, or with ``probe`` fails its health
        check. Concurrent callers share a check started at ``since`` (monotonic) or later. Raises once the
        restart budget is spent."""
        if self.fatal is not None:
            raise self.fatal
        if self._check is not None and not self._check.done() and self._check_started < since:
            await asyncio.shield(self._check)  # it may have looked before what the caller saw happened
        if self._check is None or self._check.done():
            self._check_started = time.monotonic()
            self._check = asyncio.ensure_future(self._check_engines(probe))
        await asyncio.shield(self._check)

    async def _check_engines(self, probe: bool) -> None:
        if self.router is not None and self._router_cfg is not None and self.router.proc.poll() is not None:
            await asyncio.to_thread(self._restart_router)
        failed = await asyncio.to_thread(self._exited)
        if probe:
            failed += [(e, r) for e, r in await self._unhealthy() if all(e is not f for f, _ in failed)]
        for e, reason in failed:
            await self._fail(e, reason)

    async def _fail(self, e: EngineHandle, reason: str) -> None:
        if e.state not in (SERVING, AWAITING_WEIGHTS):
            return
        e.state = RESTARTING
        self._taking_out += 1
        self._update_serving()
        self.counters["engine_restarts"] += 1
        try:
            self._charge_restart(e, reason)
            log.warning("%s\n-> taking engine %d out of the router and restarting it", reason, e.rank)
            await asyncio.to_thread(self._take_out, e)
        finally:
            self._taking_out -= 1
            self._last_out = time.monotonic()
        self._restarting[e.rank] = asyncio.ensure_future(self._restart(e))

    def _charge_restart(self, e: EngineHandle, reason: str) -> None:
        self._charge(e.restarts, f"engine {e.rank}", reason)

    def _charge(self, restarts: List[float], what: str, reason: str) -> None:
        """Add a restart now to ``restarts`` (monotonic times within the window); past the budget, fail the run."""
        now = time.monotonic()
        restarts[:] = [t for t in restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(restarts) > self.ft.max_restarts_per_hour:
            self.fatal = EngineError(f"{what} failed {len(restarts)} times within an hour, more than "
                                     f"rollout.max_engine_restarts_per_hour={self.ft.max_restarts_per_hour}; "
                                     f"the last time:\n{reason}")
            self._serving.set()  # wake the requests waiting for an engine: they raise the error
            raise self.fatal

    def _restart_router(self) -> None:
        """A new router on the dead one's port, the serving engines registered again."""
        from slime_hydra.rollout.router import Router

        self._taking_out += 1
        try:
            while True:  # until one runs (a router that dies while it starts is started again) or the budget is spent
                old = self.router
                reason = (f"sglang-router ({old.url}) exited with code {old.proc.returncode}; last lines of "
                          f"{old.log_path}:\n{tail(old.log_path)}")
                self._charge(self._router_restarts, "the router", reason)
                log.warning("%s\n-> restarting it on the same port", reason)
                t0 = time.perf_counter()
                old.stop()
                self.router = Router(self._router_cfg, old.host, self._router_log, port=old.port, wait=False)
                self.counters["router_restarts"] += 1
                try:
                    self.router.wait_ready()
                    self._register()
                except Exception:
                    if self.router.proc.poll() is None:
                        raise
                    continue  # it died again
                log.warning("router restarted at %s in %.1fs with %d engine(s)", self.router.url,
                            time.perf_counter() - t0, len(self.urls))
                return
        finally:
            self._taking_out -= 1
            self._last_out = time.monotonic()

    def _update_serving(self) -> None:
        if any(e.state == SERVING for e in self.engines):
            self._serving.set()
        else:
            self._serving.clear()

    def _take_out(self, e: EngineHandle) -> None:
        """Out of the router, then SIGKILL the server's processes (its requests then fail at the router)."""
        import ray

        if self.router is not None:
            try:
                self.router.remove_worker(e.url)
            except Exception as err:  # noqa: BLE001 - the engine is restarted either way
                log.warning("could not remove %s from the router: %s", e.url, err)
        try:
            ray.get([a.kill.remote() for a in e.actors], timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
            log.warning("engine %d: its actor is gone (%r); a new one takes its bundles", e.rank, err)
            for a in e.actors:
                ray.kill(a)
            e.actors = []

    async def _restart(self, e: EngineHandle) -> None:
        """Start ``e`` again until it runs or the budget is spent."""
        while True:
            try:
                await asyncio.to_thread(self._start_again, e)
                return
            except Exception as err:  # noqa: BLE001 - reported below, and retried within the budget
                reason = f"engine {e.rank} did not restart: {err}"
                try:
                    self._charge_restart(e, reason)
                except EngineError:
                    log.error("%s", self.fatal)
                    return
                log.warning("%s; trying again", reason)

    def _start_again(self, e: EngineHandle) -> None:
        import ray

        if not e.actors:
            e.actors = self.new_actors(e.rank)
            join_nodes(e.actors)
        elif len(e.actors) > 1:
            join_nodes(e.actors)  # a fresh address for the nodes to meet
        t0 = time.perf_counter()
        url = ray.get([a.start.remote() for a in e.actors])[0]
        first_gpu = ray.get(e.actors[0].first_gpu.remote())
        with self._lock:  # in the memory state the others are in (colocated runs)
            if self.memory != "awake":
                control(url, "/release_memory_occupation", {"tags": None})
            if self.memory == "weights":
                control(url, "/resume_memory_occupation", {"tags": ["weights"]})
            e.url, e.first_gpu = url, first_gpu
            e.state = AWAITING_WEIGHTS
        log.warning("engine %d restarted at %s in %.1fs; it takes requests once the current weights are pushed",
                    e.rank, url, time.perf_counter() - t0)

    def awaiting_weights(self) -> bool:
        """Some restarted engine waits for the current weights (the driver then pushes them)."""
        return any(e.state == AWAITING_WEIGHTS for e in self.engines)

    def weights_pushed(self, version: int) -> List[int]:
        """After a push of ``version``: the restarted engines that run it join the router. Returns their ranks."""
        import httpx

        joined = []
        for e in self.engines:
            if e.state != AWAITING_WEIGHTS:
                continue
            try:
                if weight_version(e.url) != str(version):
                    continue  # restarted after the push began: the next push brings it in
                if self.router is not None:
                    self.router.add_worker(e.url)
            except (EngineError, RuntimeError, TimeoutError, OSError, httpx.HTTPError) as err:
                log.warning("engine %d could not rejoin (%s); it is checked again at the next rollout", e.rank, err)
                continue
            e.state = SERVING
            joined.append(e.rank)
        if joined:
            log.warning("engine(s) %s run weights v%d and take requests again", joined, version)
        return joined

    async def rejoined(self, version: int) -> List[int]:
        """``weights_pushed`` on the fleet's event loop; a router that died meanwhile is restarted first."""
        if self.ft is not None:
            await self.check()
        joined = await asyncio.to_thread(self.weights_pushed, version)
        self.version = version
        self._update_serving()
        return joined

    def stalled(self) -> bool:
        """No engine serves, and a restarted one waits for weights: a rollout cannot go on before a push."""
        return not any(e.state == SERVING for e in self.engines) and self.awaiting_weights()

    async def requeue(self, sent_at: float) -> bool:
        """A request sent at ``sent_at`` (monotonic) failed: if an engine failed since or none serves, wait
        until one serves and return True (the client sends it again); False: a plain failure."""
        if self.ft is None:
            return False
        for pause in EXIT_CHECK_PAUSES_S:
            if self._failed_since(sent_at):
                break
            # an engine killed a moment ago: its requests fail before the monitor looks, and its
            # connections close a moment before its process counts as exited
            await asyncio.sleep(pause)
            await self.check(since=time.monotonic())
        if not self._failed_since(sent_at) and self._serving.is_set():
            return False
        self.counters["requeued_requests"] += 1
        while not self._serving.is_set():
            await self._serving.wait()
        if self.fatal is not None:
            raise self.fatal
        self._check_weights()
        return True

    def _check_weights(self) -> None:
        """Raise WeightsChanged if the serving engines run other weights than the running rollout asked for."""
        if None not in (self.version, self.rollout_version) and self.version != self.rollout_version:
            raise WeightsChanged(self.version)

    def _failed_since(self, sent_at: float) -> bool:
        return self._taking_out > 0 or sent_at <= self._last_out

    def take_counters(self) -> Dict[str, float]:
        """Restarts and re-queued requests since the last call, as rollout metrics."""
        out = {f"rollout/{k}": float(self.counters[k]) for k in ("engine_restarts", "requeued_requests")}
        out["heal/router_restarts"] = float(self.counters["router_restarts"])
        self.counters.clear()
        return out
