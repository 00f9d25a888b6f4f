"""Advantage estimators and the reward post-processing that goes with them. An estimator is
``f(algo, *, rewards, mask, kl, values) -> (advantages, returns)``, ``[B, T]`` float32; sample ``i``'s
response is positions ``t < L_i`` with ``L_i - 1`` its last masked position, so mask-0 tokens inside a
response (tool output) still take part in discounting, as in slime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Tuple

import torch
from torch import Tensor

from slime_hydra.train.algorithms import ADVANTAGE_ESTIMATORS, GROUP_REWARDS, KL_ESTIMATORS
from slime_hydra.train.algorithms.reduce import masked_whiten

if TYPE_CHECKING:
    from slime_hydra.config.schema import AlgoConfig


def normalize_group_rewards(rewards: Tensor, group_size: int, subtract_mean: bool, divide_std: bool,
                            eps: float = 1e-6) -> Tensor:
    """GRPO's group normalisation (DeepSeekMath, arXiv 2402.03300, sec. 4.1.2). ``rewards`` is flat ``[N]``,
    consecutive runs of ``group_size`` samples share a prompt:
    ``r~_i = (r_i - mean_g) / (std_g + eps)`` with the unbiased std (``torch.std``, as slime).
    A group of one sample has no std: the division is skipped (the mean subtraction gives 0)."""
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.float().reshape(-1, group_size)
    out = groups
    if subtract_mean:
        out = out - groups.mean(dim=1, keepdim=True)
    if divide_std and group_size > 1:
        out = out / (groups.std(dim=1, keepdim=True) + eps)
    return out.reshape(-1)


def overlong_penalty(algo: "AlgoConfig", response_lengths: Tensor, max_response_len: int) -> Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), one value per sample: 0 up to
    ``max_response_len - algo.overlong_buffer_len`` tokens, then falling linearly to
    ``-algo.overlong_penalty_factor`` at ``max_response_len``; zeros when ``overlong_buffer_len`` is 0."""
    lengths = response_lengths.float()
    if not algo.overlong_buffer_len:
        return torch.zeros_like(lengths)
    excess = (lengths - (max_response_len - algo.overlong_buffer_len)).clamp(min=0)
    return -algo.overlong_penalty_factor * (excess / algo.overlong_buffer_len).clamp(max=1.0)


def rewards_for_estimator(algo: "AlgoConfig", rewards: Tensor, group_size: int) -> Tensor:
    """The rollout manager's reward post-processing (slime ``_post_process_rewards``): group mean
    (and std) normalisation as the estimator's ``GROUP_REWARDS`` entry says, when
    ``algo.normalize_rewards``; the raw rewards (as float32) otherwise."""
    mode = GROUP_REWARDS[algo.advantage_estimator]
    if not algo.normalize_rewards or mode is None:
        return rewards.float().clone()
    divide_std = mode == "mean_std" and algo.normalize_std
    return normalize_group_rewards(rewards, group_size, subtract_mean=True, divide_std=divide_std)


def response_lengths(mask: Tensor) -> Tensor:
    """``L_i`` = 1 + the last position with a non-zero mask (0 for an empty mask), ``[B]`` long."""
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return ((mask != 0).long() * positions).amax(dim=-1)


def add_at_last_token(token_rewards: Tensor, rewards: Tensor, lengths: Tensor) -> Tensor:
    """``token_rewards[i, L_i - 1] += rewards[i]`` for samples with ``L_i > 0``."""
    out = token_rewards.clone()
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    out[rows, lengths[rows] - 1] += rewards[rows].to(out.dtype)
    return out


def discounted_returns(token_rewards: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` along the last dim (``G_T = 0``)."""
    if gamma == 1.0:
        return token_rewards.flip(-1).cumsum(-1).flip(-1)
    out = torch.empty_like(token_rewards)
    running = torch.zeros_like(token_rewards[..., 0])
    for t in range(token_rewards.shape[-1] - 1, -1, -1):
        running = token_rewards[..., t] + gamma * running
        out[..., t] = running
    return out


def generalized_advantages(token_rewards: Tensor, values: Tensor, gamma: float, lambd: float) -> Tensor:
    """GAE (arXiv 1506.02438): ``A_t = delta_t + gamma lambda A_{t+1}``, ``delta_t = r_t + gamma V_{t+1} - V_t``."""
    next_values = torch.cat([values[..., 1:], torch.zeros_like(values[..., :1])], dim=-1)
    return discounted_returns(token_rewards + gamma * next_values - values, gamma * lambd)


def group_relative(algo: "AlgoConfig", *, rewards: Tensor, mask: Tensor, kl: Tensor, values: Optional[Tensor]):
    """Outcome supervision with a group baseline, ``A_it = r~_i`` on every response token: GRPO (arXiv
    2402.03300), GSPO (arXiv 2507.18071) and CISPO (arXiv 2506.13585) share it and differ in the policy loss.
    As in slime, ``kl_coef`` plays no part here (use ``kl_loss_coef``). ``returns = advantages``."""
    adv = rewards[:, None] * mask
    return adv, adv.clone()


def ppo_gae(algo: "AlgoConfig", *, rewards: Tensor, mask: Tensor, kl: Tensor, values: Optional[Tensor]):
    """PPO for RLHF (Ouyang et al., arXiv 2203.02155; PPO arXiv 1707.06347) with GAE. Token rewards
    ``r_t = -kl_coef * kl_t``, plus the scalar reward on the last response token; GAE with ``algo.gamma`` and
    ``algo.lambd`` over ``t < L_i`` on the critic's ``values`` (0 at padding); ``returns = A + V``."""
    if values is None:
        raise ValueError("advantage_estimator 'ppo' needs the critic's values")
    lengths = response_lengths(mask)
    in_response = (torch.arange(mask.shape[-1], device=mask.device)[None, :] < lengths[:, None]).float()
    v = values.float() * in_response
    token_rewards = add_at_last_token(-algo.kl_coef * kl, rewards, lengths) * in_response
    adv = generalized_advantages(token_rewards, v, algo.gamma, algo.lambd)
    return adv * mask, (adv + v) * mask


def reinforce_plus_plus(algo: "AlgoConfig", *, rewards: Tensor, mask: Tensor, kl: Tensor, values: Optional[Tensor]):
    """REINFORCE++ (Hu, arXiv 2501.03262): token rewards ``r_t = -kl_coef * kl_t * m_t`` plus the
    scalar reward at the last masked token; ``A_t = G_t = sum_k gamma^k r_{t+k}``. Meant to be
    used with ``normalize_advantages`` (global batch whitening replaces the critic)."""
    token_rewards = add_at_last_token(-algo.kl_coef * kl * mask, rewards, response_lengths(mask))
    returns = discounted_returns(token_rewards, algo.gamma) * mask
    return returns, returns.clone()


def reinforce_plus_plus_baseline(algo: "AlgoConfig", *, rewards: Tensor, mask: Tensor, kl: Tensor,
                                 values: Optional[Tensor]):
    """REINFORCE++-baseline (arXiv 2501.03262): ``A_t = (r_i - mean_group) - kl_coef * kl_t``, then whitened."""
    adv = (rewards[:, None] - algo.kl_coef * kl) * mask
    return adv, adv.clone()


def compute_advantages(algo: "AlgoConfig", *, rewards: Tensor, loss_mask: Tensor, old_log_probs: Tensor,
                       ref_log_probs: Optional[Tensor] = None, values: Optional[Tensor] = None,
                       all_reduce: Optional[Callable[[Tensor], Tensor]] = None,
                       teacher_log_probs: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Advantages and returns ``[B, T]`` (float32, zero where the mask is 0, no gradient) from
    ``ADVANTAGE_ESTIMATORS[algo.advantage_estimator]``, with the shaping KL ``kl_t =
    KL_ESTIMATORS[algo.kl_loss_type](old_log_probs, ref_log_probs) * m_t`` when ``algo.kl_coef`` (slime uses
    the same estimator for shaping and loss). With ``teacher_log_probs`` (on-policy distillation) ``kl_t`` is the
    reverse KL to the teacher, ``(old_log_probs - teacher_log_probs) * m_t``. ``algo.normalize_advantages``: masked
    whitening of the advantages, over every data-parallel rank's samples with ``all_reduce`` (a sum over ranks)."""
    estimator = ADVANTAGE_ESTIMATORS[algo.advantage_estimator]
    with torch.no_grad():
        mask = loss_mask.float()
        if teacher_log_probs is not None:
            kl = (old_log_probs.float() - teacher_log_probs.float()) * mask
        elif algo.kl_coef:
            if ref_log_probs is None:
                raise ValueError("algo.kl_coef != 0 needs ref_log_probs")
            kl = KL_ESTIMATORS[algo.kl_loss_type](old_log_probs, ref_log_probs) * mask
        else:
            kl = torch.zeros_like(mask)
        rewards = rewards.detach().float().to(mask.device)
        values = None if values is None else values.detach().float()
        adv, ret = estimator(algo, rewards=rewards, mask=mask, kl=kl, values=values)
        if algo.normalize_advantages:
            adv = masked_whiten(adv, mask, all_reduce=all_reduce)
        return adv * mask, ret * mask
