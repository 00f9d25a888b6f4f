"""LoRA on the torch backend through PEFT (``trainer.lora.rank > 0``; DDP or FSDP2): frozen base weights in
``model.dtype``, float32 adapters; the reference is the base with the adapters disabled; the engines get
``W + (alpha / r) B A`` computed per layer as the weights stream out; checkpoints hold ``adapter/``.
torch and PEFT are imported inside the functions: the config rules read ``LORA_TARGET_MODULES``.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Tuple

if TYPE_CHECKING:
    import torch

    from slime_hydra.config.schema import LoraConfig

# model.arch.type -> the linear layers LoRA adapts by default: attention and MLP projections (Hugging Face
# module names). MoE experts are fused parameters in transformers 5 (the router no nn.Linear): attention only.
_ATTN, _MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
LORA_TARGET_MODULES: Dict[str, List[str]] = {
    "qwen3": _ATTN + _MLP, "qwen2": _ATTN + _MLP, "llama": _ATTN + _MLP, "glm4": _ATTN + ["gate_up_proj", "down_proj"],
    "qwen3_moe": _ATTN, "deepseek_v3": ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
}
# model.arch.type -> every linear layer (leaf) name LoRA can adapt, all variants of a family in one list, for
# validation; not embeddings or the LM head: the merged push handles linear layers only.
LORA_LINEAR_MODULES: Dict[str, List[str]] = {**LORA_TARGET_MODULES,
                                             "deepseek_v3": LORA_TARGET_MODULES["deepseek_v3"] + _MLP}
NOT_LINEAR = {"embed_tokens": "the token embedding", "lm_head": "the LM head (the embedding's weight when tied)"}
ADAPTER = "default"  # PEFT's adapter name
ADAPTER_DIR = "adapter"  # in a run checkpoint


def target_modules(lora: "LoraConfig", arch_type: str) -> List[str]:
    return list(lora.target_modules) if lora.target_modules is not None else LORA_TARGET_MODULES[arch_type]


def unknown_targets(names: List[str], available: List[str]) -> str:
    """What is wrong with the ``trainer.lora.target_modules`` entries ``names`` (none of them adaptable), given
    the ``available`` linear layer names: one message naming the key, with the nearest name for each."""
    parts = []
    for name in names:
        leaf = name.rpartition(".")[2]
        if leaf in NOT_LINEAR:
            parts.append(f"{name!r} is {NOT_LINEAR[leaf]}, which LoRA here does not adapt")
            continue
        close = difflib.get_close_matches(leaf, available, n=1, cutoff=0.6)
        parts.append(f"{name!r} names no linear layer" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (f"trainer.lora.target_modules: {'; '.join(parts)}. Only the linear projections are supported: "
            f"{', '.join(available)} (a module name or its dotted suffix, e.g. self_attn.q_proj)")


def check_targets(model: "torch.nn.Module", names: List[str]) -> None:
    """Raise unless each of ``names`` matches (as PEFT does: name or dotted suffix) an ``nn.Linear`` but the LM head."""
    import torch

    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and
              n.rpartition(".")[2] not in NOT_LINEAR]
    unmatched = [t for t in names if not any(n == t or n.endswith("." + t) for n in linear)]
    if unmatched:
        raise ValueError(unknown_targets(unmatched, sorted({n.rpartition(".")[2] for n in linear})))


def wrap(model: "torch.nn.Module", lora: "LoraConfig", arch_type: str) -> "torch.nn.Module":
    """``model`` with LoRA adapters (a ``PeftModel``; ``B`` starts at zero), base frozen, adapters float32.
    Names the run gives must each match a linear layer; the family's default may list names that one variant
    lacks (DeepSeek-V3's q_proj or q_a_proj)."""
    from peft import LoraConfig, get_peft_model

    if lora.target_modules is not None:
        check_targets(model, list(lora.target_modules))
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                        target_modules=target_modules(lora, arch_type), task_type="CAUSAL_LM")
    return get_peft_model(model, config, autocast_adapter_dtype=True)


def hf_model(peft_model: "torch.nn.Module") -> "torch.nn.Module":
    """The Hugging Face model inside a ``PeftModel`` (its LoRA layers in place)."""
    return peft_model.base_model.model


def hf_name(name: str) -> str:
    """A state-dict name of the model inside PEFT -> the engine's Hugging Face name."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def lora_layers(peft_model: "torch.nn.Module") -> Dict[str, "torch.nn.Module"]:
    """Hugging Face module name -> its PEFT LoRA layer (holding ``base_layer``, ``lora_A``, ``lora_B``)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in hf_model(peft_model).named_modules() if isinstance(m, LoraLayer)}


def merged_weights(peft_model: "torch.nn.Module", named: Iterator[Tuple[str, "torch.Tensor"]],
                   full: Callable[["torch.Tensor"], "torch.Tensor"]) -> Iterator[Tuple[str, "torch.Tensor"]]:
    """``named`` (the Hugging Face model's unique state, PEFT's names, local or sharded tensors) without the
    adapter tensors, each adapted weight replaced by ``W + scale B A`` (in float32, then the weight's dtype),
    under Hugging Face names; ``full`` makes a (sharded) tensor whole (FSDP2 gathers: every rank calls it in
    the same order). One layer at a time: nothing is merged into the model."""
    layers = lora_layers(peft_model)
    unmergeable = sorted(n for n, layer in layers.items() if ADAPTER not in layer.lora_A)
    if unmergeable:  # e.g. an embedding's adapter (lora_embedding_A/B): its weight would go out without it
        raise RuntimeError(f"LoRA layers {unmergeable} are not linear layers (trainer.lora.target_modules): "
                           "the merged push merges linear layers only, and would send these without their adapters")
    merged = set()
    for name, tensor in named:
        if ".lora_" in name:
            continue
        clean = hf_name(name)
        owner, _, leaf = clean.rpartition(".")
        weight = full(tensor)
        layer = layers.get(owner)
        if layer is not None and leaf == "weight" and ADAPTER in layer.lora_A:
            a, b = full(layer.lora_A[ADAPTER].weight), full(layer.lora_B[ADAPTER].weight)
            delta = layer.scaling[ADAPTER] * (b.float() @ a.float())
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.T
            weight = (weight.float() + delta.to(weight.device)).to(weight.dtype)
            merged.add(owner)
        yield clean, weight
    missing = sorted(set(layers) - merged)
    if missing:  # e.g. a tied LM head: its weight is the embedding's, pushed once, unmerged
        raise RuntimeError(f"LoRA layers {missing} have no weight of their own in the pushed state (a tied LM "
                           "head?), so their adapters were not merged into what the engines got "
                           "(trainer.lora.target_modules)")


def adapter_state(peft_model: "torch.nn.Module", full: Callable[["torch.Tensor"], "torch.Tensor"]
                  ) -> Dict[str, "torch.Tensor"]:
    """The adapter tensors, whole, by the ``PeftModel``'s state-dict names (``full`` as above)."""
    return {k: full(v).detach().cpu() for k, v in peft_model.state_dict().items() if ".lora_" in k}


def load_adapter_state(ckpt_dir: str) -> Dict[str, "torch.Tensor"]:
    """The adapter tensors of ``ckpt_dir/adapter`` by the ``PeftModel``'s state-dict names (:func:`adapter_state`'s)."""
    import os

    from peft.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import load_file

    saved = load_file(os.path.join(ckpt_dir, ADAPTER_DIR, SAFETENSORS_WEIGHTS_NAME))
    # PEFT saves "…lora_A.weight"; the live model names it "…lora_A.default.weight"
    return {k.replace(".lora_A.weight", f".lora_A.{ADAPTER}.weight").replace(".lora_B.weight",
                                                                             f".lora_B.{ADAPTER}.weight"): v
            for k, v in saved.items()}
