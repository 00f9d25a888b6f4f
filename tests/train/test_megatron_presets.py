"""Every model preset maps onto a megatron-core config, and its rope and routing fields reach it.

The presets' sizes and config.json fields: tests/model/test_model_presets.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml") if p.stem not in ("tiny",))


def _arch(name: str):
    from slime_hydra.config.schema import ArchConfig

    return ArchConfig(**yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())["arch"])


@pytest.mark.parametrize("name", PRESETS)
def test_preset_maps_onto_megatron(name):
    pytest.importorskip("megatron.core")
    from slime_hydra.model.hf import hf_config
    from slime_hydra.train.backends.megatron.convert import Layout
    from slime_hydra.train.backends.megatron.model import Parallel, gpt_model_kwargs, transformer_config

    hf = hf_config(_arch(name))
    config = transformer_config(hf, Parallel(tp=2))
    assert config.num_layers == hf.num_hidden_layers and config.hidden_size == hf.hidden_size
    assert gpt_model_kwargs(hf, tp=2)["vocab_size"] % 256 == 0
    layout = Layout.from_hf(hf, tp=2)
    assert sum(layout.moe) == (0 if not getattr(config, "num_moe_experts", None) else
                               sum(1 for f in config.moe_layer_freq if f))


# ------------------------------------------------------------------ the new fields reach megatron-core
def test_rope_scaling_and_routing_fields_reach_megatron():
    pytest.importorskip("megatron.core")
    from slime_hydra.model.hf import hf_config
    from slime_hydra.train.backends.megatron.model import gpt_model_kwargs, transformer_config

    llama = gpt_model_kwargs(hf_config(_arch("llama3_8b")))
    assert llama["rope_scaling"] is True and llama["rope_scaling_factor"] == 8.0 and llama["rotary_base"] == 500000
    ds = transformer_config(hf_config(_arch("deepseek_v3")))
    assert (ds.rope_type, ds.rotary_scaling_factor, ds.original_max_position_embeddings) == ("yarn", 40, 4096)
    assert (ds.mscale, ds.mscale_all_dim, ds.beta_fast, ds.beta_slow) == (1.0, 1.0, 32, 1)
    assert (ds.moe_router_num_groups, ds.moe_router_group_topk, ds.moe_router_topk_scaling_factor) == (8, 4, 2.5)
    qwen = transformer_config(hf_config(_arch("qwen3_30b_a3b")))
    assert qwen.moe_router_pre_softmax is False  # norm_topk_prob: softmax over the chosen experts' logits
