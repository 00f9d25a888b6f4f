"""Hydra loads sweepers and launchers only from the ``hydra_plugins`` namespace package: these names
point Hydra at slime_hydra's sweep plugins, whose code lives in ``slime_hydra/sweep/``."""

from slime_hydra.sweep import launcher, sweeper


class SlimeSweeper(sweeper.SlimeSweeper):
    """``hydra/sweeper=slime`` (conf/hydra/sweeper/slime.yaml)."""


class SweepLauncher(launcher.SweepLauncher):
    """``hydra/launcher=slime`` (conf/hydra/launcher/slime.yaml)."""
