"""The engine fleet: the rollout engines of a run and everything done to all of them at once.

It starts the engines through their Ray actors and sglang-router at once (``EngineFleet.launch``;
``wait_up`` waits for them while the caller loads its data), registers the engines with the router,
watches their health (``dead_engines``, ``watched``), aborts their requests, releases and resumes
their memory (colocated runs), and names their URLs for the trainer's weight push (``endpoints``).

Without fault tolerance an engine that dies fails the rollout within ``ENGINE_POLL_S``. With it
(``rollout.fault_tolerance``, :class:`FaultTolerance`), while a rollout or an eval runs (when the
engines are awake), an engine whose process exits or whose ``/health_generate`` gets no answer
within the deadline is taken out: removed from the router, its process group SIGKILLed (a frozen
process ignores anything else), and restarted in the background on the same GPUs by its Ray actor
(a new actor on the same bundles if the actor died). Its requests fail (at the router, or at the engine
itself for the group requests sent straight to one: :meth:`EngineFleet.engine_url`); the generate
client asks :meth:`EngineFleet.requeue` and sends them again once an engine serves (the same
request with the same ``sampling_seed``: nothing is generated twice into a sample, nothing lost).
A restarted engine runs the initial checkpoint, so it takes no traffic until the driver has pushed
the current weights to it (``awaiting_weights`` -> the trainers reconnect and push ->
``weights_pushed`` registers it). The driver does that at its next weight push, or at once in a
synchronous run whose trainers are idle while the rollout waits (see ``sync/push.py``). A
restart budget per engine turns a crash loop into an error naming the engine and its log's tail.

A fleet can also be built from engines that something else started (``EngineFleet([EngineHandle(0, url)])``,
no Ray): then it has no actors to watch, and the HTTP calls work as in a run.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from slime_hydra.rollout.engines import ServerSpec
from slime_hydra.utils.http import EngineError, control, weight_version
from slime_hydra.utils.proc import tail

if TYPE_CHECKING:
    from slime_hydra.config.schema import RouterConfig, RunConfig
    from slime_hydra.plan.resources import ResourcePlan
    from slime_hydra.rollout.router import Router

log = logging.getLogger(__name__)

ENGINE_POLL_S = 1.0  # how often rollouts and evals check that every engine still runs
SERVING, RESTARTING, AWAITING_WEIGHTS = "serving", "restarting", "awaiting_weights"
STARTUP_REPORT_S = 10.0  # while engines start, what each is doing is logged this often
RESTART_WINDOW_S = 3600.0  # rollout.max_engine_restarts_per_hour counts restarts within this window
# how long a failed request's question waits for its engine's exit to show: a killed process closes
# its sockets before it counts as exited (seconds before each look)
EXIT_CHECK_PAUSES_S = (0.0, 0.1, 0.4)


class WeightsChanged(RuntimeError):
    """Every engine failed during a rollout and came back with newer weights (an async run, whose
    trainers had moved on): the rollout is generated again from its start with ``version``."""

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


def engine_specs(cfg: "RunConfig", plan: "ResourcePlan", model_path: str) -> List[List[ServerSpec]]:
    """Each engine's server spec, one per node it spans (SGLang's nnodes / node_rank)."""
    p = cfg.parallelism
    nnodes = max(1, p.gpus_per_engine // p.gpus_per_node)
    base = ServerSpec(engine=cfg.rollout.engine, model_path=model_path, tokenizer_path=model_path,
                      dtype=cfg.model.dtype, device=plan.device, gpus=p.gpus_per_engine, seed=cfg.rollout.seed,
                      trust_remote_code=cfg.model.trust_remote_code, memory_saver=bool(p.offload_rollout),
                      max_batch=cfg.rollout.embedded_max_batch, decode_batch=plan.engine_batch,
                      kv_tokens=plan.engine_kv_cap,
                      server_args=dict(cfg.rollout.server_args), fork_workers=cfg.rollout.sglang_fork_workers,
                      prebuild_kernels=cfg.rollout.sglang_prebuild_kernels,
                      num_threads=p.cpu_threads if plan.device == "cpu" else None, nnodes=nnodes)
    return [[replace(base, seed=cfg.rollout.seed + slot.rank, node_rank=n) for n in range(nnodes)]
            for slot in plan.engines]


@dataclass
class EngineHandle:
    """One running engine: its URL (node 0's server), its GPU count, and, when this fleet started
    it, its Ray actors (one per node it spans) with their server logs."""

    rank: int
    url: str
    gpus: int = 1
    first_gpu: int = 0  # the physical GPU of its tensor-parallel rank 0 (rank j on first_gpu + j)
    actors: List[Any] = field(default_factory=list)
    logs: List[str] = field(default_factory=list)
    state: str = SERVING
    restarts: List[float] = field(default_factory=list)  # monotonic times of its restarts (the budget)
    startup: Dict[str, Any] = field(default_factory=dict)  # its first start (EngineActor.startup_report)


class EngineFleet:
    def __init__(self, engines: List[EngineHandle], router: Optional["Router"] = None,
                 fault_tolerance: Optional[FaultTolerance] = None):
        self.engines = engines
        self.router = router
        self.ft = fault_tolerance
        # engine rank -> new Ray actors for it on its bundles (set by launch(); restarts of dead actors)
        self.new_actors: Optional[Callable[[int], List[Any]]] = None
        self._starting: List[List[Any]] = []  # launch() -> wait_up(): each engine's start() calls
        self._started = 0.0
        self._kind = "no"
        self.memory = "awake"  # awake | released | weights (colocated runs: what the engines hold)
        self.counters: Counter = Counter()  # engine_restarts, requeued_requests: read by take_counters()
        self.fatal: Optional[EngineError] = None  # the restart budget is spent: every later call raises it
        self._lock = threading.Lock()  # memory state vs a restart that finishes meanwhile
        self._serving = asyncio.Event()  # some engine takes requests (fault tolerance)
        self._serving.set()
        self._taking_out = 0  # failed engines being removed from the router right now
        self._last_out = -math.inf  # when the last failed engine had left the router
        self._check: Optional[asyncio.Future] = None
        self._check_started = -math.inf
        self._restarting: Dict[int, asyncio.Future] = {}
        self.version: Optional[int] = None  # the weights the serving engines run (the last push)
        self.rollout_version: Optional[int] = None  # the weights the running rollout asked for
        self._turn = 0  # round robin of engine_url()
        self._router_cfg: Optional["RouterConfig"] = None  # launch_router's, for a restart
        self._router_log = ""
        self._router_restarts: List[float] = []  # monotonic times (the budget)

    @classmethod
    def start(cls, specs: List[List[ServerSpec]], plan: "ResourcePlan", pg: Any, log_dir: str,
              startup_timeout_s: float, router: "RouterConfig",
              fault_tolerance: Optional[FaultTolerance] = None) -> "EngineFleet":
        """``launch`` and ``wait_up``: the fleet once every engine serves, behind the router."""
        return cls.launch(specs, plan, pg, log_dir, startup_timeout_s, router, fault_tolerance).wait_up()

    @classmethod
    def launch(cls, specs: List[List[ServerSpec]], plan: "ResourcePlan", pg: Any, log_dir: str,
               startup_timeout_s: float, router: "RouterConfig",
               fault_tolerance: Optional[FaultTolerance] = None) -> "EngineFleet":
        """Start the router (``router.enabled``) and one engine per entry of ``specs`` (its specs per
        node) on the plan's engine slots of placement group ``pg``, all at once, without waiting for
        them: the caller does meanwhile what needs no engine, then ``wait_up`` (or ``kill``)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from slime_hydra.plan.resources import ENGINE_SHARE
        from slime_hydra.rollout.engine import EngineActor, engine_log_path

        share = {"num_gpus": ENGINE_SHARE, "num_cpus": 0} if plan.device == "cuda" else {"num_cpus": ENGINE_SHARE}
        env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if plan.device == "cuda" else {}
        actor = ray.remote(EngineActor)

        def new_actors(rank: int) -> List[Any]:
            """Engine ``rank``'s actors: one per node it spans, on that node's first bundle; node 0 serves HTTP."""
            slot, node_specs = plan.engines[rank], specs[rank]
            node_bundles = [b for i, b in enumerate(slot.bundles) if i % plan.gpus_per_node == 0]
            return [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=b),
                        runtime_env={"env_vars": env}, **share).remote(spec, slot.rank, log_dir, startup_timeout_s)
                    for b, spec in zip(node_bundles, node_specs)]

        fleet = cls([], fault_tolerance=fault_tolerance)
        fleet.new_actors = new_actors
        fleet._kind = specs[0][0].engine if specs else "no"
        try:
            if router.enabled:
                fleet.launch_router(router, os.path.join(log_dir, "router.log"))
            for slot, node_specs in zip(plan.engines, specs):
                fleet.engines.append(EngineHandle(slot.rank, url="", gpus=node_specs[0].gpus,
                                                  actors=new_actors(slot.rank),
                                                  logs=[engine_log_path(log_dir, slot.rank, s) for s in node_specs]))
            for e in fleet.engines:
                join_nodes(e.actors)
            fleet._started = time.perf_counter()
            fleet._starting = [[a.start.remote() for a in e.actors] for e in fleet.engines]
        except BaseException:
            fleet.kill()
            raise
        return fleet

    def wait_up(self) -> "EngineFleet":
        """After ``launch``: wait until every engine serves (an engine that fails raises with its log's
        tail) and the router answers, and register the engines with it. On failure, ``kill``."""
        import ray

        try:
            for e, refs in zip(self.engines, self._starting):
                try:
                    while not ray.wait(list(refs), num_returns=len(refs), timeout=STARTUP_REPORT_S)[0]:
                        self._report_startup(e)
                    e.url = ray.get(refs)[0]
                    e.first_gpu = ray.get(e.actors[0].first_gpu.remote())
                except Exception as err:  # noqa: BLE001 - with fault tolerance, restarted within the budget
                    if self.ft is None:
                        raise
                    self._restart_at_startup(e, err)
                e.startup = ray.get(e.actors[0].startup_report.remote())
            self._starting = []
            log.info("%d %s engine(s) up in %.1fs: %s", len(self.engines), self._kind,
                     time.perf_counter() - self._started, self.urls)
            if self.router is not None:
                try:
                    self.router.wait_ready()  # it started with the engines: up by now, as a rule
                    self._register()
                except Exception:
                    if self.ft is None or self.router.proc.poll() is None:
                        raise
                    self._restart_router()  # it died while starting: a new one, the engines registered
        except BaseException:
            self.kill()
            raise
        return self

    def _restart_at_startup(self, e: EngineHandle, err: Exception) -> None:
        """Fault tolerance: an engine that died while it started is started again (it runs the initial
        weights, as the others do, so it serves at once); each try counts against the restart budget."""
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

    def _report_startup(self, e: "EngineHandle") -> None:
        """While an engine starts (SGLang: loading weights, capturing CUDA graphs, a minute or more): what
        it is doing, from the last line of its log, with the seconds since the launch."""
        last = next((line.strip() for line in reversed(tail(e.logs[0], 5).splitlines()) if line.strip()), "")
        log.info("waiting for %s engine %d (%.0fs): %s", self._kind, e.rank, time.perf_counter() - self._started,
                 last[-160:] or "starting")

    def kill(self) -> None:
        """After a failed start: the router stops, the engine actors (some may still be starting: they
        would answer ``stop`` only then) are killed at once, and their servers die with them."""
        import ray

        if self.router is not None:
            self.router.stop()
        for a in (a for e in self.engines for a in e.actors):
            ray.kill(a)

    def start_router(self, cfg: "RouterConfig", log_path: str) -> None:
        """sglang-router for engines that are up already, with every engine registered."""
        self.launch_router(cfg, log_path)
        self.router.wait_ready()
        self._register()

    def launch_router(self, cfg: "RouterConfig", log_path: str) -> None:
        """sglang-router, a child of this process (so on this node), coming up in the background."""
        from slime_hydra.rollout.router import Router
        from slime_hydra.utils.proc import node_ip

        if self.ft is not None:
            # the requests of a failed engine come back to the client, which re-queues (and counts)
            # them once an engine serves; the router's own retries would resend them unseen, or
            # to the same dead worker while it is still registered
            cfg = replace(cfg, args={"disable_retries": True, **cfg.args})
        self.router = Router(cfg, node_ip(), log_path, wait=False)
        self._router_cfg, self._router_log = cfg, log_path

    def _register(self) -> None:
        t0 = time.perf_counter()
        for url in self.urls:
            self.router.add_worker(url)
        log.info("%d engine(s) registered with the router in %.1fs", len(self.urls), time.perf_counter() - t0)

    # ------------------------------------------------------------------------------- addresses
    @property
    def urls(self) -> List[str]:
        """The engines that take requests."""
        return [e.url for e in self.engines if e.state == SERVING]

    @property
    def base_url(self) -> str:
        """Where /generate goes: the router, or the one engine of a run without one (validation
        allows that only with exactly one engine)."""
        return self.router.url if self.router is not None else self.engines[0].url

    async def engine_url(self) -> str:
        """A serving engine for a request the router cannot forward (SGLang's batched /generate: one
        request per group, see ``rollout.client``), round robin; waits while none serves (fault
        tolerance is restarting them). Restarted engines serve only once they run the current weights;
        if those are newer than the running rollout's (an async run whose engines all failed), the
        rollout starts again (``WeightsChanged``), as :meth:`requeue` decides for a re-queued request."""
        while not self.urls:
            if self.fatal is not None:
                raise self.fatal
            if self._serving.is_set():  # nothing is restarting either
                raise EngineError("no engine serves")
            await self._serving.wait()
        self._check_weights()
        urls = self.urls
        self._turn += 1
        return urls[self._turn % len(urls)]

    def endpoints(self) -> List[Dict[str, Any]]:
        """Where the trainer pushes weights: each running engine's URL, GPU count and first GPU (serving,
        or restarted and waiting for the weights)."""
        return [{"url": e.url, "gpus": e.gpus, "first_gpu": e.first_gpu} for e in self.engines
                if e.state in (SERVING, AWAITING_WEIGHTS)]

    # ---------------------------------------------------------------------------------- health
    def dead_engines(self) -> List[str]:
        """Why each dead engine died (an actor too busy to answer within ENGINE_POLL_S counts as alive)."""
        return [reason for _, reason in self._exited()]

    def _exited(self) -> List[Tuple[EngineHandle, str]]:
        """The running engines (serving, or restarted and waiting for weights) whose server process or
        Ray actor has ended, with how."""
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
        """Await ``coro`` while watching the engines: if one dies, fail within ``ENGINE_POLL_S``
        with its log's tail (its requests would otherwise retry for a minute, or hang); with fault
        tolerance, take it out and restart it instead (and check health every interval)."""
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
        """Fault tolerance: process exits every ENGINE_POLL_S, /health_generate every interval."""
        next_probe = time.monotonic() + self.ft.health_check_interval_s
        while True:
            await asyncio.sleep(ENGINE_POLL_S)
            probe = time.monotonic() >= next_probe
            await self.check(probe)
            if probe:
                next_probe = time.monotonic() + self.ft.health_check_interval_s

    async def check(self, probe: bool = False, since: float = -math.inf) -> None:
        """Take out (and restart) every serving engine that has exited, or with ``probe`` that fails
        its health check. Concurrent callers share one check, if it started at ``since`` (monotonic)
        or later. Raises once the restart budget is spent."""
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
        """Count a restart of ``e`` against rollout.max_engine_restarts_per_hour; past it, fail the run."""
        now = time.monotonic()
        e.restarts = [t for t in e.restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(e.restarts) > self.ft.max_restarts_per_hour:
            self.fatal = EngineError(f"engine {e.rank} failed {len(e.restarts)} times within an hour, more than "
                                     f"rollout.max_engine_restarts_per_hour={self.ft.max_restarts_per_hour}; "
                                     f"the last time:\n{reason}")
            self._serving.set()  # wake the requests waiting for an engine: they raise the error
            raise self.fatal

    def _restart_router(self) -> None:
        """Fault tolerance: the router died. A new one on the same port (the clients keep its URL),
        with the serving engines registered again; the requests that were on the old one fail and are
        re-queued (``requeue`` counts its death as a failure)."""
        from slime_hydra.rollout.router import Router

        self._taking_out += 1
        try:
            while True:  # until one runs (a router that dies while it starts is started again) or the budget is spent
                old = self.router
                reason = (f"sglang-router ({old.url}) exited with code {old.proc.returncode}; last lines of "
                          f"{old.log_path}:\n{tail(old.log_path)}")
                now = time.monotonic()
                self._router_restarts = [t for t in self._router_restarts if now - t < RESTART_WINDOW_S] + [now]
                if len(self._router_restarts) > self.ft.max_restarts_per_hour:
                    self.fatal = EngineError(f"the router failed {len(self._router_restarts)} times within an hour, "
                                             "more than rollout.max_engine_restarts_per_hour="
                                             f"{self.ft.max_restarts_per_hour}; the last time:\n{reason}")
                    self._serving.set()
                    raise self.fatal
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
        """Start ``e`` again (a failed start counts against the budget too) until it runs or the budget is spent."""
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

    # ------------------------------------------------------------------- restarted engines, requeue
    def awaiting_weights(self) -> bool:
        """Some restarted engine waits for the current weights (the driver then pushes them)."""
        return any(e.state == AWAITING_WEIGHTS for e in self.engines)

    def weights_pushed(self, version: int) -> List[int]:
        """After a weight push of ``version``: the restarted engines that now run it join the router
        and take requests. Returns their ranks."""
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
        """``weights_pushed`` on the fleet's event loop (where the requests wait for an engine); a router that
        died meanwhile is restarted first (chaos: the engines could not rejoin a dead router)."""
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
        """The generate client's question about a request sent at ``sent_at`` (monotonic) that
        failed: was it on an engine that failed since, or is no engine serving? Then wait until
        one serves, and the client sends it again (True). False: a plain failure, retried as usual."""
        if self.ft is None:
            return False
        for pause in EXIT_CHECK_PAUSES_S:
            if self._failed_since(sent_at):
                break
            # an engine killed a moment ago: its requests fail before the monitor looks, or while it
            # looks (a group's request is the only one on its engine: no later request sees the death),
            # and its connections close a moment before its process counts as exited
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
        """Raise WeightsChanged if the serving engines run newer weights than the running rollout asked for
        (every engine failed and came back after a push): the rollout is generated again."""
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

    # ------------------------------------------------------------------------ requests, memory
    async def abort(self) -> None:
        """Abort every request in flight on every engine (once: see ``GroupSampler.abort_and_drain``).
        With fault tolerance, an engine that cannot answer is the monitor's business, not the abort's."""
        results = await asyncio.gather(*(asyncio.to_thread(control, u, "/abort_request", {"abort_all": True})
                                         for u in self.urls), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and self.ft is None:
            raise errors[0]

    def _running_urls(self) -> List[str]:
        return [e.url for e in self.engines if e.state in (SERVING, AWAITING_WEIGHTS)]

    def _each(self, *calls: Tuple[str, Optional[Dict[str, Any]]]) -> None:
        """Control calls to every running engine. With fault tolerance an engine that cannot answer is
        left to the next check (before the weight push), which restarts it; without, the error stops the run."""
        for u in self._running_urls():
            try:
                for path, payload in calls:
                    control(u, path, payload)
            except EngineError as err:
                if self.ft is None:
                    raise
                log.warning("%s; the engine is checked (and restarted if it died) before the weight push", err)

    def offload(self) -> None:
        """Release the engines' memory (after flushing their cache) while the trainer trains. Each of these
        memory moves is a no-op in the state it leads to (a run healed after a trainer died asks again)."""
        with self._lock:
            if self.memory == "released":
                return
            self._each(("/flush_cache", None), ("/release_memory_occupation", {"tags": None}))
            self.memory = "released"

    def onload_weights(self) -> None:
        with self._lock:
            if self.memory != "released":
                return
            self._each(("/resume_memory_occupation", {"tags": ["weights"]}))
            self.memory = "weights"

    def onload_kv(self) -> None:
        with self._lock:
            if self.memory != "weights":
                return
            self._each(("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}))
            self.memory = "awake"

    def shutdown(self) -> None:
        import ray

        for task in self._restarting.values():  # on the manager's event loop, not this thread's
            task.get_loop().call_soon_threadsafe(task.cancel)
        if self.router is not None:
            for u in self.urls:
                try:
                    self.router.remove_worker(u)
                except Exception:  # noqa: BLE001 - shutting down anyway
                    pass
            self.router.stop()
        actors = [a for e in self.engines for a in e.actors]
        if actors:
            try:
                ray.get([a.stop.remote() for a in actors])
            except ray.exceptions.RayActorError:
                pass


def join_nodes(actors: List[Any]) -> None:
    """An engine that spans nodes: node 0 reserves the address where the other nodes join it."""
    import ray

    if len(actors) > 1:
        addr = ray.get(actors[0].reserve_dist_init_addr.remote())
        ray.get([a.set_dist_init_addr.remote(addr) for a in actors])
