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
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import ray

from slime_hydra.config.schema import EvalDatasetConfig, RunConfig
from slime_hydra.launch.plan import ENGINE_SHARE, ResourcePlan
from slime_hydra.rewards.hub import spec_name
from slime_hydra.rollout.client import EngineError, GenerateClient, control
from slime_hydra.rollout.engine import EngineActor, engine_log_path
from slime_hydra.rollout.filters import DynamicFilterOutput, zero_std
from slime_hydra.rollout.generate import GenerateContext, generate as default_generate
from slime_hydra.rollout.sample import Sample, Status
from slime_hydra.rollout.sglang import ServerSpec
from slime_hydra.utils.proc import node_ip, tail

log = logging.getLogger(__name__)
Group = List[Sample]


def engine_specs(cfg: RunConfig, plan: ResourcePlan, model_path: str) -> List[List[ServerSpec]]:
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


class RolloutManager:
    # The engine actors (one per node an engine spans) and their logs, watched during rollouts and
    # evals; none in managers built without engines (tests).
    engines: Sequence[Any] = ()
    engine_logs: Sequence[str] = ()

    def __init__(self, cfg: RunConfig, plan: ResourcePlan, pg, model_path: str):
        from slime_hydra.logging.setup import setup_actor_logging

        setup_actor_logging(cfg, "rollout_manager")
        self.cfg, self.plan, self.model_path = cfg, plan, model_path
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True).start()
        self.engines, self.engine_logs = [], []
        self._state_at: Dict[int, Dict[str, Any]] = {}
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
        share = {"num_gpus": ENGINE_SHARE, "num_cpus": 0} if plan.device == "cuda" else {"num_cpus": ENGINE_SHARE}
        env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if plan.device == "cuda" else {}
        actor = ray.remote(EngineActor)
        leads: List[Any] = []
        for slot, node_specs in zip(plan.engines, engine_specs(cfg, plan, self.model_path)):
            # one actor per node the engine spans, on that node's first bundle; node 0 serves HTTP
            node_bundles = [b for i, b in enumerate(slot.bundles) if i % plan.gpus_per_node == 0]
            actors = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                          placement_group=pg, placement_group_bundle_index=b),
                          runtime_env={"env_vars": env}, **share).remote(spec, slot.rank, log_dir, cfg.rollout.startup_timeout_s)
                      for b, spec in zip(node_bundles, node_specs)]
            if len(actors) > 1:
                addr = ray.get(actors[0].reserve_dist_init_addr.remote())
                ray.get([a.set_dist_init_addr.remote(addr) for a in actors])
            self.engines += actors
            self.engine_logs += [engine_log_path(log_dir, slot.rank, spec) for spec in node_specs]
            leads.append(actors)
        t0 = time.perf_counter()
        starts = [[a.start.remote() for a in actors] for actors in leads]  # all engines start at once
        self.urls = [ray.get(refs)[0] for refs in starts]
        log.info("%d %s engine(s) up in %.1fs: %s", len(self.urls), cfg.rollout.engine, time.perf_counter() - t0, self.urls)
        if cfg.rollout.router.enabled:  # a child of this process: on this actor's node
            self.router = Router(cfg.rollout.router, node_ip(), os.path.join(log_dir, "router.log"))
            for url in self.urls:
                self.router.add_worker(url)
            base = self.router.url
        else:  # validation allows this with exactly one engine
            base = self.urls[0]
        concurrency = cfg.rollout.concurrency * len(self.urls)
        # no reply within the router's request timeout: the engine hangs (a dead one is caught sooner)
        self.client = self._run(self._make_client(base, concurrency, cfg.rollout.router.request_timeout_secs))

    @staticmethod
    async def _make_client(base: str, concurrency: int, read_timeout: float) -> GenerateClient:
        return GenerateClient(base, concurrency, read_timeout=read_timeout)

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
        self._setup_generation()
        log.info("data: %d training prompts; eval sets: %s", len(self.source),
                 {k: len(v[2]) for k, v in self.eval_sets.items()})

    def _setup_generation(self) -> None:
        """The generate function, the dynamic filter (``rollout.dynamic_filter``, or DAPO's
        ``nonzero_reward_std`` with ``algo.dynamic_sampling``) and the generate context."""
        from slime_hydra.rollout.filters import dynamic_filter_spec
        from slime_hydra.utils.hooks import load_hook

        cfg = self.cfg
        self.generate_fn = load_hook(cfg.rollout.generate) if cfg.rollout.generate is not None else default_generate
        self.filter_spec = dynamic_filter_spec(cfg)
        self.dynamic_filter = load_hook(self.filter_spec) if self.filter_spec is not None else None
        self.ctx = GenerateContext(cfg, self.tokenizer, self.client)
        self._rollout_id: Optional[int] = None
        self._version: Optional[str] = None  # the weight version this rollout must be generated with

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
        if not evaluation:
            s.metadata.setdefault("start_rollout_id", self._rollout_id)
            if s.status == Status.ABORTED and s.response_length and self.cfg.rollout.mask_offpolicy_in_partial_rollout:
                s.loss_mask = [0] * s.response_length  # generated by older weights: train only what follows
        versions_before = len(s.weight_versions)
        out = await call_maybe_async(self.generate_fn, self.ctx, s, sp, evaluation)
        if not isinstance(out, Sample):
            what = "a list (fan-out is not supported: a group keeps n_samples_per_prompt samples)" \
                if isinstance(out, (list, tuple)) else type(out).__name__
            raise TypeError(f"rollout.generate {spec_name(self.cfg.rollout.generate)!r} returned {what}; expected a "
                            "Sample (async def generate(ctx, sample, sampling_params, evaluation) -> Sample)")
        if not evaluation and self._version is not None:
            new = out.weight_versions[versions_before:] if out is s else out.weight_versions
            stale = sorted(set(new) - {self._version})
            if stale:
                raise RuntimeError(f"rollout {self._rollout_id}: engines generated with weight version(s) {stale}, "
                                   f"expected {self._version}: the last weight update did not arrive")
        if out.status != Status.ABORTED and not self.cfg.reward.group and out.reward is None:
            out.reward = await compute_reward(self.cfg.reward, out)
        return out

    async def _group(self, group: Group, sp: Dict[str, Any], evaluation: bool) -> Group:
        from slime_hydra.rewards import compute_group_reward

        tasks = [asyncio.ensure_future(self._sample(s, sp, evaluation)) for s in group]
        try:
            group = list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:  # one sample failed: do not leave its siblings running
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if self.cfg.reward.group and not any(s.status == Status.ABORTED for s in group):
            for s, r in zip(group, await compute_group_reward(self.cfg.reward, group)):
                s.reward = r
        return group

    async def _keep(self, group: Group) -> "DynamicFilterOutput":
        """The dynamic filter's verdict on a finished group (keep everything without a filter)."""
        from slime_hydra.rollout.filters import DynamicFilterOutput, as_filter_output
        from slime_hydra.utils.hooks import call_maybe_async

        if self.dynamic_filter is None:
            return DynamicFilterOutput(keep=True)
        out = await call_maybe_async(self.dynamic_filter, self.cfg, group)
        return as_filter_output(out, f"rollout.dynamic_filter {spec_name(self.filter_spec)!r}")

    async def _abort_all(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(control, u, "/abort_request", {"abort_all": True}) for u in self.urls))

    async def _abort_and_drain(self, pending: set) -> List[Group]:
        """Cut the in-flight groups off and wait for them: ``abort_all`` on every engine, repeated
        until every group has returned (a request still on its way to an engine when an abort lands
        is not aborted by it), while ``ctx.post`` answers new /generate calls as aborted at once
        (multi-turn generate functions stop between turns). Returns the groups, partial samples
        marked ABORTED with the tokens made so far."""
        groups: List[Group] = []
        errors: List[BaseException] = []
        self.ctx.aborting = True
        try:
            while pending:
                await self._abort_all()
                done, pending = await asyncio.wait(pending, timeout=ABORT_RETRY_S)
                for fut in done:
                    if fut.exception() is not None:
                        errors.append(fut.exception())
                    else:
                        groups.append(fut.result())
        finally:
            self.ctx.aborting = False
        if errors:
            raise errors[0]
        return sorted(groups, key=lambda g: g[0].group_index)

    async def _cancel(self, pending: set) -> None:
        """After an error: stop everything in flight, best effort."""
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        try:
            await self._abort_all()
        except Exception as e:  # noqa: BLE001 - the original error matters more
            log.warning("abort after a failed rollout: %s", e)

    async def _watched(self, coro):
        """Await ``coro`` while watching the engines: if one dies, fail within ``ENGINE_POLL_S``
        with its log's tail (its requests would otherwise retry for a minute, or hang)."""
        work = asyncio.ensure_future(coro)
        if not self.engines:
            return await work
        watchdog = asyncio.ensure_future(self._watch_engines())
        try:
            done, _ = await asyncio.wait({work, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            if watchdog in done:
                watchdog.result()  # raises
            return work.result()
        finally:
            work.cancel()  # after an engine died: _collect_groups cancels its requests and aborts the rest
            watchdog.cancel()
            await asyncio.gather(work, watchdog, return_exceptions=True)

    async def _watch_engines(self) -> None:
        while True:
            await asyncio.sleep(ENGINE_POLL_S)
            dead = await asyncio.to_thread(self._dead_engines)
            if dead:
                raise EngineError("\n".join(dead))

    def _dead_engines(self) -> List[str]:
        """Why each dead engine died (an actor too busy to answer within ENGINE_POLL_S counts as alive)."""
        refs = [e.failure.remote() for e in self.engines]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ENGINE_POLL_S)
        out = []
        for ref, log_path in zip(refs, self.engine_logs):
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

    async def _collect(self, target: int) -> Tuple[List[Group], Dict[str, float]]:
        return await self._watched(self._collect_groups(target))

    async def _collect_groups(self, target: int) -> Tuple[List[Group], Dict[str, float]]:
        """Generate until ``target`` groups pass the dynamic filter (slime's over-sampling loop).

        While the kept plus in-flight groups are fewer than ``target``, ``over_sampling_batch_size``
        more prompts are pulled from the data source (buffered partial groups first). Each finished
        group is judged by the filter as it completes. Once ``target`` groups are kept, the groups
        still in flight are aborted; with ``rollout.partial_rollout`` they go back to the buffer and
        are continued in the next rollout (as in slime, groups that finish after the batch is full
        are not kept: they would be trained a step later, entirely off-policy). After
        ``rollout.max_sampled_groups`` groups, no more prompts are pulled, and if too few groups
        passed, rejected ones fill the batch. Kept groups are returned in data order."""
        r = self.cfg.rollout
        sp = self.sampling_params()
        over = r.over_sampling_batch_size or target
        cap = r.max_sampled_groups
        accepted: List[Group] = []
        rejected: List[Group] = []  # only needed to fill the batch when the cap is hit
        surplus: List[Group] = []  # finished after the batch was full
        drops: Counter = Counter()
        n = Counter()
        pending: set = set()
        next_log = time.monotonic() + PROGRESS_LOG_S
        try:
            while len(accepted) < target:
                if time.monotonic() > next_log:  # dynamic sampling can take many rounds
                    next_log = time.monotonic() + PROGRESS_LOG_S
                    log.info("rollout %s: %d of %d groups kept after %d sampled (dropped: %s)", self._rollout_id,
                             len(accepted), target, n["sampled"], dict(drops) or "none")
                if len(accepted) + len(pending) < target and (cap is None or n["sampled"] < cap):
                    for g in self.source.get_samples(over):
                        pending.add(asyncio.ensure_future(self._group(g, sp, False)))
                        n["sampled"] += 1
                if not pending:  # the cap is reached and every sampled group has finished
                    fill = rejected[: target - len(accepted)]
                    log.warning("rollout %s: only %d of %d groups passed the dynamic filter after %d sampled groups "
                                "(rollout.max_sampled_groups); filling the batch with %d rejected groups",
                                self._rollout_id, len(accepted), target, n["sampled"], len(fill))
                    accepted += fill
                    n["fallback"] += len(fill)
                    break
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                finished = sorted((f.result() for f in done), key=lambda g: g[0].group_index)
                for i, group in enumerate(finished):
                    n["finished"] += 1
                    n["zero_std"] += _zero_std(group, self.cfg.reward.key)
                    if len(accepted) >= target:
                        surplus.append(group)
                        continue
                    verdict = await self._keep(group)
                    if verdict.keep:
                        accepted.append(group)
                    elif verdict.keep_when_insufficient and len(accepted) + len(pending) + len(finished) - i - 1 < target:
                        accepted.append(group)  # dropping it would need another sampling round
                        n["fallback"] += 1
                    else:
                        drops[verdict.reason or "filtered"] += 1
                        if cap is not None:
                            rejected.append(group)
        except BaseException:
            await self._cancel(pending)
            raise
        aborted = await self._abort_and_drain(pending) if pending else []
        if r.partial_rollout and aborted:
            self.source.add_samples(aborted)
        accepted.sort(key=lambda g: g[0].group_index)
        metrics = {
            "rollout/sampled_groups": float(n["sampled"]),
            "rollout/aborted_groups": float(len(aborted)),
            "rollout/unused_groups": float(len(surplus)),
            "rollout/generated_zero_std_ratio": n["zero_std"] / max(n["finished"], 1),
        }
        if r.partial_rollout:
            metrics["rollout/recycled_groups"] = float(len(aborted))
            metrics["rollout/resumed_samples"] = float(sum(s.metadata.get("start_rollout_id") != self._rollout_id
                                                           for g in accepted for s in g))
        if self.dynamic_filter is not None:
            dropped = sum(drops.values())
            metrics.update({f"rollout/dynamic_filter/drop_{k}": float(v) for k, v in drops.items()})
            metrics["rollout/dynamic_filter/dropped_groups"] = float(dropped)
            metrics["rollout/dynamic_filter/dropped_ratio"] = dropped / max(n["finished"], 1)
            metrics["rollout/dynamic_filter/fallback_groups"] = float(n["fallback"])
        return accepted, metrics

    def generate(self, rollout_id: int, weight_version: int) -> Tuple[List[Any], Dict[str, float]]:
        """One rollout -> (one object ref of training data per data-parallel rank, metrics)."""
        t0 = time.perf_counter()
        self._state_at = {rollout_id: self.source.state_dict()}  # for a checkpoint taken meanwhile
        self._rollout_id, self._version = rollout_id, str(weight_version)
        try:
            groups, collect_metrics = self._run(self._collect(self.cfg.rollout.batch_size))
        finally:
            self._version = None
        samples = [s for g in groups for s in g]
        data, metrics = self._train_data(samples)
        metrics.update(collect_metrics)
        metrics.update(_agent_metrics(samples, "rollout/"))
        metrics["perf/rollout_time"] = time.perf_counter() - t0
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
            "rollout/zero_std_groups": sum(map(zero_std, groups.tolist())) / len(groups) if n > 1 else 0.0,
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
        if n % gbs:  # validation makes rollout_batch_size x n_samples_per_prompt a multiple of it
            raise RuntimeError(f"{n} training samples do not fill whole optimiser steps of "
                               f"trainer.global_batch_size={gbs}")
        per_rank: List[List[int]] = [[] for _ in range(dp)]
        for start in range(0, n, gbs):
            share = gbs // dp
            for r in range(dp):
                per_rank[r].extend(range(start + r * share, start + (r + 1) * share))
        return [ray.put({k: [v[i] for i in idx] for k, v in data.items()}) for idx in per_rank]

    # ------------------------------------------------------------------------------- eval
    def eval(self) -> Dict[str, Any]:
        return self._run(self._watched(self._eval()))

    async def _eval(self) -> Dict[str, Any]:
        """Every eval dataset, concurrently: ``eval/<name>/reward`` (mean), response length,
        truncated ratio, pass@k (k = 1, 2, 4, ... and n_samples_per_prompt, unbiased estimator;
        a sample passes with reward > 0) when a prompt is sampled several times, and examples."""
        parts = await asyncio.gather(*(self._eval_dataset(name) for name in self.eval_sets))
        return {k: v for part in parts for k, v in part.items()}

    async def _eval_dataset(self, name: str) -> Dict[str, Any]:
        ds, rows, prompts = self.eval_sets[name]
        sp = self.sampling_params(ds)
        k = ds.n_samples_per_prompt
        groups = []
        for i, (row, prompt) in enumerate(zip(rows, prompts)):
            meta = dict(row.metadata, source=row.source)
            if row.tools is not None:
                meta["tools"] = row.tools
            groups.append([Sample(prompt=prompt, label=row.label, metadata=dict(meta), group_index=i, index=i * k + j)
                           for j in range(k)])
        done = await asyncio.gather(*(self._group(g, sp, True) for g in groups))
        rewards = [[s.reward_value(self.cfg.reward.key) for s in g] for g in done]
        flat = [r for g in rewards for r in g]
        samples = [s for g in done for s in g]
        out: Dict[str, Any] = {
            f"eval/{name}/reward": sum(flat) / len(flat),
            f"eval/{name}/response_len": sum(s.response_length for s in samples) / len(flat),
            f"eval/{name}/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / len(flat),
        }
        if k > 1:
            for kk in sorted({2 ** i for i in range(k.bit_length()) if 2 ** i <= k} | {k}):
                out[f"eval/{name}/pass@{kk}"] = sum(pass_at_k(k, sum(r > 0 for r in g), kk) for g in rewards) / len(rewards)
        out.update(_agent_metrics(samples, f"eval/{name}/"))
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

    def state_dict(self, rollout_id: Optional[int] = None) -> Dict[str, Any]:
        """The data position after rollouts ``< rollout_id``: the state recorded when rollout
        ``rollout_id`` started if it has (an async loop prefetches it), else the current one."""
        state = self._state_at.get(rollout_id) if rollout_id is not None else None
        return state if state is not None else self.source.state_dict()

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


# ------------------------------------------------------------------------------------ helpers
ABORT_RETRY_S = 1.0  # abort_all again this often until every aborted group has returned
PROGRESS_LOG_S = 30.0  # how often a long collection loop reports its progress
ENGINE_POLL_S = 1.0  # how often rollouts and evals check that every engine still runs


def _zero_std(group: Group, key: Optional[str]) -> bool:
    """All rewards of a finished group equal (aborted samples have none: not zero-std)."""
    if len(group) < 2 or any(s.reward is None for s in group):
        return False
    return zero_std([s.reward_value(key) for s in group])


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``c`` passing samples out of ``n`` (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    p = 1.0
    for i in range(n - c + 1, n + 1):
        p *= 1.0 - k / i
    return 1.0 - p


def _agent_metrics(samples: List[Sample], prefix: str) -> Dict[str, float]:
    """Turns and tool calls per sample, for samples made by a multi-turn generate function
    (slime_hydra.rollout.multiturn records them in the metadata)."""
    turns = [s.metadata["num_turns"] for s in samples if "num_turns" in s.metadata]
    if not turns:
        return {}
    calls = [s.metadata.get("tool_calls", 0) for s in samples if "num_turns" in s.metadata]
    return {f"{prefix}turns_mean": sum(turns) / len(turns), f"{prefix}tool_calls_mean": sum(calls) / len(calls),
            f"{prefix}tool_use_ratio": sum(c > 0 for c in calls) / len(calls)}
