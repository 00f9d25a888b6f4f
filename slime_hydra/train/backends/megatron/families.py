"""What the Megatron backend knows about Hugging Face configs, with no megatron-core import (so that
weight conversion runs anywhere torch does): the supported families, which layers are MoE, the
rope settings, and megatron's vocabulary padding."""

from __future__ import annotations

from typing import Any, Dict, List

FAMILIES = ("qwen3", "llama", "glm4", "qwen3_moe", "deepseek_v3")
VOCAB_DIVISIBLE_BY = 128


def family(hf) -> str:
    mt = getattr(hf, "model_type", None)
    if mt not in FAMILIES:
        raise ValueError(f"model_type {mt!r} has no Megatron mapping; supported: {', '.join(FAMILIES)}")
    return mt


def padded_vocab_size(vocab_size: int, tp: int = 1, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """The vocabulary padded to a multiple of ``divisible_by`` rows per TP shard (as Megatron-LM); pad rows are zero."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def rope(hf) -> Dict[str, Any]:
    """The HF rope settings (transformers 5 ``rope_parameters``, older ``rope_theta``/``rope_scaling``)."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    legacy = getattr(hf, "rope_scaling", None) or {}
    for k, v in legacy.items():
        params.setdefault(k, v)
    params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    if getattr(hf, "partial_rotary_factor", None) is not None:
        params.setdefault("partial_rotary_factor", hf.partial_rotary_factor)
    return params


def moe_layers(hf) -> List[int]:
    """0/1 per layer: which layers are mixture-of-experts (megatron's ``moe_layer_freq`` list)."""
    fam = family(hf)
    n = hf.num_hidden_layers
    if fam == "qwen3_moe":
        step, dense = hf.decoder_sparse_step, set(hf.mlp_only_layers or [])
        return [int(i not in dense and hf.num_experts > 0 and (i + 1) % step == 0) for i in range(n)]
    if fam == "deepseek_v3":
        return [int(i >= hf.first_k_dense_replace) for i in range(n)]
    return [0] * n
