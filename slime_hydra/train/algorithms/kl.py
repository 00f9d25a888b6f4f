"""Per-token estimators of KL(pi_theta || pi_ref) at the sampled tokens (Schulman, "Approximating KL
Divergence", 2020), ``f(log_probs, ref_log_probs) -> float32 tensor`` with ``lr = log pi_theta - log pi_ref``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``lr``."""
    return log_probs.float() - ref_log_probs.float()


def k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``lr^2 / 2``."""
    return k1(log_probs, ref_log_probs).square() / 2


def k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``exp(-lr) - 1 + lr`` (= r - 1 - log r with r = pi_ref / pi_theta)."""
    lr = k1(log_probs, ref_log_probs)
    return torch.expm1(-lr) + lr


def low_var_kl(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """``clamp(k3, -10, 10)``."""
    return k3(log_probs, ref_log_probs).clamp(-10.0, 10.0)

