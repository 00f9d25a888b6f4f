"""Per-token estimators of KL(pi_theta || pi_ref) at the sampled tokens.

Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html). With the
sampled token a ~ pi_theta and ``lr = log pi_theta(a) - log pi_ref(a)``:

- ``k1 = lr``                      unbiased, high variance, can be negative;
- ``k2 = lr^2 / 2``                biased, low variance; its gradient equals the true KL gradient on-policy;
- ``k3 = exp(-lr) - 1 + lr``       unbiased and >= 0 (the "low variance" estimator used by GRPO);
- ``low_var_kl = clamp(k3, -10, 10)``  k3 clamped for numerical safety (slime's ``low_var_kl``).

Each estimator is ``f(log_probs, ref_log_probs) -> per-token tensor`` of the same shape, in float32.
To add one: write the function and add its line to ``KL_ESTIMATORS`` in ``__init__.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _log_ratio(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    return log_probs.float() - ref_log_probs.float()


def k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``lr``."""
    return _log_ratio(log_probs, ref_log_probs)


def k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``lr^2 / 2``."""
    return _log_ratio(log_probs, ref_log_probs).square() / 2


def k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``exp(-lr) - 1 + lr`` (= r - 1 - log r with r = pi_ref / pi_theta)."""
    lr = _log_ratio(log_probs, ref_log_probs)
    return torch.expm1(-lr) + lr


def low_var_kl(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``clamp(k3, -10, 10)``."""
    return k3(log_probs, ref_log_probs).clamp(-10.0, 10.0)

