"""The names in the algorithm registries (``slime_hydra.train.algorithms``), importable without
torch: config validation, and so ``dry_run=true``, checks choices against these instead of
importing the registries (torch alone takes over a second to import). ``tests/test_config.py``
checks that they equal the registries, so adding a variant is its function, its registry entry,
and its name here."""

# estimator -> how the rollout manager normalises its rewards within a prompt's group
# (None: raw rewards; "mean": subtract the group mean; "mean_std": also divide by the group std)
ADVANTAGE_ESTIMATORS = {
    "grpo": "mean_std",
    "gspo": "mean_std",
    "cispo": "mean_std",
    "ppo": None,
    "reinforce_plus_plus": None,
    "reinforce_plus_plus_baseline": "mean",
}
POLICY_LOSSES = ("ppo_clip", "gspo", "cispo")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
REDUCTIONS = ("sample_mean", "token_mean", "token_sum")
