"""Registers the schemas in Hydra's ConfigStore: ``run_config`` types the whole tree, and each group's
``_schema`` (listed first in its YAML files' defaults) types a group file on its own."""

import functools

import yaml
from hydra._internal.config_repository import ConfigRepository
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException

from slime_hydra.config import schema

GROUP_SCHEMAS = {"model": schema.ModelConfig, "algo": schema.AlgoConfig, "rollout": schema.RolloutConfig,
                 "parallelism": schema.ParallelismConfig, "data": schema.DataConfig, "trainer": schema.TrainerConfig,
                 "reward": schema.RewardConfig, "eval": schema.EvalConfig, "logging": schema.LoggingConfig}

# groups whose files need `# @package _global_` (without it Hydra says only "Key 'experiment' not in 'RunConfig'")
GLOBAL_GROUPS = ("experiment", "hparams_search")


def yaml_error_message(e: yaml.YAMLError) -> str:
    """``file:line:col: not valid YAML: <problem> (<context> that started at line L, column C)``."""
    problem, context = getattr(e, "problem", None), getattr(e, "context", None)
    mark, start = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
    mark = mark or start
    if mark is None or not problem:
        return f"not valid YAML: {e}"
    text = f"{mark.name}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {problem}"
    if context and start is not None and start is not mark:
        text += f" ({context} that started at line {start.line + 1}, column {start.column + 1})"
    elif context:
        text += f" ({context})"
    return text


def _checked_load_config(load_config):
    """Hydra's ConfigRepository.load_config (every config source goes through it), with a YAML syntax error
    as one line naming file, line and column, and a GLOBAL_GROUPS file without its header said so."""

    @functools.wraps(load_config)
    def wrapper(self, config_path):
        try:
            ret = load_config(self, config_path)
        except yaml.YAMLError as e:
            raise ConfigCompositionException(yaml_error_message(e)) from None
        group = config_path.split("/", 1)[0] if "/" in config_path else ""
        if ret is not None and group in GLOBAL_GROUPS and ret.header.get("package") != "_global_":
            where = f"{ret.path}/{config_path}.yaml".removeprefix("file://")
            raise ConfigCompositionException(f"{where}: the first line `# @package _global_` is missing (every "
                                             f"{group} file needs it: its keys are the whole config's, model, algo, "
                                             "trainer, ...)")
        return ret

    wrapper._slime_hydra_checked = True
    return wrapper


def register_configs() -> None:
    # idempotent: every caller (run.py, describe, tests) may call it again
    if not getattr(ConfigRepository.load_config, "_slime_hydra_checked", False):
        ConfigRepository.load_config = _checked_load_config(ConfigRepository.load_config)
    cs = ConfigStore.instance()
    cs.store(name="run_config", node=schema.RunConfig)
    for group, node in GROUP_SCHEMAS.items():
        cs.store(group=group, name="_schema", node=node)
