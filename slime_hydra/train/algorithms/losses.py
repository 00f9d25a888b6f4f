"""Policy-gradient losses, the total actor loss, the critic loss and explained variance. A policy loss is
``f(algo, *, log_probs, old_log_probs, advantages, mask) -> (loss_t, clipfrac_t, ppo_kl_t)`` per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch
from torch import Tensor

from slime_hydra.train.algorithms import KL_ESTIMATORS, POLICY_LOSSES
from slime_hydra.train.algorithms.reduce import Reducer, _masked

if TYPE_CHECKING:
    from slime_hydra.config.schema import AlgoConfig

Metrics = Dict[str, Tensor]


def _clip_range(algo: "AlgoConfig") -> Tuple[float, float]:
    high = algo.eps_clip if algo.eps_clip_high is None else algo.eps_clip_high
    return 1.0 - algo.eps_clip, 1.0 + high


def clipped_surrogate(log_ratio: Tensor, advantages: Tensor, algo: "AlgoConfig") -> Tuple[Tensor, Tensor]:
    """PPO's clipped surrogate (arXiv 1707.06347) with asymmetric "clip-higher" bounds (DAPO,
    arXiv 2503.14476) and dual clip (Ye et al., arXiv 1912.09729):

    ``L = max(-rho A, -clip(rho, 1 - eps_clip, 1 + eps_clip_high) A)``, and where ``A < 0`` and
    ``eps_clip_c`` is set, ``L = min(L, -eps_clip_c A)``. ``clipfrac = 1[clipped term > unclipped]``."""
    low, high = _clip_range(algo)
    ratio = log_ratio.exp()
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(low, high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if algo.eps_clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -algo.eps_clip_c * advantages), loss)
    return loss, clipfrac


def ppo_clip(algo: "AlgoConfig", *, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor):
    """Token-level ratio ``rho_t = pi_theta(a_t) / pi_old(a_t)`` in :func:`clipped_surrogate`."""
    log_ratio = torch.where(mask != 0, log_probs - old_log_probs, torch.zeros_like(log_probs))
    loss, clipfrac = clipped_surrogate(log_ratio, advantages, algo)
    return loss, clipfrac, -log_ratio


def gspo(algo: "AlgoConfig", *, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor):
    """GSPO (Zheng et al., arXiv 2507.18071): the sequence ratio is the geometric mean of the token
    ratios, ``s_i = exp(mean_{t: m_t=1} (log pi_theta - log pi_old))``, broadcast to every token
    (gradient flows to every token through the mean) and clipped as in :func:`clipped_surrogate`
    (dual clip included, as slime). The paper's clip ranges are tiny (3e-4 / 4e-4)."""
    m = mask.float()
    token_log_ratio, _ = _masked(log_probs - old_log_probs, m)
    seq_log_ratio = token_log_ratio.sum(-1) / m.sum(-1).clamp_min(1.0)
    log_ratio = seq_log_ratio[:, None].expand_as(log_probs)
    loss, clipfrac = clipped_surrogate(log_ratio, advantages, algo)
    return loss, clipfrac, -log_ratio


def cispo(algo: "AlgoConfig", *, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor):
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): clip the importance weight, not the update,
    ``L_t = -sg(clip(rho_t, 1 - eps_clip, 1 + eps_clip_high)) * A_t * log pi_theta(a_t)``: every token
    keeps a gradient ``-w_t A_t grad log pi``. Canonical bounds: ``eps_clip >= 1`` (no lower bound)
    and ``eps_clip_high`` around 4 (slime's advice). ``clipfrac = 1[w_t != rho_t]``."""
    low, high = _clip_range(algo)
    log_ratio = torch.where(mask != 0, log_probs - old_log_probs, torch.zeros_like(log_probs))
    ratio = log_ratio.exp()
    weight = ratio.clamp(low, high).detach()
    loss = -weight * advantages * log_probs
    return loss, (weight != ratio.detach()).float(), -log_ratio


def policy_loss(algo: "AlgoConfig", reducer: Reducer, *, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor,
                loss_mask: Tensor, ref_log_probs: Optional[Tensor] = None, rollout_log_probs: Optional[Tensor] = None,
                entropy: Optional[Tensor] = None) -> Tuple[Tensor, Metrics]:
    """The actor loss of one micro-batch (slime ``policy_loss_function``)::

        loss = R(pg_t * w_t) - entropy_coef * R(H_t) + kl_loss_coef * R(KL(log_probs, ref) [* rho_t])

    with ``R`` the step's ``reducer`` and ``pg_t`` from ``POLICY_LOSSES[algo.policy_loss]``. TIS (``use_tis``,
    Yao et al. 2025): ``w_t = clamp(exp(old_log_probs - rollout_log_probs), tis_clip_low, tis_clip)``, else 1.
    KL with ``KL_ESTIMATORS[algo.kl_loss_type]``; ``use_unbiased_kl`` (DeepSeek-V3.2) multiplies it by
    ``rho_t = exp(log_probs - old_log_probs)`` (with gradient). ``kl_loss_coef`` needs ``ref_log_probs``,
    ``entropy_coef`` needs ``entropy``. Metrics (detached 0-dim tensors, additive over micro-batches):
    ``pg_loss``, ``kl_loss`` and ``loss`` with ``reducer``; ``pg_clipfrac``, ``ppo_kl``, ``entropy``, ``tis``
    and ``tis_clipfrac`` with ``reducer.metric``."""
    mask = loss_mask.float()
    report = reducer.metric
    log_probs = log_probs.float()
    old_log_probs = old_log_probs.detach().float()
    pg_t, clipfrac_t, ppo_kl_t = POLICY_LOSSES[algo.policy_loss](
        algo, log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages.detach().float(), mask=mask)
    metrics: Metrics = {}
    if algo.use_tis:
        if rollout_log_probs is None:
            raise ValueError("algo.use_tis needs rollout_log_probs")
        tis = (old_log_probs - rollout_log_probs.detach().float()).exp()
        weight = tis.clamp(algo.tis_clip_low, algo.tis_clip)
        pg_t = pg_t * weight
        metrics["tis"] = report(tis, mask).detach()
        metrics["tis_clipfrac"] = report((weight != tis).float(), mask).detach()

    loss = reducer(pg_t, mask)
    metrics["pg_loss"] = loss.detach()
    metrics["pg_clipfrac"] = report(clipfrac_t, mask).detach()
    metrics["ppo_kl"] = report(ppo_kl_t.detach(), mask).detach()

    if entropy is not None:
        metrics["entropy"] = report(entropy.detach(), mask).detach()
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * reducer(entropy, mask)
    elif algo.entropy_coef:
        raise ValueError("algo.entropy_coef != 0 needs entropy")

    if ref_log_probs is not None:
        kl_t = KL_ESTIMATORS[algo.kl_loss_type](log_probs, ref_log_probs.detach())
        if algo.use_unbiased_kl:
            kl_t = kl_t * (log_probs - old_log_probs).exp()
        kl = reducer(kl_t, mask)
        metrics["kl_loss"] = kl.detach()
        if algo.kl_loss_coef:
            loss = loss + algo.kl_loss_coef * kl
    elif algo.kl_loss_coef:
        raise ValueError("algo.kl_loss_coef != 0 needs ref_log_probs")

    metrics["loss"] = loss.detach()
    return loss, metrics


def value_loss(algo: "AlgoConfig", reducer: Reducer, *, values: Tensor, old_values: Tensor, returns: Tensor,
               loss_mask: Tensor) -> Tuple[Tensor, Metrics]:
    """Clipped critic loss (slime ``value_loss_function``; PPO2-style value clipping):
    ``L_t = max((V_clip - R)^2, (V - R)^2)``, ``V_clip = V_old + clip(V - V_old, -value_clip, value_clip)``,
    no 1/2 factor. Metrics: ``value_loss`` (``reducer``), ``value_clipfrac = 1[|V - V_old| > value_clip]``
    (``reducer.metric``)."""
    mask, v, c = loss_mask.float(), values.float(), algo.value_clip
    old, ret = old_values.detach().float(), returns.detach().float()
    v_clipped = old + (v - old).clamp(-c, c)
    loss_t = torch.maximum((v_clipped - ret).square(), (v - ret).square())
    loss = reducer(loss_t, mask)
    clipfrac = reducer.metric(((v - old).abs() > c).float(), mask)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": clipfrac.detach()}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var[R - V] / Var[R]`` over the masked tokens (population variances); NaN when ``Var[R] == 0``."""
    m = mask.float()
    n = m.sum().clamp_min(1.0)

    def var(x: Tensor) -> Tensor:
        xm, _ = _masked(x, m)
        mean = xm.sum() / n
        return _masked((x.float() - mean) ** 2, m)[0].sum() / n

    ret = returns.detach().float()
    var_r = var(ret)
    if var_r == 0:
        return torch.tensor(float("nan"), device=ret.device)
    return 1.0 - var(ret - values.detach().float()) / var_r
