"""SFT and on-policy distillation as an estimator and a policy loss each, so that they run through the same
step, micro-batching and reduction as RL.

- ``sft``: every response token's advantage is 1 and the loss is ``-log pi_theta(a_t)``: the masked
  cross-entropy of the response (slime's ``sft_loss``), reduced by ``algo.loss_reduction``.
- ``opd``: the student's own samples scored by a teacher; the per-token advantage is the negative reverse KL,
  ``A_t = log p_teacher(a_t) - log p_student(a_t)``, not discounted (Thinking Machines' "On-Policy
  Distillation"; slime's ``--use-opd``), plus ``algo.opd_reward_weight`` times the group-normalised task
  reward. ``kl`` here is ``log p_student - log p_teacher`` (``compute_advantages`` with ``ref_log_probs`` the
  teacher's); the loss is the usual clipped surrogate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from torch import Tensor

if TYPE_CHECKING:
    from slime_hydra.config.schema import AlgoConfig


def sft(algo: "AlgoConfig", *, rewards: Tensor, mask: Tensor, kl: Tensor, values: Optional[Tensor]):
    """Advantage 1 on every response token: the loss weighs each label token alike."""
    return mask.clone(), mask.clone()


def opd(algo: "AlgoConfig", *, rewards: Tensor, mask: Tensor, kl: Tensor, values: Optional[Tensor]):
    """``A_t = -(log p_student - log p_teacher)_t + opd_reward_weight * r~_i`` on response tokens."""
    adv = (algo.opd_reward_weight * rewards[:, None] - kl) * mask
    return adv, adv.clone()


def sft_loss(algo: "AlgoConfig", *, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor):
    """``-A_t log pi_theta(a_t)`` (``A_t = 1``: the cross-entropy of the response tokens); no clip, no ratio."""
    zero = log_probs.detach() * 0
    return -advantages * log_probs, zero, zero
