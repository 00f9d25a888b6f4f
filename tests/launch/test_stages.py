"""Staged experiments: each stage composed from its overrides and the command line's, which win."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from conftest import CONF
from slime_hydra.config.store import register_configs
from slime_hydra.launch.stages import stage_configs


def test_stages_compose_their_presets_and_the_command_line_wins(tmp_path):
    register_configs()
    GlobalHydra.instance().clear()
    job = ["experiment=sft_then_grpo", "run_name=test", "algo.lr=0.01"]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        stages = stage_configs(compose("config", overrides=job), str(tmp_path), job)
    assert [d.rsplit("/", 1)[1] for d, _ in stages] == ["0_sft", "1_grpo"]
    sft, grpo = (cfg for _, cfg in stages)
    assert (sft.algo.name, sft.rollout.n_samples_per_prompt, sft.trainer.num_rollout) == ("sft", 1, 10)
    assert (grpo.algo.name, grpo.rollout.n_samples_per_prompt, grpo.trainer.num_rollout) == ("grpo", 16, 40)
    assert sft.algo.lr == grpo.algo.lr == 0.01 and not sft.stages and not grpo.stages
