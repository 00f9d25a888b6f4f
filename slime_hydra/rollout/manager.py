"""The rollout manager (a Ray actor, no GPU): engines and their router, the data source, the
generate and reward functions, reward post-processing, and the split of each rollout across the
trainer's data-parallel ranks.

Its async work (hundreds of concurrent /generate calls) runs on one event loop in a background
thread; the actor's methods are plain synchronous calls for the driver.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import ray

from slime_hydra.config.schema import EvalDatasetConfig, RunConfig
from slime_hydra.launch.plan import ENGINE_SHARE, ResourcePlan
from slime_hydra.rollout.client import GenerateClient, control
from slime_hydra.rollout.engine import EngineActor
from slime_hydra.rollout.generate import GenerateContext, generate as default_generate
from slime_hydra.rollout.sample import Sample, Status
from slime_hydra.rollout.sglang import ServerSpec

log = logging.getLogger(__name__)
Group = List[Sample]


class RolloutManager:
    def __init__(self, cfg: RunConfig, plan: ResourcePlan, pg, model_path: str):
        from slime_hydra.logging.setup import setup_actor_logging

        setup_actor_logging(cfg, "rollout_manager")
        self.cfg, self.plan, self.model_path = cfg, plan, model_path
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True).start()
        self.engines: List[Any] = []
        self.router = None
        self.urls: List[str] = []
        self._start_engines(pg)
        self._load_data()

    # ----------------------------------------------------------------------------- set-up
    def _start_engines(self, pg) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from slime_hydra.rollout.router import Router

        cfg, plan = self.cfg, self.plan
        log_dir = os.path.join(cfg.output_dir, "logs")
        spec = ServerSpec(engine=cfg.rollout.engine, model_path=self.model_path,
                          tokenizer_path=self.model_path, dtype=cfg.model.dtype, device=plan.device,
                          gpus=cfg.parallelism.gpus_per_engine, seed=cfg.rollout.seed,
                          trust_remote_code=cfg.model.trust_remote_code,
                          memory_saver=bool(cfg.parallelism.offload_rollout),
                          max_batch=cfg.rollout.embedded_max_batch, server_args=dict(cfg.rollout.server_args),
                          num_threads=cfg.parallelism.cpu_threads if plan.device == "cpu" else None)
        share = {"num_gpus": ENGINE_SHARE, "num_cpus": 0} if plan.device == "cuda" else {"num_cpus": ENGINE_SHARE}
        env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if plan.device == "cuda" else {}
        actor = ray.remote(EngineActor)
        for slot in plan.engines:
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=slot.lead)
            spec_i = ServerSpec(**{**spec.__dict__, "seed": cfg.rollout.seed + slot.rank})
            self.engines.append(actor.options(scheduling_strategy=strategy, runtime_env={"env_vars": env}, **share)
                                .remote(spec_i, slot.rank, log_dir, cfg.rollout.startup_timeout_s))
        t0 = time.perf_counter()
        self.urls = ray.get([e.start.remote() for e in self.engines])
        log.info("%d %s engine(s) up in %.1fs: %s", len(self.urls), cfg.rollout.engine, time.perf_counter() - t0, self.urls)
        if cfg.rollout.router.enabled:
            self.router = Router(cfg.rollout.router, self.urls[0].split("//")[1].rsplit(":", 1)[0],
                                 os.path.join(log_dir, "router.log"))
            for url in self.urls:
                self.router.add_worker(url)
            base = self.router.url
        else:
            if len(self.urls) > 1:
                raise ValueError("rollout.router.enabled=false supports one engine only; several need the router")
            base = self.urls[0]
        concurrency = cfg.rollout.concurrency * len(self.urls)
        self.client = self._run(self._make_client(base, concurrency))

    @staticmethod
    async def _make_client(base: str, concurrency: int) -> GenerateClient:
        return GenerateClient(base, concurrency)

    def _load_data(self) -> None:
        from slime_hydra.data.source import build_data_source, load_eval_dataset
        from slime_hydra.data.tokenizer import load_tokenizer
        from slime_hydra.utils.hooks import load_hook

        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or self.model_path, cfg.model.trust_remote_code)
        buffer_filter = load_hook(cfg.data.buffer_filter) if cfg.data.buffer_filter is not None else None
        self.source = build_data_source(cfg.data, self.tokenizer, n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
                                        max_prompt_len=cfg.rollout.max_prompt_len, buffer_filter=buffer_filter)
        self.eval_sets: Dict[str, Tuple[EvalDatasetConfig, list, List[str]]] = {}
        for ds in cfg.eval.datasets:
            rows, prompts = load_eval_dataset(ds, cfg.data, self.tokenizer, cfg.rollout.max_prompt_len)
            self.eval_sets[ds.name] = (ds, rows, prompts)
        self.generate_fn = load_hook(cfg.rollout.generate) if cfg.rollout.generate is not None else default_generate
        self.dynamic_filter = load_hook(cfg.rollout.dynamic_filter) if cfg.rollout.dynamic_filter is not None else None
        self.ctx = GenerateContext(cfg, self.tokenizer, self.client)
        log.info("data: %d training prompts; eval sets: %s", len(self.source),
                 {k: len(v[2]) for k, v in self.eval_sets.items()})

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # ------------------------------------------------------------------------------- info
    def endpoints(self) -> List[Dict[str, Any]]:
        """Where the trainer pushes weights: each engine's URL and GPU count."""
        return [{"url": u, "gpus": self.cfg.parallelism.gpus_per_engine} for u in self.urls]

    def num_train_prompts(self) -> int:
        return len(self.source)

    def sampling_params(self, ds: Optional[EvalDatasetConfig] = None) -> Dict[str, Any]:
        r = self.cfg.rollout
        sp = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
              "max_new_tokens": r.max_response_len, "stop": list(r.stop) or None,
              "stop_token_ids": list(r.stop_token_ids) or None, "skip_special_tokens": r.skip_special_tokens,
              "no_stop_trim": True, "spaces_between_special_tokens": False}
        if ds is not None:
            sp.update(temperature=ds.temperature, top_p=ds.top_p, max_new_tokens=ds.max_response_len)
        return {k: v for k, v in sp.items() if v is not None}

    # ------------------------------------------------------------------------- generation
    async def _sample(self, s: Sample, sp: Dict[str, Any], evaluation: bool) -> Sample:
        from slime_hydra.rewards import compute_reward
        from slime_hydra.utils.hooks import call_maybe_async

        if s.status in (Status.COMPLETED, Status.TRUNCATED):
            return s  # finished in an earlier, partial rollout
        out = await call_maybe_async(self.generate_fn, self.ctx, s, sp, evaluation)
        if not isinstance(out, Sample):
            raise TypeError(f"rollout.generate must return a Sample, got {type(out).__name__}")
        if out.status != Status.ABORTED and not self.cfg.reward.group and out.reward is None:
            out.reward = await compute_reward(self.cfg.reward, out)
        return out

    async def _group(self, group: Group, sp: Dict[str, Any], evaluation: bool) -> Group:
        from slime_hydra.rewards import compute_group_reward

        group = list(await asyncio.gather(*(self._sample(s, sp, evaluation) for s in group)))
        if self.cfg.reward.group and not any(s.status == Status.ABORTED for s in group):
            for s, r in zip(group, await compute_group_reward(self.cfg.reward, group)):
                s.reward = r
        return group

    def _keep(self, group: Group) -> Tuple[bool, str]:
        if self.dynamic_filter is None:
            return True, ""
        out = self.dynamic_filter(group)
        if isinstance(out, bool):
            return out, "filtered"
        return bool(out.keep), getattr(out, "reason", "filtered") or "filtered"

    async def _abort_all(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(control, u, "/abort_request", {"abort_all": True}) for u in self.urls))

    async def _collect(self, target: int) -> Tuple[List[Group], Counter]:
        """Generate until ``target`` groups pass the dynamic filter (slime's over-sampling loop)."""
        sp = self.sampling_params()
        accepted: List[Group] = []
        drops: Counter = Counter()
        pending: set = set()
        over = self.cfg.rollout.over_sampling_batch_size
        while len(accepted) < target:
            if len(accepted) + len(pending) < target:
                for g in self.source.get_samples(over):
                    pending.add(asyncio.ensure_future(self._group(g, sp, False)))
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                group = fut.result()
                keep, reason = self._keep(group)
                if keep and len(accepted) < target:
                    accepted.append(group)
                elif not keep:
                    drops[reason] += 1
        if pending:  # over-sampled groups still running: cut them off
            await self._abort_all()
            leftovers = [g for g in await asyncio.gather(*pending)]
            if self.cfg.rollout.partial_rollout:
                self.source.add_samples([g for g in leftovers])
            drops["aborted"] += len(leftovers)
        accepted.sort(key=lambda g: g[0].group_index)
        return accepted, drops

    def generate(self, rollout_id: int, weight_version: int) -> Tuple[List[Any], Dict[str, float]]:
        """One rollout -> (one object ref of training data per data-parallel rank, metrics)."""
        t0 = time.perf_counter()
        groups, drops = self._run(self._collect(self.cfg.rollout.batch_size))
        samples = [s for g in groups for s in g]
        stale = {v for s in samples for v in s.weight_versions if v != str(weight_version)}
        if stale:
            raise RuntimeError(f"rollout {rollout_id}: engines generated with weight version(s) {sorted(stale)}, "
                               f"expected {weight_version}: the last weight update did not arrive")
        data, metrics = self._train_data(samples)
        metrics.update({f"rollout/dropped_{k}": float(v) for k, v in drops.items()})
        metrics["perf/rollout_time"] = time.perf_counter() - t0
        self._last_samples = samples[:4]
        return self._split(data), metrics

    def _train_data(self, samples: List[Sample]) -> Tuple[Dict[str, list], Dict[str, float]]:
        import torch

        from slime_hydra.train.algorithms import rewards_for_estimator

        n = self.cfg.rollout.n_samples_per_prompt
        raw = torch.tensor([s.reward_value(self.cfg.reward.key) for s in samples], dtype=torch.float32)
        rewards = rewards_for_estimator(self.cfg.algo, raw, n)
        lens = [s.response_length for s in samples]
        data = {
            "tokens": [s.tokens for s in samples],
            "response_lengths": lens,
            "loss_masks": [[0] * s.response_length if s.remove_sample else (s.loss_mask or [1] * s.response_length)
                           for s in samples],
            "rewards": rewards.tolist(),
            "raw_rewards": raw.tolist(),
            "rollout_log_probs": [s.rollout_log_probs or [0.0] * s.response_length for s in samples],
            "group_indices": [s.group_index for s in samples],
            "truncated": [s.status == Status.TRUNCATED for s in samples],
        }
        groups = raw.view(-1, n)
        metrics = {
            "rollout/reward_mean": float(raw.mean()),
            "rollout/response_len_mean": sum(lens) / len(lens),
            "rollout/response_len_max": float(max(lens)),
            "rollout/truncated_ratio": sum(data["truncated"]) / len(samples),
            "rollout/zero_std_groups": float((groups.std(1, unbiased=False) == 0).float().mean()) if n > 1 else 0.0,
            "rollout/response_tokens": float(sum(lens)),
            "rollout/samples": float(len(samples)),
        }
        return data, metrics

    def _split(self, data: Dict[str, list]) -> List[Any]:
        """Per optimiser step, consecutive equal slices for each data-parallel rank, so that every rank
        holds (gbs / dp) samples of each step in order."""
        dp = self.plan.data_parallel
        gbs = self.cfg.trainer.global_batch_size
        n = len(data["tokens"])
        per_rank: List[List[int]] = [[] for _ in range(dp)]
        for start in range(0, n - n % gbs, gbs):
            share = gbs // dp
            for r in range(dp):
                per_rank[r].extend(range(start + r * share, start + (r + 1) * share))
        return [ray.put({k: [v[i] for i in idx] for k, v in data.items()}) for idx in per_rank]

    def last_samples(self) -> List[Dict[str, Any]]:
        return [{"prompt": s.prompt, "response": s.response, "label": s.label, "reward": s.reward}
                for s in getattr(self, "_last_samples", [])]

    # ------------------------------------------------------------------------------- eval
    def eval(self, rollout_id: int) -> Dict[str, Any]:
        return self._run(self._eval())

    async def _eval(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for name, (ds, rows, prompts) in self.eval_sets.items():
            sp = self.sampling_params(ds)
            groups = []
            for i, (row, prompt) in enumerate(zip(rows, prompts)):
                meta = dict(row.metadata)
                groups.append([Sample(prompt=prompt, label=row.label, metadata=meta, group_index=i, index=i * ds.n_samples_per_prompt + k)
                               for k in range(ds.n_samples_per_prompt)])
            done = await asyncio.gather(*(self._group(g, sp, True) for g in groups))
            rewards = [[s.reward_value(self.cfg.reward.key) for s in g] for g in done]
            flat = [r for g in rewards for r in g]
            out[f"eval/{name}/reward"] = sum(flat) / len(flat)
            out[f"eval/{name}/response_len"] = sum(s.response_length for g in done for s in g) / len(flat)
            out[f"eval/{name}/truncated_ratio"] = sum(s.status == Status.TRUNCATED for g in done for s in g) / len(flat)
            if ds.n_samples_per_prompt > 1:
                out[f"eval/{name}/pass@{ds.n_samples_per_prompt}"] = sum(max(g) > 0 for g in rewards) / len(rewards)
            out[f"eval/{name}/examples"] = [{"prompt": s.prompt, "response": s.response, "label": s.label, "reward": s.reward}
                                           for s in [g[0] for g in done[: self.cfg.logging.log_samples]]]
        return out

    # ---------------------------------------------------------------- colocated memory, state
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

    def state_dict(self) -> Dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.source.load_state_dict(state)

    def shutdown(self) -> None:
        if self.router is not None:
            for u in self.urls:
                try:
                    self.router.remove_worker(u)
                except Exception:  # noqa: BLE001 - shutting down anyway
                    pass
            self.router.stop()
        ray.get([e.stop.remote() for e in self.engines])
        try:
            self._run(self.client.aclose())
        except Exception:  # noqa: BLE001
            pass
