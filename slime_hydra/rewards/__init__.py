"""Rewards: built-in verifiers (exact, math, f1), a remote reward server, and custom hooks."""

from slime_hydra.rewards.hub import REWARD_TYPES, compute_group_reward, compute_reward, drain_counters, reward_type
from slime_hydra.rewards.math_answer import extract_answer, math_equal, math_reward
from slime_hydra.rewards.remote import RewardError, aclose_shared_client, remote_reward
from slime_hydra.rewards.text import exact_reward, f1_reward

__all__ = [
    "REWARD_TYPES", "RewardError", "aclose_shared_client", "compute_group_reward", "compute_reward", "drain_counters",
    "exact_reward", "extract_answer", "f1_reward", "math_equal", "math_reward", "remote_reward", "reward_type",
]
