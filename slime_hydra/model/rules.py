"""Config rules of the model: ``model.arch`` describes a buildable transformer, and a local ``model.path``
holds a checkpoint whose config.json agrees with it."""

from __future__ import annotations

import json
import os
from typing import List

from slime_hydra.config.rules import choice, looks_local
from slime_hydra.config.schema import ARCH_TYPES, RunConfig
from slime_hydra.model.hf import hf_fields


def check(cfg: RunConfig) -> List[str]:
    errs: List[str] = []
    m, arch = cfg.model, cfg.model.arch
    choice(errs, "model.arch.type", arch.type, ARCH_TYPES)
    head_dim = arch.head_dim or (arch.hidden_size // max(arch.num_heads, 1))
    if arch.q_lora_rank is None and arch.kv_lora_rank is None:
        if arch.head_dim is None and arch.hidden_size % arch.num_heads:
            errs.append(f"model.arch.hidden_size: {arch.hidden_size} is not divisible by num_heads={arch.num_heads} "
                        "(set head_dim)")
        if arch.num_heads % arch.num_kv_heads:
            errs.append(f"model.arch.num_kv_heads: num_heads={arch.num_heads} must be a multiple of "
                        f"num_kv_heads={arch.num_kv_heads}")
        if head_dim % 2:
            errs.append(f"model.arch.head_dim: {head_dim} must be even (rotary embeddings)")
    if arch.num_experts and not (0 < arch.num_experts_per_tok <= arch.num_experts):
        errs.append(f"model.arch.num_experts_per_tok: {arch.num_experts_per_tok} must be in "
                    f"1..num_experts={arch.num_experts}")
    if m.path is not None and looks_local(m.path):
        if not os.path.isdir(os.path.expanduser(m.path)):
            errs.append(f"model.path: {m.path!r} is not a directory (a local Hugging Face checkpoint, or a hub id "
                        "like 'Qwen/Qwen3-4B')")
        else:
            errs.extend(compare_with_hf_config(cfg))
    return errs


def compare_with_hf_config(cfg: RunConfig) -> List[str]:
    """Every field the preset sets (:func:`~slime_hydra.model.hf.hf_fields`) must match ``model.path``'s
    config.json (slime's _hf_validate_args checks the shape ones); a field the file leaves out is its class
    default, which is not known without importing transformers, so it is not compared."""
    path = os.path.join(os.path.expanduser(cfg.model.path), "config.json")
    if not os.path.exists(path):
        return [f"model.path: {cfg.model.path!r} has no config.json"]
    return compare_arch_with(cfg.model.arch, path)


def compare_arch_with(arch, path: str) -> List[str]:
    """One line per field where ``arch`` and the config.json at ``path`` disagree."""
    with open(path) as f:
        hf = json.load(f)
    hf = {**hf.get("text_config", {}), **hf}
    file_rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if "rope_theta" in file_rope:  # transformers 5 writes rope_theta inside rope_parameters
        hf.setdefault("rope_theta", file_rope["rope_theta"])
    out = []
    for key, (field, ours) in hf_fields(arch).items():
        if key != "rope_scaling" and key in hf and hf[key] != ours:
            out.append(f"model.arch.{field}: {ours!r} but {path} says {key}={hf[key]!r} "
                       "(preset and checkpoint disagree)")
    ours_rope, theirs_rope = _rope_scaling(arch.rope_scaling), _rope_scaling(file_rope)
    if not ours_rope and theirs_rope:
        out.append(f"model.arch.rope_scaling: None but {path} says rope_scaling={theirs_rope} "
                   "(preset and checkpoint disagree)")
    elif ours_rope:
        for k in sorted(set(ours_rope) | set(theirs_rope)):
            if ours_rope.get(k) != theirs_rope.get(k):
                out.append(f"model.arch.rope_scaling.{k}: {ours_rope.get(k)!r} but {path} says "
                           f"{theirs_rope.get(k)!r} (preset and checkpoint disagree)")
    return out


def _rope_scaling(d) -> dict:
    """A rope scaling dict in one spelling: ``rope_type`` (older files say ``type``), without the fields
    that are not scaling (``rope_theta``, GLM-4's ``partial_rotary_factor``); plain rope is empty."""
    d = dict(d or {})
    kind = d.pop("type", None)
    d.setdefault("rope_type", kind or "default")
    for k in ("rope_theta", "partial_rotary_factor"):
        d.pop(k, None)
    return {} if d == {"rope_type": "default"} else d
