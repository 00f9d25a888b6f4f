"""RL algorithms as pure torch functions: reward post-processing, advantage estimators, policy and value
losses, KL estimators and the loss reduction; no Ray, HTTP or model code. The registries below are the one
list of each kind of name (the config rules check ``algo.*`` against them) and import a function on first
use, so this package imports no torch until then. A variant is its function plus its line here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional

from slime_hydra.utils.registry import LazyRegistry, lazy_attributes

if TYPE_CHECKING:
    from slime_hydra.config.schema import AlgoConfig

# advantage_estimator -> (its function in advantages.py, how the rollout manager normalises rewards within a
# prompt's group when algo.normalize_rewards: None keeps the raw rewards, "mean" subtracts the group mean,
# "mean_std" also divides by the group std when algo.normalize_std; see advantages.rewards_for_estimator).
# An estimator is f(algo, *, rewards, mask, kl, values) -> (advantages, returns), in advantages.py unless its
# module is named (distill.py: SFT and on-policy distillation).
_ESTIMATORS = {
    "grpo": ("group_relative", "mean_std"),
    "gspo": ("group_relative", "mean_std"),
    "cispo": ("group_relative", "mean_std"),
    "ppo": ("ppo_gae", None),
    "reinforce_plus_plus": ("reinforce_plus_plus", None),
    "reinforce_plus_plus_baseline": ("reinforce_plus_plus_baseline", "mean"),
    "sft": ("distill:sft", None),
    "opd": ("distill:opd", "mean_std"),
}
ADVANTAGE_ESTIMATORS = LazyRegistry("advantage estimator", {
    name: f"{__name__}.{function if ':' in function else 'advantages:' + function}"
    for name, (function, _) in _ESTIMATORS.items()})
GROUP_REWARDS: Dict[str, Optional[str]] = {name: mode for name, (_, mode) in _ESTIMATORS.items()}
# policy_loss -> per-token f(algo, *, log_probs, old_log_probs, advantages, mask) -> (loss, clipped, kl)
POLICY_LOSSES = LazyRegistry("policy loss", {**{n: f"{__name__}.losses:{n}" for n in ("ppo_clip", "gspo", "cispo")},
                                             "sft": f"{__name__}.distill:sft_loss"})
# kl_loss_type -> per-token f(log_probs, ref_log_probs) -> KL estimate   (kl.py)
KL_ESTIMATORS = LazyRegistry("KL estimator", {n: f"{__name__}.kl:{n}" for n in ("k1", "k2", "k3", "low_var_kl")})
# loss_reduction: the branches of reduce.Reducer
REDUCTIONS = ("sample_mean", "token_mean", "token_sum")


def needs_ref(algo: "AlgoConfig") -> bool:
    """Whether reference-model log-probs are needed (a KL reward or a KL loss)."""
    return bool(algo.kl_coef or algo.kl_loss_coef)


def is_sft(algo: "AlgoConfig") -> bool:
    """Supervised fine-tuning: the samples are labels, not the policy's, so no old or rollout log-probs."""
    return algo.advantage_estimator == "sft"


def needs_teacher(algo: "AlgoConfig") -> bool:
    """On-policy distillation: the teacher's log-probs of the sampled tokens make the advantages."""
    return algo.advantage_estimator == "opd"


def needs_critic(algo: "AlgoConfig") -> bool:
    """Whether a critic (value model) is trained and its values fed to ``compute_advantages``."""
    return algo.advantage_estimator == "ppo"


# The torch functions, imported from their modules on first access.
__getattr__ = lazy_attributes(__name__, {
    **dict.fromkeys(("compute_advantages", "discounted_returns", "generalized_advantages", "normalize_group_rewards",
                     "overlong_penalty", "response_lengths", "rewards_for_estimator"), "advantages"),
    **dict.fromkeys(("explained_variance", "policy_loss", "value_loss"), "losses"),
    **dict.fromkeys(("Reducer", "masked_whiten"), "reduce"),
})
