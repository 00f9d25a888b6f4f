"""Hugging Face checkpoints: build a model from a preset's ``arch``, and write the initial
checkpoint that trainers and engines load (the ``--hf-checkpoint`` of slime)."""

from __future__ import annotations

import os
from typing import Any, Dict, Tuple

from slime_hydra.config.schema import ArchConfig, ModelConfig

# arch field -> its transformers config name, where the two differ (the rest share a name)
HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads"}
# and for DeepSeek-V3's config class
DEEPSEEK_V3_NAMES = {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts",
                     "first_k_dense_layers": "first_k_dense_replace"}
BASE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
               "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "attention_bias")
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
MLA_FIELDS = ("num_shared_experts", "first_k_dense_layers", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group", "routed_scaling_factor")


def hf_fields(arch: ArchConfig) -> Dict[str, Tuple[str, Any]]:
    """The transformers config fields that the preset sets: HF name -> (arch field, value). Optional
    fields left at None are left to the config class's default."""
    names = list(BASE_FIELDS)
    if arch.type != "deepseek_v3":
        names.append("head_dim")  # MLA has no single head_dim
    if arch.num_experts or arch.type == "deepseek_v3":
        names += MOE_FIELDS
    if arch.type == "deepseek_v3":
        names += MLA_FIELDS
    names.append("rope_scaling")
    rename = {**HF_NAMES, **(DEEPSEEK_V3_NAMES if arch.type == "deepseek_v3" else {})}
    out = {rename.get(n, n): (n, getattr(arch, n)) for n in names}
    return {k: v for k, v in out.items() if v[1] is not None}


def hf_config_kwargs(arch: ArchConfig) -> Dict[str, Any]:
    """Our arch fields -> the transformers config fields of ``arch.type`` (one of ``schema.ARCH_TYPES``)."""
    kw = {k: value for k, (_, value) in hf_fields(arch).items()}
    if "rope_scaling" in kw:
        kw["rope_scaling"] = dict(kw["rope_scaling"])  # transformers adds rope_theta to the dict it is given
    return kw


def hf_config(arch: ArchConfig, **extra):
    """The transformers config of ``arch``; ``extra`` fields are added and win over the preset's."""
    from transformers import AutoConfig

    return AutoConfig.for_model(arch.type, **{**hf_config_kwargs(arch), **extra})


def build_random_checkpoint(model: ModelConfig, out_dir: str) -> str:
    """Write ``model`` with random weights (seed ``init_seed``) and its tokenizer to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    from slime_hydra.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model.tokenizer, model.trust_remote_code)
    config = hf_config(model.arch, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.bos_token_id)
    torch.manual_seed(model.init_seed)
    net = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, model.dtype))
    tmp = out_dir + ".tmp"
    net.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    return out_dir


def initial_checkpoint(model: ModelConfig, run_dir: str) -> str:
    """The HF checkpoint every actor starts from: ``model.path``, or a random one built in the run dir."""
    if model.path is not None:
        return os.path.expanduser(model.path)
    out = os.path.join(run_dir, "initial_model")
    return out if os.path.isdir(out) else build_random_checkpoint(model, out)
