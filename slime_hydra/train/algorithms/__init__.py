"""RL algorithms as pure torch functions: reward post-processing, advantage estimators, policy and
value losses, KL estimators and the loss reduction. No Ray, HTTP or model code here.

Registries (adding a variant is one function plus one registry line, and its name in
``slime_hydra/train/algorithm_names.py``, which config validation reads without importing torch):
``ADVANTAGE_ESTIMATORS`` (``@register`` in advantages.py), ``POLICY_LOSSES`` (losses.py),
``KL_ESTIMATORS`` (kl.py), ``REDUCTIONS`` (reduce.py). Dr. GRPO and DAPO are presets of ``grpo``
(``conf/algo/dr_grpo.yaml``, ``conf/algo/dapo.yaml``), not estimators.

Inputs the trainer must provide, per ``AlgoConfig``:

- ``needs_ref(algo)``: reference log-probs, for ``kl_coef`` (shaping, in ``compute_advantages``)
  or ``kl_loss_coef`` (loss term, in ``policy_loss``);
- ``needs_critic(algo)``: critic values (``advantage_estimator == "ppo"``) and ``value_loss``;
- ``algo.use_tis``: rollout log-probs in ``policy_loss``; ``algo.entropy_coef``: the entropy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slime_hydra.train.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    generalized_advantages,
    normalize_group_rewards,
    register,
    response_lengths,
    rewards_for_estimator,
)
from slime_hydra.train.algorithms.kl import KL_ESTIMATORS
from slime_hydra.train.algorithms.losses import POLICY_LOSSES, explained_variance, policy_loss, value_loss
from slime_hydra.train.algorithms.reduce import REDUCTIONS, Reducer, masked_mean, masked_whiten

if TYPE_CHECKING:
    from slime_hydra.config.schema import AlgoConfig


def needs_ref(algo: "AlgoConfig") -> bool:
    """Whether reference-model log-probs are needed (a KL reward or a KL loss)."""
    return bool(algo.kl_coef or algo.kl_loss_coef)


def needs_critic(algo: "AlgoConfig") -> bool:
    """Whether a critic (value model) is trained and its values fed to ``compute_advantages``."""
    return algo.advantage_estimator == "ppo"


__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "REDUCTIONS",
    "Reducer",
    "compute_advantages",
    "discounted_returns",
    "explained_variance",
    "generalized_advantages",
    "masked_mean",
    "masked_whiten",
    "needs_critic",
    "needs_ref",
    "normalize_group_rewards",
    "policy_loss",
    "register",
    "response_lengths",
    "rewards_for_estimator",
    "value_loss",
]
