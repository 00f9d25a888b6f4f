"""Config rules of the rollout: the engines (``rollout.engine``, ``rollout.server_args``, the router),
the sampling parameters, the over-sampling loop with its filters, and the rollout hooks."""

from __future__ import annotations

from typing import List

from slime_hydra.config.rules import choice, loads
from slime_hydra.config.schema import RunConfig
from slime_hydra.rollout.engines import ENGINES, engine_class

ROUTER_POLICIES = ["round_robin", "random", "cache_aware", "power_of_two"]  # sglang-router's --policy (after "auto")


def check(cfg: RunConfig) -> List[str]:
    return _check_engine(cfg) + _check_sampling(cfg) + _check_hooks(cfg)


def _check_engine(cfg: RunConfig) -> List[str]:
    errs: List[str] = []
    r, p = cfg.rollout, cfg.parallelism
    if choice(errs, "rollout.engine", r.engine, ENGINES):
        errs += engine_class(r.engine).check(cfg)  # each engine's own rules, beside its command line
    choice(errs, "rollout.router.policy", r.router.policy, ROUTER_POLICIES)
    engines = p.rollout_gpus // max(p.gpus_per_engine, 1)  # as plan.resources.make_plan lays them out
    if not r.router.enabled and engines != 1:
        errs.append("rollout.router.enabled: false needs exactly one engine (the rollout manager talks to one URL), "
                    f"but parallelism.rollout_gpus / gpus_per_engine = {p.rollout_gpus} / {p.gpus_per_engine} = "
                    f"{engines} engines")
    return errs


def _check_sampling(cfg: RunConfig) -> List[str]:
    from slime_hydra.rollout.filters import NONZERO_REWARD_STD, dynamic_filter_spec

    errs: List[str] = []
    r = cfg.rollout
    for path, v in [("rollout.batch_size", r.batch_size), ("rollout.n_samples_per_prompt", r.n_samples_per_prompt)]:
        if v < 1:
            errs.append(f"{path}: must be >= 1, got {v}")
    if r.temperature <= 0:
        errs.append(f"rollout.temperature: must be > 0 for training rollouts, got {r.temperature}")
    if not 0 < r.top_p <= 1:
        errs.append(f"rollout.top_p: must be in (0, 1], got {r.top_p}")
    # the engines return (and the trainer recomputes) log-probs of the whole distribution, not the truncated one
    truncated = ("the trainer scores the whole distribution at rollout.temperature, so it would train on samples "
                 "of another policy; lower rollout.temperature instead (eval datasets may keep their own top_p)")
    if 0 < r.top_p < 1:
        errs.append(f"rollout.top_p: {r.top_p} truncates training samples to a nucleus: {truncated}")
    if r.top_k != -1:
        errs.append(f"rollout.top_k: {r.top_k} truncates training samples to the top tokens (-1 is off): {truncated}")
    if r.max_response_len < 1:
        errs.append(f"rollout.max_response_len: must be >= 1, got {r.max_response_len}")
    if r.max_response_len >= (pos := cfg.model.arch.max_position_embeddings):
        errs.append(f"rollout.max_response_len: {r.max_response_len} >= model.arch.max_position_embeddings={pos}, "
                    f"which leaves no room for the prompt; set rollout.max_response_len={pos // 2} or less, or use a "
                    "model with more positions (a preset with its checkpoint, e.g. model=qwen3_0_6b)")
    if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < r.batch_size:
        errs.append(f"rollout.over_sampling_batch_size: {r.over_sampling_batch_size} < "
                    f"rollout.batch_size={r.batch_size}")
    spec = dynamic_filter_spec(cfg)
    if r.partial_rollout and spec is None and (r.over_sampling_batch_size or r.batch_size) <= r.batch_size:
        errs.append("rollout.partial_rollout: recycles groups cut off by dynamic sampling or over-sampling, so it "
                    "needs rollout.dynamic_filter, algo.dynamic_sampling=true or rollout.over_sampling_batch_size > "
                    "rollout.batch_size")
    target = spec.get("_target_") if hasattr(spec, "get") else spec
    if r.n_samples_per_prompt < 2 and isinstance(target, str) and target.startswith(NONZERO_REWARD_STD):
        where = "rollout.dynamic_filter" if r.dynamic_filter is not None else "algo.dynamic_sampling"
        errs.append(f"{where}: nonzero_reward_std drops groups whose rewards are all equal, which is every group of "
                    "rollout.n_samples_per_prompt=1 (sample several per prompt)")
    if r.max_sampled_groups is not None and r.max_sampled_groups < r.batch_size:
        errs.append(f"rollout.max_sampled_groups: {r.max_sampled_groups} < rollout.batch_size={r.batch_size}")
    if r.mask_offpolicy_in_partial_rollout and not r.partial_rollout:
        errs.append("rollout.mask_offpolicy_in_partial_rollout: masks tokens of continued partial rollouts, so it "
                    "needs rollout.partial_rollout=true")
    return errs


def _check_hooks(cfg: RunConfig) -> List[str]:
    """Import the rollout hooks as the manager will, so a typo fails here with its config key."""
    from slime_hydra.utils.hooks import load_hook

    errs: List[str] = []
    hooks = {"rollout.generate": cfg.rollout.generate, "rollout.dynamic_filter": cfg.rollout.dynamic_filter,
             "rollout.rollout_function": cfg.rollout.rollout_function}
    for where, spec in hooks.items():
        if spec is not None:
            loads(errs, where, lambda spec=spec: load_hook(spec))
    return errs + _check_agent(cfg)


def _check_agent(cfg: RunConfig) -> List[str]:
    from slime_hydra.rollout.agent import load_agent
    from slime_hydra.rollout.tool_calls import PARSERS

    errs: List[str] = []
    r = cfg.rollout
    if r.tool_parser is not None:
        choice(errs, "rollout.tool_parser", r.tool_parser, sorted(PARSERS))
    if r.agent is None:
        return errs
    if r.generate is not None:
        errs.append("rollout.agent and rollout.generate are both set: the agent's generate function is the "
                    "endpoint's; set one of them")
    if r.agent_timeout <= 0:
        errs.append(f"rollout.agent_timeout: must be > 0 seconds, got {r.agent_timeout}")
    if r.agent_max_turns is not None and r.agent_max_turns < 1:
        errs.append(f"rollout.agent_max_turns: must be >= 1 or null, got {r.agent_max_turns}")
    if r.agent == "verifiers" and not r.agent_env:
        errs.append("rollout.agent_env: rollout.agent=verifiers needs the installed verifiers taskset to run "
                    "(its module name or id)")
    elif r.agent_env and r.agent != "verifiers":
        errs.append(f"rollout.agent_env={r.agent_env!r} is for rollout.agent=verifiers (rollout.agent={r.agent!r})")
    else:
        loads(errs, "rollout.agent", lambda: load_agent(cfg), explained=(ValueError,))
    return errs
