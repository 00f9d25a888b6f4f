"""Hugging Face checkpoints: build a model from a preset's ``arch``, and write the initial
checkpoint that trainers and engines load (the ``--hf-checkpoint`` of slime)."""

from __future__ import annotations

import os
from typing import Any, Dict

from slime_hydra.config.schema import ArchConfig, ModelConfig


def hf_config_kwargs(arch: ArchConfig) -> Dict[str, Any]:
    """Our arch fields -> the transformers config fields of ``arch.type`` (one of ``schema.ARCH_TYPES``)."""
    kw: Dict[str, Any] = dict(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        max_position_embeddings=arch.max_position_embeddings,
        rope_theta=arch.rope_theta,
        rms_norm_eps=arch.rms_norm_eps,
        tie_word_embeddings=arch.tie_word_embeddings,
        attention_bias=arch.attention_bias,
    )
    if arch.head_dim is not None:
        kw["head_dim"] = arch.head_dim
    if arch.num_experts:
        kw.update(num_experts=arch.num_experts, num_experts_per_tok=arch.num_experts_per_tok,
                  moe_intermediate_size=arch.moe_intermediate_size)
    if arch.type == "deepseek_v3":
        kw.pop("num_experts", None)
        kw.update(n_routed_experts=arch.num_experts, n_shared_experts=arch.num_shared_experts,
                  first_k_dense_replace=arch.first_k_dense_layers, q_lora_rank=arch.q_lora_rank,
                  kv_lora_rank=arch.kv_lora_rank, qk_nope_head_dim=arch.qk_nope_head_dim,
                  qk_rope_head_dim=arch.qk_rope_head_dim, v_head_dim=arch.v_head_dim)
        kw.pop("head_dim", None)
    return kw


def hf_config(arch: ArchConfig, **extra):
    from transformers import AutoConfig

    return AutoConfig.for_model(arch.type, **hf_config_kwargs(arch), **extra)


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
