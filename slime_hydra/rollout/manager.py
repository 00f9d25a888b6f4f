"""The rollout manager: a Ray actor (no GPU) that holds the rollout side's parts (the engine fleet, the rollout
function and its context, training data, evaluation, the data position; each usable without Ray) and answers
the driver. Its async work runs on one event loop in a background thread; the methods of concurrency group
``FLEET_GROUP`` answer while a rollout runs (fault tolerance: restarted engines waiting for weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import ray

from slime_hydra.rewards.counters import drain as drain_counters
from slime_hydra.rollout.client import GenerateClient
from slime_hydra.rollout.data_state import DataState
from slime_hydra.rollout.evaluate import Evaluator, load_eval_sets
from slime_hydra.rollout.fleet import EngineFleet, engine_specs
from slime_hydra.rollout.health import FaultTolerance, WeightsChanged
from slime_hydra.rollout.rollout_fn import build_rollout_context, check_rollout_output, load_rollout_function
from slime_hydra.rollout.sampling import agent_metrics
from slime_hydra.rollout.sft import sft_rollout
from slime_hydra.rollout.train_data import split_by_rank, train_data

if TYPE_CHECKING:
    from slime_hydra.config.schema import RunConfig
    from slime_hydra.plan.resources import ResourcePlan

log = logging.getLogger(__name__)

FLEET_GROUP = "fleet"  # ray.remote(concurrency_groups={FLEET_GROUP: 1}) when the actor is created


class RolloutManager:
    def __init__(self, cfg: "RunConfig", plan: "ResourcePlan", pg, model_path: str):
        from slime_hydra.logging.setup import setup_actor_logging

        setup_actor_logging(cfg, "rollout_manager")
        self.cfg, self.data_parallel = cfg, plan.data_parallel
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True).start()
        r = cfg.rollout
        t0 = time.perf_counter()
        self.startup: Dict[str, Any] = {"created": time.time()}  # time.time() stamps (startup_report)
        # the engines and the router start in the background while the data loads
        self.fleet = EngineFleet.launch(engine_specs(cfg, plan, model_path), plan, pg,
                                        os.path.join(cfg.output_dir, "logs"), r.startup_timeout_s, r.router,
                                        FaultTolerance.from_config(r))
        self.startup["launched"] = time.time()
        try:
            self._load(model_path)
        except BaseException:
            self.fleet.kill()
            raise
        self.startup["data_s"] = time.time() - self.startup["launched"]
        self.fleet.wait_up()  # kills the engines and the router if one fails
        self.client.base_url = self.fleet.base_url  # without a router: the engine's, known once it is up
        self.startup["up"] = time.time()
        log.info("rollout side up in %.1fs", time.perf_counter() - t0)

    def _load(self, model_path: str) -> None:
        """All that needs no running engine: tokenizer, data, eval sets, rollout function, client."""
        t0 = time.perf_counter()
        from slime_hydra.data.tokenizer import load_tokenizer

        cfg, r = self.cfg, self.cfg.rollout
        # no reply within the router's request timeout: the engine hangs (a dead one is caught sooner)
        self.client = self._run(_make_client(self.fleet.base_url, r.concurrency * len(self.fleet.engines),
                                             r.router.request_timeout_secs,
                                             self.fleet.requeue if r.fault_tolerance else None,
                                             self.fleet.engine_url))
        tokenizer = load_tokenizer(cfg.model.tokenizer or model_path, cfg.model.trust_remote_code)
        self.ctx = build_rollout_context(cfg, tokenizer, self.client, self.fleet.abort)
        if r.rollout_function is None and cfg.algo.advantage_estimator == "sft":  # the labels as responses
            self.rollout_fn = sft_rollout
        else:
            self.rollout_fn = load_rollout_function(r.rollout_function)
        eval_sets = load_eval_sets(cfg.eval.datasets, cfg.data, tokenizer, r.max_prompt_len)
        self.evaluator = Evaluator(eval_sets, self.ctx.sampler, r, cfg.reward.key, cfg.logging.log_samples)
        self.data_state = DataState(self.ctx.source)
        log.info("data ready in %.1fs, while the engines start: %d training prompts; eval sets: %s",
                 time.perf_counter() - t0, len(self.ctx.source), {k: len(v.prompts) for k, v in eval_sets.items()})

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def startup_report(self) -> Dict[str, Any]:
        """How this rollout side started (``time.time()`` stamps: created, launched, up; ``data_s`` after the
        launch) and each engine's own report (``EngineActor.startup_report``)."""
        return {**self.startup, "engines": [e.startup for e in self.fleet.engines]}

    def endpoints(self) -> List[Dict[str, Any]]:
        return self.fleet.endpoints()

    @ray.method(concurrency_group=FLEET_GROUP)
    def awaiting_weights(self) -> Optional[List[Dict[str, Any]]]:
        """None, or (an engine restarted and waits for the current weights) the endpoints to push to."""
        return self.fleet.endpoints() if self.fleet.awaiting_weights() else None

    @ray.method(concurrency_group=FLEET_GROUP)
    def stalled(self) -> bool:
        """No engine serves and a restarted one waits for weights (an async run pushes them now)."""
        return self.fleet.stalled()

    @ray.method(concurrency_group=FLEET_GROUP)
    def weight_endpoints(self, probe: bool = False) -> List[Dict[str, Any]]:
        """Before a weight push: the running engines, the dead (with ``probe``, the unhealthy) restarted first."""
        self._run(self.fleet.check(probe))
        return self.fleet.endpoints()

    @ray.method(concurrency_group=FLEET_GROUP)
    def weights_pushed(self, version: int) -> List[int]:
        """The driver pushed ``version``: restarted engines that run it take requests again."""
        return self._run(self.fleet.rejoined(version))

    def num_train_prompts(self) -> int:
        return len(self.ctx.source)

    def generate(self, rollout_id: int, weight_version: int) -> Tuple[List[Any], Dict[str, float]]:
        """One rollout -> (one object ref of training data per data-parallel rank, metrics)."""
        from slime_hydra.rewards.hub import spec_name

        cfg, r = self.cfg, self.cfg.rollout
        t0 = time.perf_counter()
        self.data_state.rollout_starts(rollout_id)  # for a checkpoint taken meanwhile
        start_state = self.data_state.state_dict(rollout_id)
        self.ctx.sampler.ctx.requests = 0
        while True:
            self.fleet.rollout_version = weight_version
            try:
                out = self._run(self.fleet.watched(self.rollout_fn(self.ctx, rollout_id, str(weight_version))))
                break
            except WeightsChanged as e:  # every engine failed; they came back with the trainer's newer weights
                log.warning("rollout %d: %s; generating it again from its start", rollout_id, e)
                self.data_state.load_state_dict(start_state)
                weight_version = e.version
            finally:
                self.fleet.rollout_version = None
        where = "rollout.rollout_function" + (f" {spec_name(r.rollout_function)!r}" if r.rollout_function else "")
        groups, rollout_metrics = check_rollout_output(out, r.batch_size, r.n_samples_per_prompt, where)
        samples = [s for g in groups for s in g]
        data, metrics = train_data(samples, cfg.algo, r.n_samples_per_prompt, cfg.reward.key, r.max_response_len)
        metrics.update(drain_counters())  # rollout/<failure>_count: verifier errors, FAILED samples
        metrics.update(rollout_metrics)
        metrics.update(agent_metrics(samples, "rollout/"))
        metrics.update(staleness_metrics(samples, rollout_id))
        if r.fault_tolerance:
            metrics.update(self.fleet.take_counters())
        metrics["rollout/generate_requests"] = float(self.ctx.sampler.ctx.requests)  # one per group by default
        metrics["perf/rollout_time"] = time.perf_counter() - t0
        parts = split_by_rank(data, self.data_parallel, cfg.trainer.global_batch_size)
        return [ray.put(part) for part in parts], metrics

    def eval(self) -> Dict[str, Any]:
        out = self._run(self.fleet.watched(self.evaluator.run()))
        out.update({k.replace("rollout/", "eval/", 1): v for k, v in drain_counters().items()})
        return out

    def offload(self) -> None:
        self.fleet.offload()

    def onload_weights(self) -> None:
        self.fleet.onload_weights()

    def onload_kv(self) -> None:
        self.fleet.onload_kv()

    def state_dict(self, rollout_id: Optional[int] = None) -> Dict[str, Any]:
        """The data position after rollouts ``< rollout_id`` (``DataState.state_dict``)."""
        return self.data_state.state_dict(rollout_id)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.data_state.load_state_dict(state)

    def shutdown(self) -> None:
        self.fleet.shutdown()
        with contextlib.suppress(Exception):
            self._run(self.client.aclose())


def staleness_metrics(samples: List[Any], trainer_version: int) -> Dict[str, float]:
    """How many training steps each sample's (oldest) weights lag the trainer of version ``trainer_version`` that
    trains on it: 0 in a synchronous run, 1 in an asynchronous one, more with ``update_weights_interval`` > 1."""
    lags = []
    for s in samples:
        versions = [int(v) for v in s.weight_versions if str(v).lstrip("-").isdigit()]
        if versions:
            lags.append(trainer_version - min(versions))
    if not lags:
        return {}
    return {"rollout/staleness_max": float(max(lags)), "rollout/staleness_mean": sum(lags) / len(lags)}


async def _make_client(base: str, concurrency: int, read_timeout: float, requeue=None,
                       engine_url=None) -> GenerateClient:
    """On the manager's loop, which the client's aiohttp session belongs to."""
    return GenerateClient(base, concurrency, read_timeout=read_timeout, requeue=requeue, engine_url=engine_url)
