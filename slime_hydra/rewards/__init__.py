"""Rewards: built-in verifiers (exact, math, f1), a remote reward server, and custom hooks.

``REWARD_TYPES`` is the one list of reward types: each maps to an async ``f(cfg, sample) -> float | dict`` in
``hub`` (a new type is that function plus its name here). Nothing is imported until used.
"""

from slime_hydra.utils.registry import LazyRegistry, lazy_attributes

REWARD_TYPES = LazyRegistry("reward type", {name: f"slime_hydra.rewards.hub:{name}"
                                            for name in ("exact", "math", "f1", "remote", "custom")})

__getattr__ = lazy_attributes(__name__, {
    "compute_group_reward": "hub", "compute_reward": "hub", "drain_counters": "hub", "reward_type": "hub",
    "extract_answer": "math_answer", "math_equal": "math_answer", "math_reward": "math_answer",
    "RewardError": "remote", "aclose_shared_client": "remote", "remote_reward": "remote",
    "exact_reward": "text", "f1_reward": "text",
})

__all__ = ["REWARD_TYPES", "RewardError", "aclose_shared_client", "compute_group_reward", "compute_reward",
           "drain_counters", "exact_reward", "extract_answer", "f1_reward", "math_equal", "math_reward",
           "remote_reward", "reward_type"]
