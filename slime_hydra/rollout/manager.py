"""The rollout manager: a Ray actor (no GPU) that holds the rollout side's parts and answers the
driver. The parts are plain objects, each usable without Ray:

- the engine fleet (``fleet.py``): engines, router, health, aborts, memory, weight-update URLs;
- the rollout function (``rollout_fn.py``, ``rollout.rollout_function``) with its context: the
  data source, the generate function and rewards (``sampling.py``), the dynamic filter;
- the conversion to training data and its split across data-parallel ranks (``train_data.py``);
- evaluation (``evaluate.py``) and the data position for checkpoints (``data_state.py``).

Its async work (hundreds of concurrent /generate calls) runs on one event loop in a background
thread; the actor's methods are plain synchronous calls for the driver.
"""

from __future__ import annotations

import asyncio
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
from slime_hydra.rollout.rollout_fn import build_rollout_context, check_rollout_output, load_rollout_function
from slime_hydra.rollout.sampling import agent_metrics
from slime_hydra.rollout.train_data import split_by_rank, train_data

if TYPE_CHECKING:
    from slime_hydra.config.schema import RunConfig
    from slime_hydra.plan.resources import ResourcePlan

log = logging.getLogger(__name__)

__all__ = ["RolloutManager", "engine_specs"]


class RolloutManager:
    def __init__(self, cfg: "RunConfig", plan: "ResourcePlan", pg, model_path: str):
        from slime_hydra.data.tokenizer import load_tokenizer
        from slime_hydra.logging.setup import setup_actor_logging

        setup_actor_logging(cfg, "rollout_manager")
        self.cfg, self.data_parallel = cfg, plan.data_parallel
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True).start()
        r = cfg.rollout
        log_dir = os.path.join(cfg.output_dir, "logs")
        self.fleet = EngineFleet.start(engine_specs(cfg, plan, model_path), plan, pg, log_dir, r.startup_timeout_s,
                                       r.router)
        # no reply within the router's request timeout: the engine hangs (a dead one is caught sooner)
        self.client = self._run(_make_client(self.fleet.base_url, r.concurrency * len(self.fleet.engines),
                                             r.router.request_timeout_secs))
        tokenizer = load_tokenizer(cfg.model.tokenizer or model_path, cfg.model.trust_remote_code)
        self.ctx = build_rollout_context(cfg, tokenizer, self.client, self.fleet.abort)
        self.rollout_fn = load_rollout_function(r.rollout_function)
        eval_sets = load_eval_sets(cfg.eval.datasets, cfg.data, tokenizer, r.max_prompt_len)
        self.evaluator = Evaluator(eval_sets, self.ctx.sampler, r, cfg.reward.key, cfg.logging.log_samples)
        self.data_state = DataState(self.ctx.source)
        log.info("data: %d training prompts; eval sets: %s", len(self.ctx.source),
                 {k: len(v.prompts) for k, v in eval_sets.items()})

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # ------------------------------------------------------------------------------- info
    def endpoints(self) -> List[Dict[str, Any]]:
        """Where the trainer pushes weights: each engine's URL and GPU count."""
        return self.fleet.endpoints()

    def num_train_prompts(self) -> int:
        return len(self.ctx.source)

    # ------------------------------------------------------------------------- generation
    def generate(self, rollout_id: int, weight_version: int) -> Tuple[List[Any], Dict[str, float]]:
        """One rollout -> (one object ref of training data per data-parallel rank, metrics)."""
        from slime_hydra.rewards.hub import spec_name

        cfg, r = self.cfg, self.cfg.rollout
        t0 = time.perf_counter()
        self.data_state.rollout_starts(rollout_id)  # for a checkpoint taken meanwhile
        out = self._run(self.fleet.watched(self.rollout_fn(self.ctx, rollout_id, str(weight_version))))
        where = "rollout.rollout_function" + (f" {spec_name(r.rollout_function)!r}" if r.rollout_function else "")
        groups, rollout_metrics = check_rollout_output(out, r.batch_size, r.n_samples_per_prompt, where)
        samples = [s for g in groups for s in g]
        data, metrics = train_data(samples, cfg.algo, r.n_samples_per_prompt, cfg.reward.key)
        metrics.update(drain_counters())  # rollout/<failure>_count: verifier errors, FAILED samples
        metrics.update(rollout_metrics)
        metrics.update(agent_metrics(samples, "rollout/"))
        metrics["perf/rollout_time"] = time.perf_counter() - t0
        parts = split_by_rank(data, self.data_parallel, cfg.trainer.global_batch_size)
        return [ray.put(part) for part in parts], metrics

    def eval(self) -> Dict[str, Any]:
        out = self._run(self.fleet.watched(self.evaluator.run()))
        out.update({k.replace("rollout/", "eval/", 1): v for k, v in drain_counters().items()})
        return out

    # ---------------------------------------------------------------- colocated memory, state
    def offload(self) -> None:
        """Release the engines' memory (after flushing their cache) while the trainer trains."""
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
        try:
            self._run(self.client.aclose())
        except Exception:  # noqa: BLE001
            pass


async def _make_client(base: str, concurrency: int, read_timeout: float) -> GenerateClient:
    """On the manager's loop: the client's aiohttp session belongs to the loop it was made on."""
    return GenerateClient(base, concurrency, read_timeout=read_timeout)
