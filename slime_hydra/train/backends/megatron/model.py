"""megatron-core ``TransformerConfig`` and ``GPTModel`` from a Hugging Face config (the one source of the
model's shape), and a rank's model chunks. Families: ``qwen3``, ``llama`` (Llama-3 rope scaling), ``glm4`` (qkv
bias, interleaved half rope, post norms), ``qwen3_moe``, ``deepseek_v3`` (MLA, sigmoid grouped router).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from slime_hydra.train.backends.megatron.convert import Shard, stage_shard
from slime_hydra.train.backends.megatron.families import family, moe_layers, padded_vocab_size, rope
from slime_hydra.train.backends.megatron.spec import HAVE_TE, decoder_block_spec

# Without Transformer Engine, megatron's fused-RoPE slot holds spec.packed_rotary_pos_emb (no host sync per
# layer); it rotates halves, so GLM-4's interleaved rope and DeepSeek-V3's multi-latent one keep megatron's own
PACKED_ROPE_FAMILIES = ("qwen3", "llama", "qwen3_moe")


@dataclass(frozen=True)
class Parallel:
    """Model-parallel sizes (data parallelism is what is left of the world)."""

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None  # virtual pipeline stages per pipeline rank (interleaved schedule)
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallelism; None: megatron's default (= tp)
    sequence_parallel: bool = False


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"unsupported Hugging Face config for Megatron: {what}")


def transformer_config(hf, parallel: Parallel = Parallel(), *, dtype: torch.dtype = torch.bfloat16,
                       overrides: Optional[Dict[str, Any]] = None, cpu_init: bool = False) -> TransformerConfig:
    """megatron-core's config for ``hf``; ``overrides``: ``TransformerConfig`` fields set last (unknown: an error)."""
    fam = family(hf)
    _check(getattr(hf, "hidden_act", "silu") == "silu", f"hidden_act={hf.hidden_act!r} (silu expected)")
    r = rope(hf)
    kw: Dict[str, Any] = dict(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads,
        normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        init_method_std=getattr(hf, "initializer_range", 0.02),
        bias_activation_fusion=True, bias_dropout_fusion=True, masked_softmax_fusion=False,
        apply_rope_fusion=HAVE_TE or fam in PACKED_ROPE_FAMILIES, persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall", use_cpu_initialization=cpu_init,
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp, context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep, expert_tensor_parallel_size=parallel.etp,
        sequence_parallel=parallel.sequence_parallel,
    )
    if fam != "deepseek_v3":
        kw["kv_channels"] = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if fam in ("qwen3", "qwen3_moe"):
        kw["qk_layernorm"] = True
        kw["add_qkv_bias"] = bool(getattr(hf, "attention_bias", False))
        _check(not kw["add_qkv_bias"], "Qwen3 attention_bias=True (it also biases o_proj)")
    if fam == "llama":
        _check(not hf.attention_bias and not getattr(hf, "mlp_bias", False), "Llama attention_bias/mlp_bias")
    if fam == "glm4":
        kw["add_qkv_bias"] = bool(hf.attention_bias)
        kw["rotary_interleaved"] = True
    if fam in ("qwen3_moe", "deepseek_v3"):
        kw.update(moe_layer_freq=moe_layers(hf), moe_router_topk=hf.num_experts_per_tok,
                  moe_ffn_hidden_size=hf.moe_intermediate_size, moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
                  moe_grouped_gemm=HAVE_TE, moe_permute_fusion=False)
    if fam == "qwen3_moe":
        _check(not getattr(hf, "shared_expert_intermediate_size", 0), "Qwen3-MoE shared experts")
        kw.update(num_moe_experts=hf.num_experts, moe_router_score_function="softmax",
                  moe_router_pre_softmax=not hf.norm_topk_prob)
    if fam == "deepseek_v3":
        _check(hf.norm_topk_prob, "DeepSeek-V3 norm_topk_prob=False (megatron renormalises sigmoid top-k)")
        _check(getattr(hf, "rope_interleave", True), "DeepSeek-V3 rope_interleave=False")
        _check(not hf.attention_bias, "DeepSeek-V3 attention_bias=True")
        groups = hf.n_group if hf.n_group and hf.n_group > 1 else None
        kw.update(num_moe_experts=hf.n_routed_experts, moe_router_score_function="sigmoid",
                  moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
                  moe_router_num_groups=groups, moe_router_group_topk=hf.topk_group if groups else None,
                  moe_router_topk_scaling_factor=hf.routed_scaling_factor,
                  moe_shared_expert_intermediate_size=hf.moe_intermediate_size * hf.n_shared_experts or None,
                  multi_latent_attention=True, qk_layernorm=True,
                  q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_head_dim=hf.qk_nope_head_dim,
                  qk_pos_emb_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
                  rotary_base=r["rope_theta"], rotary_percent=1.0)
        if r["rope_type"] == "yarn":
            kw.update(rope_type="yarn", rotary_scaling_factor=r["factor"],
                      original_max_position_embeddings=r["original_max_position_embeddings"],
                      beta_fast=r.get("beta_fast", 32), beta_slow=r.get("beta_slow", 1),
                      mscale=r.get("mscale", 1.0), mscale_all_dim=r.get("mscale_all_dim", 0.0))
        else:
            _check(r["rope_type"] == "default", f"DeepSeek-V3 rope_type={r['rope_type']!r}")
            kw.update(rope_type="rope", mscale_all_dim=0.0)
    elif r["rope_type"] not in ("default", "llama3"):
        raise ValueError(f"unsupported Hugging Face config for Megatron: rope_type={r['rope_type']!r}")
    kw.update(overrides or {})
    cls = MLATransformerConfig if fam == "deepseek_v3" else TransformerConfig
    unknown = sorted(set(overrides or {}) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"unknown TransformerConfig field(s) in the megatron overrides: {', '.join(unknown)}")
    return cls(**kw)


def gpt_model_kwargs(hf, tp: int = 1) -> Dict[str, Any]:
    """``GPTModel`` arguments that are not ``TransformerConfig`` fields."""
    fam, r = family(hf), rope(hf)
    kw: Dict[str, Any] = dict(
        vocab_size=padded_vocab_size(hf.vocab_size, tp), max_sequence_length=hf.max_position_embeddings,
        position_embedding_type="rope", rotary_base=int(r["rope_theta"]),
        rotary_percent=float(r.get("partial_rotary_factor", 1.0)),
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
    )
    if fam != "deepseek_v3" and r["rope_type"] == "llama3":
        # megatron-core hard-codes Llama 3.1's low/high frequency factors and original context.
        fixed = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
        for k, v in fixed.items():
            _check(float(r.get(k, v)) == v, f"llama3 rope {k}={r.get(k)} (megatron-core supports {v})")
        kw.update(rope_scaling=True, rope_scaling_factor=float(r["factor"]))
    if r["rope_theta"] != int(r["rope_theta"]):
        raise ValueError(f"rope_theta={r['rope_theta']}: megatron-core takes an integer rotary base")
    return kw


def build_gpt_model(hf, config: TransformerConfig, *, attention: str = "auto", pre_process: bool = True,
                    post_process: bool = True, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """One model chunk: the decoder layers of pipeline rank ``pp_rank`` (default: this process's) and virtual
    stage ``vp_stage``, the embedding on the first stage, the final norm and output layer on the last."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    spec = decoder_block_spec(config, post_norms=family(hf) == "glm4", attention=attention,
                              pp_rank=pp_rank, vp_stage=vp_stage)
    return GPTModel(config=config, transformer_layer_spec=spec, pre_process=pre_process, post_process=post_process,
                    vp_stage=vp_stage, **gpt_model_kwargs(hf, config.tensor_model_parallel_size))


def recompute_overrides(recompute: str) -> Dict[str, Any]:
    """``trainer.recompute`` as ``TransformerConfig`` fields (slime's --recompute-granularity)."""
    if recompute == "none":
        return {}
    if recompute == "selective":
        return {"recompute_granularity": "selective"}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    raise ValueError(f"trainer.recompute: {recompute!r} is not one of none, selective, full")


def build_chunks(hf, config: TransformerConfig, device: torch.device, *,
                 compile: bool = False) -> Tuple[List[torch.nn.Module], List[Shard]]:
    """This rank's model chunks (one per virtual pipeline stage) on ``device``, and the shard each holds."""
    from megatron.core import parallel_state as ps

    vpp, pp_rank = config.virtual_pipeline_model_parallel_size, ps.get_pipeline_model_parallel_rank()
    chunks, shards = [], []
    for vp in [None] if vpp is None else range(vpp):
        shard = stage_shard(config, tp_rank=ps.get_tensor_model_parallel_rank(),
                            ep_rank=ps.get_expert_model_parallel_rank(),
                            etp_rank=ps.get_expert_tensor_parallel_rank(), pp_rank=pp_rank, vp_stage=vp)
        chunks.append(build_gpt_model(hf, config, pre_process=shard.pre_process, post_process=shard.post_process,
                                      vp_stage=vp, pp_rank=pp_rank).to(device))
        shards.append(shard)
    if compile:  # dynamic shapes: one graph serves every layer and packed length (see spec._PassTPGroup)
        for layer in (layer for chunk in chunks for layer in chunk.decoder.layers):
            layer.compile(dynamic=True)
    return chunks, shards


def parameters(chunks: Sequence[torch.nn.Module]) -> List[torch.Tensor]:
    """The parameters of model chunks (megatron DDP modules), each once."""
    return list({id(p): p for c in chunks for p in c.module.parameters()}.values())


def inner_optimizers(optimizer) -> list:
    """The megatron optimizers of a (possibly chained) megatron optimizer."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def use_fused_adam(optimizer) -> int:
    """Switch megatron's torch Adam (no TE, no apex) to torch's fused kernel; returns how many were switched."""
    from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER

    if not USING_PYTORCH_OPTIMIZER:
        return 0
    torch_opts = [o.optimizer for o in inner_optimizers(optimizer)]
    for group in (g for opt in torch_opts for g in opt.param_groups):
        group.update(fused=True, foreach=False)
    return len(torch_opts)
