"""One validate step, run before Ray or any model starts.

``load`` turns Hydra's DictConfig into a typed ``RunConfig``; ``resolve`` fills the derived values
(``None`` fields); ``validate`` checks every cross-field rule and returns ALL violations, each as
``<dotted.path>: <what is wrong> (<the rule>)``. ``check`` raises one ``ConfigError`` listing them.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Iterable, List

from omegaconf import DictConfig, OmegaConf

from slime_hydra.config.schema import ARCH_TYPES, RunConfig

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ConfigError(ValueError):
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
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def _choice(errs: List[str], path: str, value: Any, allowed: Iterable[Any]) -> bool:
    allowed = list(allowed)
    if value not in allowed:
        errs.append(f"{path}: {value!r} is not one of {allowed}")
        return False
    return True


def _looks_local(path: str) -> bool:
    return path.startswith(("/", ".", "~")) or os.sep in path and not HUB_ID.match(path)


def _data_file(path: str) -> str:
    """Strip an optional row slice: ``data.jsonl@[0:100]`` -> ``data.jsonl``."""
    return path.split("@[", 1)[0]


def _num_engines(p: Any) -> int:
    return p.rollout_gpus // max(p.gpus_per_engine, 1)  # as launch.plan.make_plan lays them out


def _loads(errs: List[str], where: str, load: Callable[[], Any]) -> None:
    """Run ``load`` (a hook import, a dataset read); its failure becomes one violation of ``where``."""
    from slime_hydra.data.dataset import DataError
    from slime_hydra.utils.hooks import HookError

    try:
        load()
    except (HookError, DataError) as e:  # their messages name the hook spec / the file and line
        errs.append(f"{where}: {e}")
    except Exception as e:  # noqa: BLE001 - the user's module or file failed in its own way
        errs.append(f"{where}: {type(e).__name__}: {e}")


def resolve(cfg: RunConfig) -> RunConfig:
    """Fill derived values in place (the rules that slime applies after parsing)."""
    p, r, t, a = cfg.parallelism, cfg.rollout, cfg.trainer, cfg.algo
    if p.rollout_gpus is None:
        p.rollout_gpus = p.trainer_gpus if p.colocate else p.gpus_per_engine
    if p.offload_train is None:
        p.offload_train = p.colocate
    if p.offload_rollout is None:
        p.offload_rollout = p.colocate
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
    if cfg.sync.transport == "auto":
        cfg.sync.transport = "tensor" if p.colocate else "distributed"
    for ds in cfg.eval.datasets:
        if ds.input_key is None:
            ds.input_key = cfg.data.input_key
        if ds.label_key is None:
            ds.label_key = cfg.data.label_key
        if ds.reward is None:
            ds.reward = cfg.reward.type
        if ds.max_response_len is None:
            ds.max_response_len = r.max_response_len
    return cfg


def validate(cfg: RunConfig) -> List[str]:
    """Every rule, every violation. ``cfg`` must already be resolved."""
    errs: List[str] = []
    _validate_model(cfg, errs)
    _validate_parallelism(cfg, errs)
    _validate_batches(cfg, errs)
    _validate_algo(cfg, errs)
    _validate_rollout(cfg, errs)
    _validate_data(cfg, errs)
    _validate_misc(cfg, errs)
    _validate_hooks(cfg, errs)
    return errs


def check(cfg: DictConfig | RunConfig) -> RunConfig:
    """load + resolve + validate; raises ConfigError with every violation."""
    run = resolve(load(cfg))
    errs = validate(run)
    if errs:
        raise ConfigError(errs)
    return run


# ----------------------------------------------------------------------------------- the rules
def _validate_model(cfg: RunConfig, errs: List[str]) -> None:
    m, arch = cfg.model, cfg.model.arch
    _choice(errs, "model.dtype", m.dtype, ["float32", "bfloat16", "float16"])
    _choice(errs, "model.arch.type", arch.type, ARCH_TYPES)
    head_dim = arch.head_dim or (arch.hidden_size // max(arch.num_heads, 1))
    if arch.q_lora_rank is None and arch.kv_lora_rank is None:
        if arch.head_dim is None and arch.hidden_size % arch.num_heads:
            errs.append(f"model.arch.hidden_size: {arch.hidden_size} is not divisible by num_heads={arch.num_heads} (set head_dim)")
        if arch.num_heads % arch.num_kv_heads:
            errs.append(f"model.arch.num_kv_heads: num_heads={arch.num_heads} must be a multiple of num_kv_heads={arch.num_kv_heads}")
        if head_dim % 2:
            errs.append(f"model.arch.head_dim: {head_dim} must be even (rotary embeddings)")
    if arch.num_experts and not (0 < arch.num_experts_per_tok <= arch.num_experts):
        errs.append(f"model.arch.num_experts_per_tok: {arch.num_experts_per_tok} must be in 1..num_experts={arch.num_experts}")
    if m.path is None:
        if m.tokenizer is None:
            errs.append("model.tokenizer: required when model.path is null (the model is built from model.arch)")
    elif _looks_local(m.path):
        if not os.path.isdir(os.path.expanduser(m.path)):
            errs.append(f"model.path: {m.path!r} is not a directory (a local Hugging Face checkpoint, or a hub id like 'Qwen/Qwen3-4B')")
        else:
            errs.extend(_compare_with_hf_config(cfg))
    tok = m.tokenizer
    if tok is not None and tok.startswith("builtin:"):
        from slime_hydra.data.tasks import BUILTIN_TOKENIZERS

        if _choice(errs, "model.tokenizer", tok, BUILTIN_TOKENIZERS):
            vocab = len(BUILTIN_TOKENIZERS[tok])
            if arch.vocab_size != vocab:
                errs.append(f"model.arch.vocab_size: {arch.vocab_size} != {vocab}, the size of the {tok} tokenizer")
    elif tok is not None and _looks_local(tok) and not os.path.isdir(os.path.expanduser(tok)):
        errs.append(f"model.tokenizer: {tok!r} is not a directory")


def _compare_with_hf_config(cfg: RunConfig) -> List[str]:
    """Shape fields of the preset must match the checkpoint's config.json (slime's _hf_validate_args)."""
    import json

    path = os.path.join(os.path.expanduser(cfg.model.path), "config.json")
    if not os.path.exists(path):
        return [f"model.path: {cfg.model.path!r} has no config.json"]
    with open(path) as f:
        hf = json.load(f)
    hf = {**hf.get("text_config", {}), **hf}
    pairs = {
        "hidden_size": "hidden_size",
        "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads",
        "num_kv_heads": "num_key_value_heads",
        "intermediate_size": "intermediate_size",
        "vocab_size": "vocab_size",
        "tie_word_embeddings": "tie_word_embeddings",
    }
    out = []
    for ours, theirs in pairs.items():
        if theirs in hf and hf[theirs] != getattr(cfg.model.arch, ours):
            out.append(
                f"model.arch.{ours}: {getattr(cfg.model.arch, ours)!r} but {path} says {theirs}={hf[theirs]!r} (preset and checkpoint disagree)"
            )
    return out


def _validate_parallelism(cfg: RunConfig, errs: List[str]) -> None:
    p = cfg.parallelism
    _choice(errs, "parallelism.device", p.device, ["cpu", "cuda"])
    total = p.num_nodes * p.gpus_per_node
    for name in ("trainer_gpus", "rollout_gpus", "gpus_per_engine", "num_nodes", "gpus_per_node"):
        if getattr(p, name) < 1:
            errs.append(f"parallelism.{name}: must be >= 1, got {getattr(p, name)}")
    if p.num_nodes > 1 and not cfg.cluster.address:
        errs.append(f"cluster.address: required for parallelism.num_nodes={p.num_nodes} (a local Ray cluster has one "
                    "node; join a running one, e.g. cluster.address=auto)")
    if min(p.trainer_gpus, p.rollout_gpus, p.gpus_per_engine, p.gpus_per_node, p.num_nodes) < 1:
        return
    mp = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
    if p.trainer_gpus % mp:
        errs.append(
            f"parallelism.trainer_gpus: {p.trainer_gpus} is not divisible by tensor x pipeline x context parallel = "
            f"{p.tensor_parallel} x {p.pipeline_parallel} x {p.context_parallel} = {mp}"
        )
    need = max(p.trainer_gpus, p.rollout_gpus) if p.colocate else p.trainer_gpus + p.rollout_gpus
    layout = "colocated: max(trainer, rollout)" if p.colocate else "split: trainer + rollout"
    if need > total:
        errs.append(
            f"parallelism: the plan needs {need} {'GPUs' if p.device == 'cuda' else 'slots'} ({layout}) but "
            f"num_nodes x gpus_per_node = {p.num_nodes} x {p.gpus_per_node} = {total}"
        )
    if p.rollout_gpus < p.gpus_per_engine:
        errs.append(f"parallelism.rollout_gpus: {p.rollout_gpus} < gpus_per_engine={p.gpus_per_engine} gives 0 rollout "
                    "engines (at least one is needed)")
    elif p.rollout_gpus % p.gpus_per_engine:
        errs.append(f"parallelism.rollout_gpus: {p.rollout_gpus} is not divisible by gpus_per_engine={p.gpus_per_engine}")
    if p.gpus_per_engine > p.gpus_per_node and p.gpus_per_engine % p.gpus_per_node:
        errs.append(f"parallelism.gpus_per_engine: {p.gpus_per_engine} spans nodes, so it must be a multiple of gpus_per_node={p.gpus_per_node}")
    if p.colocate and p.rollout_gpus > p.trainer_gpus:
        errs.append(f"parallelism.rollout_gpus: {p.rollout_gpus} > trainer_gpus={p.trainer_gpus}; colocated engines must sit on trainer GPUs")
    if p.colocate and p.device == "cuda" and not (p.offload_train and p.offload_rollout):
        errs.append("parallelism.colocate: colocated GPUs need offload_train=true and offload_rollout=true (both share one GPU's memory)")
    arch = cfg.model.arch
    if arch.num_heads % p.tensor_parallel or arch.num_kv_heads % p.tensor_parallel and p.tensor_parallel % arch.num_kv_heads:
        errs.append(
            f"parallelism.tensor_parallel: {p.tensor_parallel} must divide num_heads={arch.num_heads} and "
            f"divide or be a multiple of num_kv_heads={arch.num_kv_heads}"
        )
    if arch.num_layers % p.pipeline_parallel:
        errs.append(f"parallelism.pipeline_parallel: {p.pipeline_parallel} does not divide num_layers={arch.num_layers}")
    if p.expert_parallel > 1 and (not arch.num_experts or arch.num_experts % p.expert_parallel):
        errs.append(f"parallelism.expert_parallel: {p.expert_parallel} must divide num_experts={arch.num_experts}")
    if p.sequence_parallel and p.tensor_parallel == 1:
        errs.append("parallelism.sequence_parallel: needs tensor_parallel > 1")
    if cfg.trainer.backend == "torch" and (mp > 1 or p.expert_parallel > 1):
        errs.append(
            "parallelism.tensor_parallel: the torch trainer backend is data-parallel only; "
            "tensor/pipeline/context/expert parallel sizes must be 1"
        )
    if p.device == "cpu" and p.colocate and p.offload_train:
        pass  # allowed: the embedded engine releases and resumes its memory on CPU too


def _validate_batches(cfg: RunConfig, errs: List[str]) -> None:
    r, t, p = cfg.rollout, cfg.trainer, cfg.parallelism
    for path, v in [("rollout.batch_size", r.batch_size), ("rollout.n_samples_per_prompt", r.n_samples_per_prompt),
                    ("trainer.micro_batch_size", t.micro_batch_size)]:
        if v < 1:
            errs.append(f"{path}: must be >= 1, got {v}")
    samples = r.batch_size * r.n_samples_per_prompt
    if t.global_batch_size is not None and t.num_steps_per_rollout is not None:
        if samples != t.global_batch_size * t.num_steps_per_rollout:
            errs.append(
                f"trainer.global_batch_size: rollout.batch_size x rollout.n_samples_per_prompt = {r.batch_size} x "
                f"{r.n_samples_per_prompt} = {samples} must equal trainer.global_batch_size x trainer.num_steps_per_rollout "
                f"= {t.global_batch_size} x {t.num_steps_per_rollout} = {t.global_batch_size * t.num_steps_per_rollout}"
            )
        mp = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
        dp = max(p.trainer_gpus // mp, 1)
        if t.global_batch_size % dp:
            errs.append(f"trainer.global_batch_size: {t.global_batch_size} is not divisible by the data-parallel size {dp}")
    if t.num_rollout is None and cfg.data.num_epoch is None:
        errs.append("trainer.num_rollout: set trainer.num_rollout or data.num_epoch")
    if t.num_rollout is not None and cfg.data.num_epoch is not None:
        errs.append("data.num_epoch: set only one of trainer.num_rollout and data.num_epoch")
    if t.num_rollout is not None and t.num_rollout < 0:
        errs.append(f"trainer.num_rollout: must be >= 0, got {t.num_rollout}")


def _validate_algo(cfg: RunConfig, errs: List[str]) -> None:
    from slime_hydra.train.algorithm_names import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, REDUCTIONS

    a = cfg.algo
    _choice(errs, "algo.advantage_estimator", a.advantage_estimator, ADVANTAGE_ESTIMATORS)
    _choice(errs, "algo.policy_loss", a.policy_loss, POLICY_LOSSES)
    _choice(errs, "algo.kl_loss_type", a.kl_loss_type, KL_ESTIMATORS)
    _choice(errs, "algo.loss_reduction", a.loss_reduction, REDUCTIONS)
    _choice(errs, "algo.lr_decay", a.lr_decay, ["constant", "cosine", "linear"])
    if a.kl_coef and a.kl_loss_coef:
        errs.append(f"algo.kl_coef: {a.kl_coef} and algo.kl_loss_coef: {a.kl_loss_coef} are both set; use KL as a reward (kl_coef) or as a loss (kl_loss_coef), not both")
    if a.use_rollout_logprobs and a.use_tis:
        errs.append("algo.use_tis: truncated importance sampling corrects rollout -> trainer log-probs, so it excludes algo.use_rollout_logprobs")
    if a.eps_clip_c is not None and a.eps_clip_c <= 1:
        errs.append(f"algo.eps_clip_c: the dual-clip constant must be > 1, got {a.eps_clip_c}")
    if a.eps_clip < 0 or (a.eps_clip_high is not None and a.eps_clip_high < 0):
        errs.append("algo.eps_clip: clip ranges must be >= 0")
    if a.lr <= 0:
        errs.append(f"algo.lr: must be > 0, got {a.lr}")
    if a.tis_clip_low > a.tis_clip:
        errs.append(f"algo.tis_clip_low: {a.tis_clip_low} > tis_clip={a.tis_clip}")
    if a.advantage_estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline") and not a.normalize_advantages:
        errs.append(f"algo.normalize_advantages: {a.advantage_estimator} needs advantage normalisation (set algo.normalize_advantages=true)")
    if a.kl_coef and a.advantage_estimator not in ("ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        errs.append(f"algo.kl_coef: KL reward shaping is used only by ppo and reinforce_plus_plus*, not {a.advantage_estimator} (use kl_loss_coef)")
    if not 0 <= a.gamma <= 1 or not 0 <= a.lambd <= 1:
        errs.append("algo.gamma: gamma and lambd must be in [0, 1]")
    if a.kl_coef < 0 or a.kl_loss_coef < 0:
        errs.append(f"algo.kl_coef: KL coefficients must be >= 0 (kl_coef={a.kl_coef}, kl_loss_coef={a.kl_loss_coef})")
    if a.advantage_estimator in ("gspo", "cispo") and a.policy_loss != a.advantage_estimator:
        errs.append(
            f"algo.policy_loss: advantage_estimator={a.advantage_estimator} is named after its policy loss, but "
            f"policy_loss={a.policy_loss}; set algo.policy_loss={a.advantage_estimator} (or advantage_estimator=grpo, "
            "whose advantages are the same)"
        )
    if a.eps_clip_c is not None and a.policy_loss == "cispo":
        errs.append("algo.eps_clip_c: dual clip bounds the clipped surrogate (ppo_clip, gspo); cispo has none, so unset it")
    if a.use_unbiased_kl and not a.kl_loss_coef:
        errs.append("algo.use_unbiased_kl: it reweights the KL loss, so it needs algo.kl_loss_coef > 0")
    if a.use_tis and (a.tis_clip <= 0 or a.tis_clip_low < 0):
        errs.append(f"algo.tis_clip: TIS clamps weights to [tis_clip_low >= 0, tis_clip > 0], got [{a.tis_clip_low}, {a.tis_clip}]")
    if a.advantage_estimator == "ppo":
        if a.value_clip <= 0:
            errs.append(f"algo.value_clip: must be > 0 for the critic loss, got {a.value_clip}")
        if a.critic_lr is not None and a.critic_lr <= 0:
            errs.append(f"algo.critic_lr: must be > 0, got {a.critic_lr}")
    if a.num_critic_only_steps < 0:
        errs.append(f"algo.num_critic_only_steps: must be >= 0, got {a.num_critic_only_steps}")
    elif a.num_critic_only_steps and a.advantage_estimator != "ppo":
        errs.append(f"algo.num_critic_only_steps: only advantage_estimator=ppo has a critic, not {a.advantage_estimator}")
    group_rewards = ADVANTAGE_ESTIMATORS.get(a.advantage_estimator)
    if group_rewards and a.normalize_rewards and cfg.rollout.n_samples_per_prompt == 1:
        errs.append(
            f"rollout.n_samples_per_prompt: 1 sample per prompt with algo.advantage_estimator={a.advantage_estimator} and "
            "algo.normalize_rewards=true subtracts each reward from itself, so every advantage is 0 "
            "(sample several per prompt, or use reinforce_plus_plus or ppo)"
        )


def _validate_rollout(cfg: RunConfig, errs: List[str]) -> None:
    r, p = cfg.rollout, cfg.parallelism
    _choice(errs, "rollout.engine", r.engine, ["embedded", "sglang"])
    _choice(errs, "rollout.router.policy", r.router.policy, ["round_robin", "random", "cache_aware", "power_of_two"])
    if r.temperature <= 0:
        errs.append(f"rollout.temperature: must be > 0 for training rollouts, got {r.temperature}")
    if not 0 < r.top_p <= 1:
        errs.append(f"rollout.top_p: must be in (0, 1], got {r.top_p}")
    if r.max_response_len < 1:
        errs.append(f"rollout.max_response_len: must be >= 1, got {r.max_response_len}")
    if r.max_response_len >= cfg.model.arch.max_position_embeddings:
        errs.append(f"rollout.max_response_len: {r.max_response_len} >= model.arch.max_position_embeddings={cfg.model.arch.max_position_embeddings}")
    if r.engine == "embedded" and p.gpus_per_engine != 1:
        errs.append(f"parallelism.gpus_per_engine: must be 1 for rollout.engine=embedded (it has no tensor parallelism), "
                    f"got {p.gpus_per_engine}")
    if not r.router.enabled and _num_engines(p) != 1:
        errs.append(f"rollout.router.enabled: false needs exactly one engine (the rollout manager talks to one URL), but "
                    f"parallelism.rollout_gpus / gpus_per_engine = {p.rollout_gpus} / {p.gpus_per_engine} = "
                    f"{_num_engines(p)} engines")
    if r.engine == "sglang" and p.device != "cuda":
        errs.append("rollout.engine: sglang needs parallelism.device=cuda (use rollout=embedded on CPU)")
    if r.engine == "sglang":
        from slime_hydra.rollout.sglang import MANAGED_SERVER_ARGS

        for key in r.server_args:
            if key in MANAGED_SERVER_ARGS:
                errs.append(f"rollout.server_args.{key}: set by slime_hydra from {MANAGED_SERVER_ARGS[key]}; remove it")
        import importlib.util

        if r.server_args and importlib.util.find_spec("sglang") is not None:  # the installed sglang's own parser
            from slime_hydra.rollout.sglang import check_server_args

            try:
                errs.extend(f"rollout.server_args.{key}: {problem}" for key, problem in check_server_args(dict(r.server_args)))
            except Exception as e:  # noqa: BLE001 - an sglang that does not import: the server will say more
                import logging

                logging.getLogger(__name__).warning("rollout.server_args not checked: sglang's ServerArgs did not import (%s: %s)",
                                                    type(e).__name__, e)
    if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < r.batch_size:
        errs.append(f"rollout.over_sampling_batch_size: {r.over_sampling_batch_size} < rollout.batch_size={r.batch_size}")
    from slime_hydra.rollout.filters import dynamic_filter_spec

    spec = dynamic_filter_spec(cfg)
    if r.partial_rollout and spec is None and (r.over_sampling_batch_size or r.batch_size) <= r.batch_size:
        errs.append("rollout.partial_rollout: recycles groups cut off by dynamic sampling or over-sampling, so it needs "
                    "rollout.dynamic_filter, algo.dynamic_sampling=true or rollout.over_sampling_batch_size > rollout.batch_size")
    target = spec.get("_target_") if hasattr(spec, "get") else spec
    if r.n_samples_per_prompt < 2 and isinstance(target, str) and target.startswith("slime_hydra.rollout.filters.nonzero_reward_std"):
        where = "rollout.dynamic_filter" if r.dynamic_filter is not None else "algo.dynamic_sampling"
        errs.append(f"{where}: nonzero_reward_std drops groups whose rewards are all equal, which is every group of "
                    "rollout.n_samples_per_prompt=1 (sample several per prompt)")
    if r.max_sampled_groups is not None and r.max_sampled_groups < r.batch_size:
        errs.append(f"rollout.max_sampled_groups: {r.max_sampled_groups} < rollout.batch_size={r.batch_size}")
    if r.mask_offpolicy_in_partial_rollout and not r.partial_rollout:
        errs.append("rollout.mask_offpolicy_in_partial_rollout: masks tokens of continued partial rollouts, so it needs "
                    "rollout.partial_rollout=true")


def _validate_data(cfg: RunConfig, errs: List[str]) -> None:
    # Dataset files are parsed here with the rollout manager's own reader (every row: JSON, keys, types), so a bad
    # row fails before Ray starts rather than minutes later. That costs one read of each file, which the manager
    # does anyway (measured: 0.07 s for 10k rows, 3 MB); rendering the chat template is left to the manager (it
    # needs the tokenizer, too slow to load here). The default (built-in task) reads no file.
    from slime_hydra.data.source import load_rows

    d = cfg.data
    if not _choice(errs, "data.source", d.source, ["builtin", "jsonl"]):
        return
    if d.source == "builtin":
        from slime_hydra.data.tasks import TASK_TOKENIZERS, TASKS

        if _choice(errs, "data.task", d.task, TASKS):
            if cfg.model.tokenizer != TASK_TOKENIZERS[d.task]:
                errs.append(f"model.tokenizer: the built-in task {d.task} is written in the {TASK_TOKENIZERS[d.task]} "
                            f"vocabulary, but model.tokenizer={cfg.model.tokenizer!r} (train model={cfg.model.name} on "
                            "your data: data=jsonl data.path=...)")
            space = TASKS[d.task][0]  # what data.tasks.make_splits draws disjoint train and held-out prompts from
            if d.num_train < 1 or d.num_eval < 0:
                errs.append(f"data.num_train: must be >= 1 (and data.num_eval >= 0), got {d.num_train} and {d.num_eval}")
            elif d.num_train + d.num_eval > space:
                errs.append(f"data.num_train: data.num_train + data.num_eval = {d.num_train} + {d.num_eval} = "
                            f"{d.num_train + d.num_eval} must be <= {space}, the number of distinct {d.task} prompts "
                            "(held-out prompts are never training prompts)")
    else:
        if not d.path:
            errs.append("data.path: required for data.source=jsonl")
        elif not os.path.isfile(os.path.expanduser(_data_file(d.path))):
            errs.append(f"data.path: {_data_file(d.path)!r} does not exist (a .jsonl or .parquet file)")
        else:
            _loads(errs, "data.path", lambda: load_rows(d))
    if d.num_epoch is not None and d.num_epoch < 1:
        errs.append(f"data.num_epoch: must be >= 1, got {d.num_epoch}")
    for i, ds in enumerate(cfg.eval.datasets):
        where = f"eval.datasets[{i}]"
        if ds.path is None and d.source != "builtin":
            errs.append(f"{where}.path: required (only the built-in task has an implicit held-out split)")
        if ds.path is not None and not os.path.isfile(os.path.expanduser(_data_file(ds.path))):
            errs.append(f"{where}.path: {_data_file(ds.path)!r} does not exist")
        elif ds.path is not None:
            _loads(errs, f"{where}.path", lambda ds=ds: load_rows(d, split="eval", path=ds.path, input_key=ds.input_key,
                                                                label_key=ds.label_key))
        if ds.temperature < 0:
            errs.append(f"{where}.temperature: must be >= 0, got {ds.temperature}")
        if ds.n_samples_per_prompt < 1:
            errs.append(f"{where}.n_samples_per_prompt: must be >= 1, got {ds.n_samples_per_prompt}")
    names = [ds.name for ds in cfg.eval.datasets]
    if len(set(names)) != len(names):
        errs.append(f"eval.datasets: names must be unique, got {names}")


def _validate_misc(cfg: RunConfig, errs: List[str]) -> None:
    t, p, s = cfg.trainer, cfg.parallelism, cfg.sync
    _choice(errs, "trainer.backend", t.backend, ["torch"])
    _choice(errs, "trainer.mode", t.mode, ["sync", "async"])
    _choice(errs, "sync.transport", s.transport, ["distributed", "tensor", "disk"])
    _choice(errs, "logging.wandb_mode", cfg.logging.wandb_mode, ["auto", "online", "offline", "disabled"])
    _choice(errs, "reward.type", cfg.reward.type, ["exact", "math", "f1", "remote", "custom"])
    if t.mode == "async" and p.colocate:
        errs.append("trainer.mode: async (one-step off-policy) overlaps rollout and training, so it needs parallelism.colocate=false")
    if s.transport == "tensor" and not p.colocate:
        errs.append("sync.transport: 'tensor' shares memory between processes on the same device, so it needs parallelism.colocate=true")
    if t.update_weights_interval < 1:
        errs.append(f"trainer.update_weights_interval: must be >= 1, got {t.update_weights_interval}")
    if t.update_weights_interval > 1 and t.mode != "async":
        errs.append("trainer.update_weights_interval: > 1 only makes sense with trainer.mode=async")
    if t.save_interval < 0 or cfg.eval.interval < 0:
        errs.append("trainer.save_interval: intervals must be >= 0")
    if t.keep_checkpoints < 1:
        errs.append(f"trainer.keep_checkpoints: must be >= 1, got {t.keep_checkpoints}")
    if s.transport == "tensor" and p.colocate and p.num_nodes > 1:  # 'auto' resolves to 'tensor' when colocated
        errs.append(f"sync.transport: 'tensor' (the colocated default) hands the engines CUDA IPC / shared-memory handles, "
                    f"which cannot cross nodes, but parallelism.num_nodes={p.num_nodes}; use parallelism.colocate=false "
                    "or sync.transport=disk (on a filesystem shared by the nodes)")
    if t.resume not in (None, "auto"):
        _validate_resume(t.resume, cfg.output_dir, errs)
    if cfg.reward.type == "remote" and not cfg.reward.url:
        errs.append("reward.url: required for reward.type=remote")
    if cfg.reward.type == "custom" and cfg.reward.custom is None:
        errs.append("reward.custom: required for reward.type=custom (a _target_ node or a dotted path)")


def _validate_resume(resume: str, run_dir: Any, errs: List[str]) -> None:
    """``trainer.resume`` names a directory: it must hold the checkpoint that the driver's ``find_checkpoint`` picks."""
    from slime_hydra.checkpoint.ckpt import find_checkpoint

    if not os.path.isdir(os.path.expanduser(resume)):
        errs.append(f"trainer.resume: {resume!r} is not a directory (a checkpoint, a run directory, or 'auto')")
        return
    try:
        ckpt = find_checkpoint(resume, run_dir or "")
    except FileNotFoundError as e:
        errs.append(str(e))  # "trainer.resume: '<path>' holds no checkpoint (no meta.json, no checkpoints/latest)"
        return
    if not os.path.isfile(os.path.join(ckpt, "meta.json")):
        errs.append(f"trainer.resume: {resume!r} names {ckpt!r} in checkpoints/latest, which has no meta.json "
                    "(an incomplete or deleted checkpoint)")


def _validate_hooks(cfg: RunConfig, errs: List[str]) -> None:
    """Import every user hook as the rollout manager and the reward hub will (``utils.hooks.load_hook``), so
    a typo in a dotted path or ``_target_`` fails here, with its config key, and not after Ray has started."""
    from slime_hydra.utils.hooks import load_hook

    hooks = {"rollout.generate": cfg.rollout.generate, "rollout.dynamic_filter": cfg.rollout.dynamic_filter,
             "data.buffer_filter": cfg.data.buffer_filter, "reward.custom": cfg.reward.custom}
    for where, spec in hooks.items():
        if spec is not None:
            _loads(errs, where, lambda spec=spec: load_hook(spec))
