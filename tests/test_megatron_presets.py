"""Every model preset has its published size, and maps onto a megatron-core config.

The transformers model is built from the preset (``checkpoint.hf.hf_config``) on the meta device, so
nothing is allocated, and its parameter count is compared with the model card's figure (within 1%).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]

# Billions of parameters, from the model cards (DeepSeek-V3: the 671B main model; its Hugging Face
# checkpoint adds the 14B multi-token-prediction module, which transformers does not build).
PUBLISHED_B = {
    "qwen3_0_6b": 0.6,  # card: 0.6B, 0.44B non-embedding (tied embeddings)
    "qwen3_4b": 4.0,
    "qwen3_8b": 8.2,
    "qwen3_30b_a3b": 30.5,  # 3.3B activated
    "glm4_9b": 9.4,
    "llama3_8b": 8.03,
    "deepseek_v3": 671.0,  # 37B activated
}
PRESETS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml") if p.stem not in ("tiny",))


def _arch(name: str):
    from slime_hydra.config.schema import ArchConfig

    return ArchConfig(**yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())["arch"])


def test_every_preset_has_a_published_size():
    assert sorted(PUBLISHED_B) == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_preset_parameter_count(name):
    from transformers import AutoModelForCausalLM

    from slime_hydra.checkpoint.hf import hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(_arch(name)))
    count = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(count - PUBLISHED_B[name]) <= 0.01 * PUBLISHED_B[name], f"{name}: {count:.3f}B"


@pytest.mark.parametrize("name", PRESETS)
def test_preset_maps_onto_megatron(name):
    pytest.importorskip("megatron.core")
    from slime_hydra.checkpoint.hf import hf_config
    from slime_hydra.train.megatron.convert import Layout
    from slime_hydra.train.megatron.model import Parallel, gpt_model_kwargs, transformer_config

    hf = hf_config(_arch(name))
    config = transformer_config(hf, Parallel(tp=2))
    assert config.num_layers == hf.num_hidden_layers and config.hidden_size == hf.hidden_size
    assert gpt_model_kwargs(hf, tp=2)["vocab_size"] % 256 == 0
    layout = Layout.from_hf(hf, tp=2)
    assert sum(layout.moe) == (0 if not getattr(config, "num_moe_experts", None) else
                               sum(1 for f in config.moe_layer_freq if f))
