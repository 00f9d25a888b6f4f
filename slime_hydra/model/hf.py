"""The model as Hugging Face sees it: the transformers config of ``model.arch``, the random initial
checkpoint that trainers and engines load (slime's ``--hf-checkpoint``), and its fingerprint."""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

from slime_hydra.config.schema import ArchConfig, ModelConfig

log = logging.getLogger(__name__)
# written into initial_model/ with the weights: the config keys that made them (initial_fingerprint)
FINGERPRINT = "slime_hydra_initial_model.json"

# arch field -> its transformers config name, where the two differ (the rest share a name); and DeepSeek-V3's
HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads"}
DEEPSEEK_V3_NAMES = {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts",
                     "first_k_dense_layers": "first_k_dense_replace"}
BASE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
               "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "attention_bias")
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
MLA_FIELDS = ("num_shared_experts", "first_k_dense_layers", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group", "routed_scaling_factor")


def hf_fields(arch: ArchConfig) -> Dict[str, Tuple[str, Any]]:
    """The transformers config fields the preset sets, HF name -> (arch field, value); None ones are left out."""
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
    tmp, old = out_dir + ".tmp", out_dir + ".old"
    for leftover in (tmp, old):  # of a build that was killed
        shutil.rmtree(leftover, ignore_errors=True)
    net.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, FINGERPRINT), "w") as f:
        json.dump(initial_fingerprint(model), f, indent=1, sort_keys=True)
    if os.path.exists(out_dir):  # one of another model: replaced only once the new one is complete
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def initial_fingerprint(model: ModelConfig) -> Dict[str, Any]:
    """The config keys that define the random initial model (``hf_fields``, seed, tokenizer), as JSON reads them."""
    out: Dict[str, Any] = {"model.arch.type": model.arch.type, "model.init_seed": model.init_seed,
                           "model.tokenizer": model.tokenizer}
    for field, value in hf_fields(model.arch).values():
        out[f"model.arch.{field}"] = dict(value) if field == "rope_scaling" else value
    return json.loads(json.dumps(out))


def read_fingerprint(model_dir: str) -> Optional[Dict[str, Any]]:
    """The fingerprint written with ``model_dir`` (an ``initial_model/``); None if it has none."""
    path = os.path.join(model_dir, FINGERPRINT)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def fingerprint_diff(model: ModelConfig, recorded: Dict[str, Any]) -> List[str]:
    """One line per config key where ``model`` differs from the ``recorded`` fingerprint."""
    ours = initial_fingerprint(model)
    return [f"{k}: {ours.get(k)!r}, but the initial model was built with {recorded.get(k)!r}"
            for k in sorted(set(ours) | set(recorded)) if ours.get(k) != recorded.get(k)]


def initial_checkpoint(model: ModelConfig, run_dir: str, resuming: bool = False) -> str:
    """The HF checkpoint every actor starts from: ``model.path``, or a random one built in the run dir. An
    ``initial_model/`` there is reused when its fingerprint matches ``model``, else rebuilt; a run that resumes
    (``resuming``) keeps the one it trained from and refuses one built for another model."""
    if model.path is not None:
        return os.path.expanduser(model.path)
    out = os.path.join(run_dir, "initial_model")
    if os.path.isdir(out):
        recorded = read_fingerprint(out)
        if recorded is not None and recorded == initial_fingerprint(model):
            return out
        if resuming:
            if recorded is None:
                return out
            from slime_hydra.config import ConfigError

            raise ConfigError([f"{line} ({out}); the run being resumed trained that model"
                               for line in fingerprint_diff(model, recorded)])
        log.warning("%s was built for another model (%s): building it again", out,
                    "; ".join(fingerprint_diff(model, recorded)) if recorded else "no fingerprint")
    return build_random_checkpoint(model, out)
