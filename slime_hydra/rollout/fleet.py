"""The engine fleet: the rollout engines of a run and everything done to all of them at once.

It starts the engines through their Ray actors (``EngineFleet.start``), registers them with
sglang-router, watches their health (``dead_engines``, ``watched``), aborts their requests, releases
and resumes their memory (colocated runs), and names their URLs for the trainer's weight push
(``endpoints``). ``engines`` is the one list of live engines and ``dead_engines`` the one health
check, so restarting a dead engine belongs here too.

A fleet can also be built from engines that something else started (``EngineFleet([EngineHandle(0, url)])``,
no Ray): then it has no actors to watch, and the HTTP calls work as in a run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from slime_hydra.utils.http import EngineError, control
from slime_hydra.rollout.engines import ServerSpec
from slime_hydra.utils.proc import tail

if TYPE_CHECKING:
    from slime_hydra.config.schema import RouterConfig, RunConfig
    from slime_hydra.plan.resources import ResourcePlan
    from slime_hydra.rollout.router import Router

log = logging.getLogger(__name__)

ENGINE_POLL_S = 1.0  # how often rollouts and evals check that every engine still runs


def engine_specs(cfg: "RunConfig", plan: "ResourcePlan", model_path: str) -> List[List[ServerSpec]]:
    """Each engine's server spec, one per node it spans (SGLang's nnodes / node_rank)."""
    p = cfg.parallelism
    nnodes = max(1, p.gpus_per_engine // p.gpus_per_node)
    base = ServerSpec(engine=cfg.rollout.engine, model_path=model_path, tokenizer_path=model_path,
                      dtype=cfg.model.dtype, device=plan.device, gpus=p.gpus_per_engine, seed=cfg.rollout.seed,
                      trust_remote_code=cfg.model.trust_remote_code, memory_saver=bool(p.offload_rollout),
                      max_batch=cfg.rollout.embedded_max_batch, server_args=dict(cfg.rollout.server_args),
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
    actors: List[Any] = field(default_factory=list)
    logs: List[str] = field(default_factory=list)


class EngineFleet:
    def __init__(self, engines: List[EngineHandle], router: Optional["Router"] = None):
        self.engines = engines
        self.router = router

    @classmethod
    def start(cls, specs: List[List[ServerSpec]], plan: "ResourcePlan", pg: Any, log_dir: str,
              startup_timeout_s: float, router: "RouterConfig") -> "EngineFleet":
        """Start one engine per entry of ``specs`` (its specs per node) on the plan's engine slots of
        placement group ``pg``, all at once, then the router (``router.enabled``) with every engine."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from slime_hydra.plan.resources import ENGINE_SHARE
        from slime_hydra.rollout.engine import EngineActor, engine_log_path

        share = {"num_gpus": ENGINE_SHARE, "num_cpus": 0} if plan.device == "cuda" else {"num_cpus": ENGINE_SHARE}
        env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if plan.device == "cuda" else {}
        actor = ray.remote(EngineActor)
        engines: List[EngineHandle] = []
        for slot, node_specs in zip(plan.engines, specs):
            # one actor per node the engine spans, on that node's first bundle; node 0 serves HTTP
            node_bundles = [b for i, b in enumerate(slot.bundles) if i % plan.gpus_per_node == 0]
            actors = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                          placement_group=pg, placement_group_bundle_index=b),
                          runtime_env={"env_vars": env}, **share).remote(spec, slot.rank, log_dir, startup_timeout_s)
                      for b, spec in zip(node_bundles, node_specs)]
            if len(actors) > 1:
                addr = ray.get(actors[0].reserve_dist_init_addr.remote())
                ray.get([a.set_dist_init_addr.remote(addr) for a in actors])
            engines.append(EngineHandle(slot.rank, url="", gpus=node_specs[0].gpus, actors=actors,
                                  logs=[engine_log_path(log_dir, slot.rank, spec) for spec in node_specs]))
        t0 = time.perf_counter()
        starts = [[a.start.remote() for a in e.actors] for e in engines]  # all engines start at once
        for e, refs in zip(engines, starts):
            e.url = ray.get(refs)[0]
        fleet = cls(engines)
        kind = specs[0][0].engine if specs else "no"
        log.info("%d %s engine(s) up in %.1fs: %s", len(engines), kind, time.perf_counter() - t0, fleet.urls)
        if router.enabled:
            fleet.start_router(router, os.path.join(log_dir, "router.log"))
        return fleet

    def start_router(self, cfg: "RouterConfig", log_path: str) -> None:
        """sglang-router, a child of this process (so on this node), with every engine registered."""
        from slime_hydra.rollout.router import Router
        from slime_hydra.utils.proc import node_ip

        self.router = Router(cfg, node_ip(), log_path)
        for url in self.urls:
            self.router.add_worker(url)

    # ------------------------------------------------------------------------------- addresses
    @property
    def urls(self) -> List[str]:
        return [e.url for e in self.engines]

    @property
    def base_url(self) -> str:
        """Where /generate goes: the router, or the one engine of a run without one (validation
        allows that only with exactly one engine)."""
        return self.router.url if self.router is not None else self.urls[0]

    def endpoints(self) -> List[Dict[str, Any]]:
        """Where the trainer pushes weights: each engine's URL and GPU count."""
        return [{"url": e.url, "gpus": e.gpus} for e in self.engines]

    # ---------------------------------------------------------------------------------- health
    def dead_engines(self) -> List[str]:
        """Why each dead engine died (an actor too busy to answer within ENGINE_POLL_S counts as alive)."""
        import ray

        watched = [(a, log_path) for e in self.engines for a, log_path in zip(e.actors, e.logs)]
        refs = [a.failure.remote() for a, _ in watched]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ENGINE_POLL_S)
        out = []
        for ref, (_, log_path) in zip(refs, watched):
            if ref not in ready:
                continue
            try:
                failure = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:  # unreachable for now, not dead
                continue
            except ray.exceptions.RayActorError as e:
                name = os.path.basename(log_path).removesuffix(".log")
                failure = f"{name}: its actor died ({e!r}); last lines of {log_path}:\n{tail(log_path)}"
            if failure:
                out.append(failure)
        return out

    async def watched(self, coro):
        """Await ``coro`` while watching the engines: if one dies, fail within ``ENGINE_POLL_S``
        with its log's tail (its requests would otherwise retry for a minute, or hang)."""
        work = asyncio.ensure_future(coro)
        if not any(e.actors for e in self.engines):
            return await work
        watchdog = asyncio.ensure_future(self._watch())
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

    # ------------------------------------------------------------------------ requests, memory
    async def abort(self) -> None:
        """Abort every request in flight on every engine (once: see ``GroupSampler.abort_and_drain``)."""
        await asyncio.gather(*(asyncio.to_thread(control, u, "/abort_request", {"abort_all": True})
                               for u in self.urls))

    def offload(self) -> None:
        """Release the engines' memory (after flushing their cache) while the trainer trains."""
        for u in self.urls:
            control(u, "/flush_cache")
            control(u, "/release_memory_occupation", {"tags": None})

    def onload_weights(self) -> None:
        for u in self.urls:
            control(u, "/resume_memory_occupation", {"tags": ["weights"]})

    def onload_kv(self) -> None:
        for u in self.urls:
            control(u, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})

    def shutdown(self) -> None:
        import ray

        if self.router is not None:
            for u in self.urls:
                try:
                    self.router.remove_worker(u)
                except Exception:  # noqa: BLE001 - shutting down anyway
                    pass
            self.router.stop()
        actors = [a for e in self.engines for a in e.actors]
        if actors:
            ray.get([a.stop.remote() for a in actors])
