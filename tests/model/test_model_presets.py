"""Every model preset has its published size and agrees with its published config.json.

The transformers model is built from the preset (``model.hf.hf_config``) on the meta device, so
nothing is allocated, and its parameter count is compared with the model card's figure (within 1%).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]

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

    from slime_hydra.model.hf import hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(_arch(name)))
    count = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(count - PUBLISHED_B[name]) <= 0.01 * PUBLISHED_B[name], f"{name}: {count:.3f}B"


# ------------------------------------------------------------------ config.json against the preset
def _validate_checkpoint(arch, path):
    from types import SimpleNamespace

    from slime_hydra.model.rules import compare_with_hf_config

    return compare_with_hf_config(SimpleNamespace(model=SimpleNamespace(path=str(path), arch=arch)))


@pytest.mark.parametrize("name", PRESETS)
def test_the_config_json_transformers_writes_for_a_preset_matches_it(name, tmp_path):
    from slime_hydra.model.hf import hf_config

    hf_config(_arch(name)).save_pretrained(tmp_path)
    assert _validate_checkpoint(_arch(name), tmp_path) == []


# Excerpts of the published config.json files, as the hub serves them (older files: rope_scaling with "type").
PUBLISHED_CONFIG = {
    "qwen3_30b_a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_experts": 128,
                      "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                      "rope_scaling": None, "rope_theta": 1000000.0, "tie_word_embeddings": False},
    "llama3_8b": {"model_type": "llama", "rope_theta": 500000.0, "max_position_embeddings": 131072,
                  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "deepseek_v3": {"model_type": "deepseek_v3", "n_routed_experts": 256, "n_shared_experts": 1, "n_group": 8,
                    "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 3,
                    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
                                                          "mscale": 1.0, "mscale_all_dim": 1.0,
                                                          "original_max_position_embeddings": 4096, "type": "yarn"}},
    "glm4_9b": {"model_type": "glm4", "attention_bias": True, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                "num_key_value_heads": 2, "head_dim": 128},
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIG))
def test_presets_match_the_published_config_json(name, tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_CONFIG[name]))
    assert _validate_checkpoint(_arch(name), tmp_path) == []


def _tiny_moe_arch(**kw):
    from slime_hydra.config.schema import ArchConfig

    base = dict(type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                norm_topk_prob=True)
    return ArchConfig(**{**base, **kw})


def test_every_field_the_preset_sets_is_compared_with_the_file(tmp_path):
    """A tiny Qwen3-MoE config.json written by transformers: each field that differs from the preset is
    named with both values (the preset leaves rope_theta at the schema's 1e6, the file has the class's 1e4)."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                   norm_topk_prob=False, rms_norm_eps=1e-5, max_position_embeddings=128).save_pretrained(tmp_path)
    errs = _validate_checkpoint(_tiny_moe_arch(max_position_embeddings=128), tmp_path)
    path = tmp_path / "config.json"
    assert errs == [f"model.arch.rope_theta: 1000000.0 but {path} says rope_theta=10000.0 (preset and checkpoint "
                    "disagree)",
                    f"model.arch.rms_norm_eps: 1e-06 but {path} says rms_norm_eps=1e-05 (preset and checkpoint "
                    "disagree)",
                    f"model.arch.norm_topk_prob: True but {path} says norm_topk_prob=False (preset and checkpoint "
                    "disagree)"], errs


def test_rope_scaling_is_compared_key_by_key(tmp_path):
    from transformers import LlamaConfig

    from slime_hydra.config.schema import ArchConfig

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rope_theta=500000.0,
                rms_norm_eps=1e-5, rope_scaling=dict(rope)).save_pretrained(tmp_path)
    arch = dict(type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, max_position_embeddings=256, rope_theta=500000.0, rms_norm_eps=1e-5)
    path = tmp_path / "config.json"
    assert _validate_checkpoint(ArchConfig(**arch, rope_scaling=rope), tmp_path) == []
    assert _validate_checkpoint(ArchConfig(**arch, rope_scaling={**rope, "factor": 4.0}), tmp_path) == [
        f"model.arch.rope_scaling.factor: 4.0 but {path} says 8.0 (preset and checkpoint disagree)"]
    (none,) = _validate_checkpoint(ArchConfig(**arch), tmp_path)
    assert none.startswith(f"model.arch.rope_scaling: None but {path} says rope_scaling={{") and "'llama3'" in none
    (theta,) = _validate_checkpoint(ArchConfig(**{**arch, "rope_theta": 10000.0}, rope_scaling=rope), tmp_path)
    assert theta.startswith("model.arch.rope_theta: 10000.0 but") and "rope_theta=500000.0" in theta


def test_validation_compares_a_local_checkpoint_before_anything_starts(tmp_path):
    from conftest import resolved
    from slime_hydra.launch.validate import validate

    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe", "norm_topk_prob": false}')
    errs = validate(resolved(["experiment=qwen3_30b_a3b_grpo_math", f"data.path={ROOT / 'tests/fixtures/tiny.jsonl'}",
                              f"model.path={tmp_path}"]))
    assert any(e.startswith("model.arch.norm_topk_prob: True but") and "norm_topk_prob=False" in e for e in errs), errs
