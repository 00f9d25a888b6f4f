"""Config rules of the RL algorithm (``algo.*``): names from this package's registries, the exclusive and
dependent options of the losses, and what the estimators need from the rollout."""

from __future__ import annotations

import os
from typing import List

from slime_hydra.config.rules import choice, looks_local
from slime_hydra.config.schema import RunConfig
from slime_hydra.train.algorithms import ADVANTAGE_ESTIMATORS, GROUP_REWARDS, KL_ESTIMATORS, POLICY_LOSSES, REDUCTIONS

LR_DECAYS = ["constant", "cosine", "linear"]


def check(cfg: RunConfig) -> List[str]:
    errs: List[str] = []
    a = cfg.algo
    choice(errs, "algo.advantage_estimator", a.advantage_estimator, ADVANTAGE_ESTIMATORS)
    choice(errs, "algo.policy_loss", a.policy_loss, POLICY_LOSSES)
    choice(errs, "algo.kl_loss_type", a.kl_loss_type, KL_ESTIMATORS)
    choice(errs, "algo.loss_reduction", a.loss_reduction, REDUCTIONS)
    choice(errs, "algo.lr_decay", a.lr_decay, LR_DECAYS)
    if a.kl_coef and a.kl_loss_coef:
        errs.append(f"algo.kl_coef: {a.kl_coef} and algo.kl_loss_coef: {a.kl_loss_coef} are both set; use KL as a "
                    "reward (kl_coef) or as a loss (kl_loss_coef), not both")
    if a.use_rollout_logprobs and a.use_tis:
        errs.append("algo.use_tis: truncated importance sampling corrects rollout -> trainer log-probs, so it excludes "
                    "algo.use_rollout_logprobs")
    if a.eps_clip_c is not None and a.eps_clip_c <= 1:
        errs.append(f"algo.eps_clip_c: the dual-clip constant must be > 1, got {a.eps_clip_c}")
    if a.eps_clip < 0 or (a.eps_clip_high is not None and a.eps_clip_high < 0):
        errs.append("algo.eps_clip: clip ranges must be >= 0")
    if a.lr <= 0:
        errs.append(f"algo.lr: must be > 0, got {a.lr}")
    if a.tis_clip_low > a.tis_clip:
        errs.append(f"algo.tis_clip_low: {a.tis_clip_low} > tis_clip={a.tis_clip}")
    if a.advantage_estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline") and not a.normalize_advantages:
        errs.append(f"algo.normalize_advantages: {a.advantage_estimator} needs advantage normalisation "
                    "(set algo.normalize_advantages=true)")
    if a.kl_coef and a.advantage_estimator not in ("ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        errs.append(f"algo.kl_coef: KL reward shaping is used only by ppo and reinforce_plus_plus*, not "
                    f"{a.advantage_estimator} (use kl_loss_coef)")
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
        errs.append("algo.eps_clip_c: dual clip bounds the clipped surrogate (ppo_clip, gspo); cispo has none, so "
                    "unset it")
    if a.kl_loss_coef and a.kl_loss_type == "k1" and not a.use_unbiased_kl:
        errs.append("algo.kl_loss_type: k1 as a loss trains nothing: its gradient is grad log pi, zero in expectation "
                    "on-policy, so kl_loss_coef would not pull the policy towards the reference. Use low_var_kl or "
                    "k2 (k1 is for the KL reward, kl_coef), or algo.use_unbiased_kl=true, whose ratio weight gives "
                    "k1 the true gradient")
    if a.overlong_buffer_len < 0 or a.overlong_penalty_factor < 0:
        errs.append(f"algo.overlong_buffer_len: the buffer and algo.overlong_penalty_factor must be >= 0, got "
                    f"{a.overlong_buffer_len} and {a.overlong_penalty_factor}")
    elif a.overlong_buffer_len >= cfg.rollout.max_response_len:
        errs.append(f"algo.overlong_buffer_len: {a.overlong_buffer_len} must be < rollout.max_response_len="
                    f"{cfg.rollout.max_response_len} (the penalty starts that many tokens before the limit)")
    if a.use_unbiased_kl and not a.kl_loss_coef:
        errs.append("algo.use_unbiased_kl: it reweights the KL loss, so it needs algo.kl_loss_coef > 0")
    if a.use_tis and (a.tis_clip <= 0 or a.tis_clip_low < 0):
        errs.append(f"algo.tis_clip: TIS clamps weights to [tis_clip_low >= 0, tis_clip > 0], got "
                    f"[{a.tis_clip_low}, {a.tis_clip}]")
    if a.advantage_estimator == "ppo":
        if a.value_clip <= 0:
            errs.append(f"algo.value_clip: must be > 0 for the critic loss, got {a.value_clip}")
        if a.critic_lr is not None and a.critic_lr <= 0:
            errs.append(f"algo.critic_lr: must be > 0, got {a.critic_lr}")
    if a.num_critic_only_steps < 0:
        errs.append(f"algo.num_critic_only_steps: must be >= 0, got {a.num_critic_only_steps}")
    elif a.num_critic_only_steps and a.advantage_estimator != "ppo":
        errs.append(f"algo.num_critic_only_steps: only advantage_estimator=ppo has a critic, not "
                    f"{a.advantage_estimator}")
    errs.extend(distill_problems(cfg))
    group_rewards = GROUP_REWARDS.get(a.advantage_estimator)
    if a.advantage_estimator == "opd" and not a.opd_reward_weight:
        group_rewards = None  # the reward plays no part
    if group_rewards and a.normalize_rewards and cfg.rollout.n_samples_per_prompt == 1:
        errs.append(
            f"rollout.n_samples_per_prompt: 1 sample per prompt with algo.advantage_estimator={a.advantage_estimator} "
            "and algo.normalize_rewards=true subtracts each reward from itself, so every advantage is 0 "
            "(sample several per prompt, or use reinforce_plus_plus or ppo)"
        )
    return errs


def distill_problems(cfg: RunConfig) -> List[str]:
    """SFT's estimator and loss go together; on-policy distillation needs a teacher that reads the student's
    tokens as the student does (the same tokenizer: its log-probs are of the same token ids)."""
    a, t, errs = cfg.algo, cfg.teacher, []
    if (a.advantage_estimator == "sft") != (a.policy_loss == "sft"):
        errs.append(f"algo.policy_loss: advantage_estimator={a.advantage_estimator} with policy_loss={a.policy_loss}; "
                    "SFT is both (algo=sft) or neither")
    if a.advantage_estimator == "sft" and cfg.rollout.n_samples_per_prompt != 1:
        errs.append(f"rollout.n_samples_per_prompt: algo=sft trains on each row's label once, not "
                    f"{cfg.rollout.n_samples_per_prompt} copies of it (set rollout.n_samples_per_prompt=1)")
    if a.opd_reward_weight and a.advantage_estimator != "opd":
        errs.append(f"algo.opd_reward_weight: only algo.advantage_estimator=opd reads it, not {a.advantage_estimator}")
    if a.advantage_estimator != "opd":
        if t.path is not None:
            errs.append(f"teacher.path: only algo=opd uses a teacher, not {a.advantage_estimator}")
        return errs
    if t.path is None:
        return errs + ["teacher.path: algo=opd distils from a teacher: set teacher.path to its HF checkpoint"]
    p = cfg.parallelism
    split = {k: v for k, v in (("tensor_parallel", p.tensor_parallel), ("pipeline_parallel", p.pipeline_parallel),
                               ("context_parallel", p.context_parallel)) if v > 1}
    if cfg.trainer.backend == "megatron" and split:
        errs.append(f"parallelism.{next(iter(split))}: algo=opd's teacher sits beside each trainer rank as a whole "
                    f"model, so with {', '.join(f'{k}={v}' for k, v in split.items())} every model-parallel rank "
                    "would hold the whole teacher and score the same rows again; distil with data parallel only "
                    "(tensor/pipeline/context_parallel=1) or trainer=torch with trainer.strategy=fsdp")
    if cfg.parallelism.device == "cuda" and not t.arch.num_layers:
        errs.append("teacher.arch: the memory plan counts the teacher on every trainer GPU and needs its shape: give "
                    "its model preset (+model@teacher=qwen3_4b teacher.path=...) or the teacher.arch.* keys")
    if looks_local(t.path) and not os.path.isdir(os.path.expanduser(t.path)):
        return errs + [f"teacher.path: {t.path!r} is not a directory (a local Hugging Face checkpoint, or a hub id)"]
    errs.extend(tokenizer_mismatch(cfg))
    return errs


def tokenizer_mismatch(cfg: RunConfig) -> List[str]:
    """The student's and the teacher's tokenizers compared by vocabulary (token -> id) and end-of-sequence id,
    where both are on this machine (a hub id is not downloaded to check)."""
    from slime_hydra.data.tokenizer import load_tokenizer

    student = cfg.model.tokenizer or cfg.model.path
    teacher = cfg.teacher.tokenizer or cfg.teacher.path
    if student is None or not all(n.startswith("builtin:") or looks_local(n) for n in (student, teacher)):
        return []
    try:
        s, t = (load_tokenizer(n, cfg.model.trust_remote_code) for n in (student, teacher))
    except Exception as e:  # noqa: BLE001 - any loader error is the user's file
        return [f"teacher.tokenizer: could not load {teacher!r} or the student's {student!r}: {e}"]
    if s.get_vocab() != t.get_vocab() or s.eos_token_id != t.eos_token_id:
        return [f"teacher.tokenizer: the teacher's tokenizer {teacher!r} differs from the student's {student!r} "
                f"({len(t.get_vocab())} vs {len(s.get_vocab())} tokens, eos {t.eos_token_id} vs {s.eos_token_id}); "
                "on-policy distillation compares log-probs of the same token ids, so both must use one tokenizer "
                "(set teacher.tokenizer when the checkpoint's is the same under another name)"]
    return []
