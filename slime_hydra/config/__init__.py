from slime_hydra.config.resolve import ConfigError, load, resolve
from slime_hydra.config.schema import RunConfig

__all__ = ["RunConfig", "ConfigError", "load", "resolve"]
