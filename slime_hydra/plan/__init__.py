"""The resource plan (which actor on which bundle) and what it costs in memory: pure functions of the
config, below every runtime package, so the launcher, the rollout manager and validation share them."""
