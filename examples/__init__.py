"""Examples that plug into slime_hydra through its hooks (importable as ``examples.*`` from the repo root)."""
