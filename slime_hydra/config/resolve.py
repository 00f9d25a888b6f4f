"""Hydra's DictConfig to the typed ``RunConfig`` (``load``), and every derived value filled in one place
(``resolve``): they are pure functions of the config, several cross groups, and every component's rules read them."""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import List

from omegaconf import DictConfig, ListConfig, OmegaConf

from slime_hydra.config.schema import RunConfig


class ConfigError(ValueError):
    """Every problem of a config at once, each ``<dotted.path>: <what is wrong>``."""

    def __init__(self, violations: List[str]):
        self.violations = violations
        lines = "\n".join(f"  - {v}" for v in violations)
        super().__init__(f"invalid config ({len(violations)} problem{'s' * (len(violations) != 1)}):\n{lines}")


def load(cfg: DictConfig | RunConfig) -> RunConfig:
    """DictConfig (from Hydra) -> RunConfig dataclass, with interpolations resolved."""
    if isinstance(cfg, RunConfig):
        return cfg
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError([f"{k}: required value is missing (set it in a config file or as {k}=...)" for k in missing])
    unknown = unknown_keys(cfg)
    if unknown:
        raise ConfigError(unknown)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def unknown_keys(node: DictConfig, path: str = "") -> List[str]:
    """Keys of a schema section that its dataclass lacks: Hydra adds a misspelt ``+key=value`` unread.
    Dict-typed sections (``rollout.server_args``, hook arguments) take any key."""
    schema = OmegaConf.get_type(node)
    fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    out: List[str] = []
    for key in node.keys():
        name = f"{path}{key}"
        if fields is not None and key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields), n=2, cutoff=0.6)
            hint = f"; did you mean {' or '.join(path + c for c in close)}?" if close else ""
            section = re.sub(r"\[\d+\]", "", path.rstrip("."))  # describe takes eval.datasets, not [0]
            describe = f"python -m slime_hydra.config describe {section}".rstrip()
            out.append(f"{name}: not a config key{hint} (`{describe}` lists them)")
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            out += unknown_keys(child, name + ".")
        elif isinstance(child, ListConfig) and not child._is_none() and not child._is_missing():
            for i, item in enumerate(child):
                if isinstance(item, DictConfig):
                    out += unknown_keys(item, f"{name}[{i}].")
    return out


# sync.max_logprob_diff by model.dtype: well above the gap of healthy weights (bf16 engines differ far more)
LOGPROB_GAP_LIMITS = {"float32": 1e-3, "bfloat16": 0.05, "float16": 0.05}


def resolve(cfg: RunConfig) -> RunConfig:
    """Fill derived values in place (the rules that slime applies after parsing)."""
    p, r, t, a = cfg.parallelism, cfg.rollout, cfg.trainer, cfg.algo
    if p.rollout_gpus is None:
        p.rollout_gpus = p.trainer_gpus if p.colocate else p.gpus_per_engine
    if cfg.sync.max_logprob_diff is None:  # the log-prob gap guard is on, with a limit for the dtype
        cfg.sync.max_logprob_diff = LOGPROB_GAP_LIMITS.get(cfg.model.dtype, 0.05)
    if p.expert_tensor_parallel is None:
        p.expert_tensor_parallel = p.tensor_parallel  # megatron's default
    if a.eps_clip_high is None:
        a.eps_clip_high = a.eps_clip
    if a.critic_lr is None:
        a.critic_lr = a.lr
    if r.n_samples_per_prompt == 1:
        a.normalize_std = False  # the std of a single sample is undefined
    if r.over_sampling_batch_size is None:
        r.over_sampling_batch_size = r.batch_size
    samples = r.batch_size * r.n_samples_per_prompt
    if t.global_batch_size is None and t.num_steps_per_rollout is None:
        t.num_steps_per_rollout = 1
    if t.global_batch_size is None and t.num_steps_per_rollout:
        t.global_batch_size = samples // t.num_steps_per_rollout
    if t.num_steps_per_rollout is None and t.global_batch_size:
        t.num_steps_per_rollout = max(1, samples // t.global_batch_size)
    if r.router.policy == "auto":
        # one engine has nothing to route between, and cache_aware's prefix tree grows the router's memory
        r.router.policy = "cache_aware" if p.rollout_gpus // p.gpus_per_engine > 1 else "round_robin"
    if cfg.sync.transport == "auto":
        cfg.sync.transport = "tensor" if p.colocate else "distributed"
    inherited = {"input_key": cfg.data.input_key, "label_key": cfg.data.label_key, "reward": cfg.reward.type,
                 "max_response_len": r.max_response_len}
    for ds in cfg.eval.datasets:
        for key, value in inherited.items():
            if getattr(ds, key) is None:
                setattr(ds, key, value)
    if t.mode == "async" and p.colocate:
        # async trains while the next rollout generates: nothing takes turns on the GPU (launch/rules.py)
        for name in ("offload_train", "offload_rollout", "push_before_offload"):
            if getattr(p, name) is None:
                setattr(p, name, False)
    if not (p.colocate and p.device == "cuda"):  # colocated GPUs: plan.fit.resolve_offload, by the estimate
        if p.offload_train is None:  # CPU slots: the colocated choreography, as on GPUs that need it
            p.offload_train = p.colocate
        if p.offload_rollout is None:
            p.offload_rollout = p.colocate
        if p.push_before_offload is None:  # CPU slots: the GPU's order (nothing moves there)
            p.push_before_offload = bool(p.offload_train)
    return cfg
