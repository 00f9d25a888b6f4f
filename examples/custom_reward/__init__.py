"""Custom rewards for docs/recipes/custom-reward.md."""
