"""The engine fleet: the rollout engines of a run and everything done to all of them at once: starting them
and sglang-router through Ray actors (``launch``, then ``wait_up``), registering them with the router, aborts,
memory release and resume (colocated runs), and their URLs for the weight push (``endpoints``). Health and
restarts are :class:`slime_hydra.rollout.health.FleetHealth`'s part. ``EngineFleet([EngineHandle(0, url)])``
wraps engines started elsewhere (no Ray, no actors to watch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from slime_hydra.rollout.engines import ServerSpec
from slime_hydra.rollout.engines.actor import join_nodes
from slime_hydra.rollout.health import AWAITING_WEIGHTS, SERVING, EngineHandle, FaultTolerance, FleetHealth
from slime_hydra.utils.http import EngineError, control
from slime_hydra.utils.proc import tail

if TYPE_CHECKING:
    from slime_hydra.config.schema import RouterConfig, RunConfig
    from slime_hydra.plan.resources import ResourcePlan
    from slime_hydra.rollout.router import Router

log = logging.getLogger(__name__)

STARTUP_REPORT_S = 10.0  # while engines start, what each is doing is logged this often


def engine_specs(cfg: "RunConfig", plan: "ResourcePlan", model_path: str) -> List[List[ServerSpec]]:
    """Each engine's server spec, one per node it spans (SGLang's nnodes / node_rank)."""
    p = cfg.parallelism
    nnodes = max(1, p.gpus_per_engine // p.gpus_per_node)
    base = ServerSpec(engine=cfg.rollout.engine, model_path=model_path, tokenizer_path=model_path,
                      dtype=cfg.model.dtype, device=plan.device, gpus=p.gpus_per_engine, seed=cfg.rollout.seed,
                      trust_remote_code=cfg.model.trust_remote_code, memory_saver=bool(p.offload_rollout),
                      max_batch=cfg.rollout.embedded_max_batch, decode_batch=plan.engine_batch,
                      kv_tokens=plan.engine_kv_cap, server_args=dict(cfg.rollout.server_args),
                      fast_start=cfg.rollout.sglang_fast_start,
                      num_threads=p.cpu_threads if plan.device == "cpu" else None, nnodes=nnodes)
    return [[replace(base, seed=cfg.rollout.seed + slot.rank, node_rank=n) for n in range(nnodes)]
            for slot in plan.engines]


class EngineFleet(FleetHealth):
    def __init__(self, engines: List[EngineHandle], router: Optional["Router"] = None,
                 fault_tolerance: Optional[FaultTolerance] = None):
        super().__init__(fault_tolerance)
        self.engines = engines
        self.router = router
        # engine rank -> new Ray actors for it on its bundles (set by launch(); restarts of dead actors)
        self.new_actors: Optional[Callable[[int], List[Any]]] = None
        self._starting: List[List[Any]] = []  # launch() -> wait_up(): each engine's start() calls
        self._started = 0.0
        self._kind = "no"
        self.memory = "awake"  # awake | released | weights (colocated runs: what the engines hold)
        self._lock = threading.Lock()  # memory state vs a restart that finishes meanwhile
        self._turn = 0  # round robin of engine_url()
        self._router_cfg: Optional["RouterConfig"] = None  # launch_router's, for a restart
        self._router_log = ""

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
        """Start the router (``router.enabled``) and one engine per entry of ``specs`` (its specs per node) on the
        plan's engine slots of placement group ``pg``, without waiting: then ``wait_up`` (or ``kill``)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from slime_hydra.plan.resources import ENGINE_SHARE
        from slime_hydra.rollout.engines.actor import EngineActor, engine_log_path

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
            if router.enabled and specs:  # no engines (algo=sft without eval sets): nothing to route
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
        """After ``launch``: wait until every engine serves (else raise with its log's tail) and the router
        answers, and register the engines with it. On failure, ``kill``."""
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

    def _report_startup(self, e: "EngineHandle") -> None:
        """What a starting engine is doing, from the last line of its log."""
        last = next((line.strip() for line in reversed(tail(e.logs[0], 5).splitlines()) if line.strip()), "")
        log.info("waiting for %s engine %d (%.0fs): %s", self._kind, e.rank, time.perf_counter() - self._started,
                 last[-160:] or "starting")

    def kill(self) -> None:
        """After a failed start: stop the router, kill the engine actors at once (their servers die with them)."""
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
            # the client re-queues a failed engine's requests; the router's retries would resend them unseen
            cfg = replace(cfg, args={"disable_retries": True, **cfg.args})
        self.router = Router(cfg, node_ip(), log_path, wait=False)
        self._router_cfg, self._router_log = cfg, log_path

    def _register(self) -> None:
        t0 = time.perf_counter()
        for url in self.urls:
            self.router.add_worker(url)
        log.info("%d engine(s) registered with the router in %.1fs", len(self.urls), time.perf_counter() - t0)

    @property
    def urls(self) -> List[str]:
        """The engines that take requests."""
        return [e.url for e in self.engines if e.state == SERVING]

    @property
    def base_url(self) -> str:
        """Where /generate goes: the router, or the one engine of a run without one ("": no engines)."""
        if self.router is not None:
            return self.router.url
        return self.engines[0].url if self.engines else ""

    async def engine_url(self) -> str:
        """A serving engine, round robin, for a request the router cannot forward (SGLang's batched /generate);
        waits while none serves; raises ``WeightsChanged`` as :meth:`requeue` does."""
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
        """Where the trainer pushes weights: each running engine's URL, GPU count and first GPU."""
        return [{"url": e.url, "gpus": e.gpus, "first_gpu": e.first_gpu} for e in self.engines
                if e.state in (SERVING, AWAITING_WEIGHTS)]

    async def abort(self) -> None:
        """Abort every request in flight on every engine (with fault tolerance, an engine that cannot answer is
        the monitor's business)."""
        results = await asyncio.gather(*(asyncio.to_thread(control, u, "/abort_request", {"abort_all": True})
                                         for u in self.urls), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and self.ft is None:
            raise errors[0]

    def _each(self, *calls: Tuple[str, Optional[Dict[str, Any]]]) -> None:
        """Control calls to every running engine; with fault tolerance, an engine that cannot answer is left to
        the next check."""
        for u in (e["url"] for e in self.endpoints()):
            try:
                for path, payload in calls:
                    control(u, path, payload)
            except EngineError as err:
                if self.ft is None:
                    raise
                log.warning("%s; the engine is checked (and restarted if it died) before the weight push", err)

    def _move_memory(self, since: Tuple[str, ...], to: str, *calls: Tuple[str, Optional[Dict[str, Any]]]) -> None:
        """From a memory state of ``since`` to ``to``; a no-op in any other state (a healed run asks again)."""
        with self._lock:
            if self.memory in since:
                self._each(*calls)
                self.memory = to

    def offload(self) -> None:
        """Release the engines' memory (after flushing their cache) while the trainer trains."""
        self._move_memory(("awake", "weights"), "released", ("/flush_cache", None),
                          ("/release_memory_occupation", {"tags": None}))

    def onload_weights(self) -> None:
        self._move_memory(("released",), "weights", ("/resume_memory_occupation", {"tags": ["weights"]}))

    def onload_kv(self) -> None:
        self._move_memory(("weights",), "awake", ("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}))

    def shutdown(self) -> None:
        import ray

        for task in self._restarting.values():  # on the manager's event loop, not this thread's
            task.get_loop().call_soon_threadsafe(task.cancel)
        if self.router is not None:
            for u in self.urls:
                with contextlib.suppress(Exception):  # shutting down anyway
                    self.router.remove_worker(u)
            self.router.stop()
        actors = [a for e in self.engines for a in e.actors]
        if actors:
            with contextlib.suppress(ray.exceptions.RayActorError):
                ray.get([a.stop.remote() for a in actors])
