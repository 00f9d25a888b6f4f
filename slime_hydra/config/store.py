"""Registers the schemas in Hydra's ConfigStore.

The root schema ``run_config`` types the whole tree, so every group file and every override is
checked against its dataclass when Hydra composes. Each group also gets its own ``_schema`` entry
that its YAML files list first in their defaults, so a group file is typed on its own as well.
"""

from hydra.core.config_store import ConfigStore

from slime_hydra.config import schema

GROUP_SCHEMAS = {
    "model": schema.ModelConfig,
    "algo": schema.AlgoConfig,
    "rollout": schema.RolloutConfig,
    "parallelism": schema.ParallelismConfig,
    "data": schema.DataConfig,
    "trainer": schema.TrainerConfig,
    "reward": schema.RewardConfig,
    "eval": schema.EvalConfig,
    "logging": schema.LoggingConfig,
}


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="run_config", node=schema.RunConfig)
    for group, node in GROUP_SCHEMAS.items():
        cs.store(group=group, name="_schema", node=node)
