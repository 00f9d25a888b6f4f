"""A remote reward server for docs/recipes/remote-reward.md."""
