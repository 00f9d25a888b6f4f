from slime_hydra.config.schema import RunConfig
from slime_hydra.config.validate import ConfigError, load, resolve, validate

__all__ = ["RunConfig", "ConfigError", "load", "resolve", "validate"]
