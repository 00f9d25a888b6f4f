"""Our module specs for megatron-core's ``GPTModel``. Without Transformer Engine, core attention is
``SDPAttention`` (torch's SDPA; its varlen flash kernel for packed THD inputs, which megatron's local spec
cannot take) and norms are our ``RMSNorm``; with TE importable, megatron's TE spec is used. GLM-4's post
norms ride on the output projections (``*.post_layernorm``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, get_cuda_rng_tracker
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

try:  # Transformer Engine: used when importable
    importlib.import_module("transformer_engine")
    HAVE_TE = True
except ImportError:
    HAVE_TE = False
    # megatron-core 0.16.1 without Transformer Engine: multi_latent_attention believes TE is there (it sees
    # megatron's MagicMock stand-ins), and the MoE router reads an undefined ``te_general_gemm``
    import megatron.core.transformer.moe.moe_utils as _moe_utils
    import megatron.core.transformer.multi_latent_attention as _mla

    _mla.HAVE_TE = False
    if not hasattr(_moe_utils, "te_general_gemm"):
        _moe_utils.te_general_gemm = None


def packed_rotary_pos_emb(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1,
                          cp_rank: int = 0) -> torch.Tensor:
    """RoPE of packed (THD) sequences ``t`` [tokens, heads, d], each from position 0: one gather of ``freqs``
    [max_len, 1, 1, rot_dim] by position, with no host sync (megatron's unfused THD path loops over sequences
    on the host). Installed in TE's fused-kernel slot, which has no ``interleaved`` flag: interleaved and
    multi-latent rope keep megatron's path."""
    if cp_size != 1:
        raise ValueError("packed_rotary_pos_emb: context parallelism is not supported (cp_size must be 1)")
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    token = torch.arange(t.shape[0], device=t.device, dtype=cu_seqlens.dtype)
    start = cu_seqlens[torch.searchsorted(cu_seqlens[1:], token, right=True)]  # each token's sequence start
    return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[(token - start).long()]).squeeze(1)


def _rotary_pos_emb_bshd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """megatron's unfused RoPE of ``[s, b, h, d]`` inputs, in TE's fused slot (see :func:`packed_rotary_pos_emb`)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)


if not HAVE_TE:  # megatron's fused-RoPE slots (Transformer Engine's kernels when it is there): ours
    import megatron.core.models.common.embeddings.rope_utils as _rope_utils

    _rope_utils.fused_apply_rotary_pos_emb_thd = packed_rotary_pos_emb
    _rope_utils.fused_apply_rotary_pos_emb = _rotary_pos_emb_bshd


ATTENTION_IMPLS = ("auto", "sdpa", "te")
# Packed (THD) sequences on CUDA go through torch's varlen flash kernel when it exists; False: one SDPA
# call per sequence (for torch builds whose varlen kernel misbehaves)
USE_VARLEN = True


class RMSNorm(torch.nn.Module):
    """RMSNorm in float32, scaled in the input dtype as Hugging Face and SGLang do (bf16 log-probs agree with
    the engine's); its weight is marked for sequence parallelism, which megatron's torch-norm wrapper refuses."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)


class SDPAttention(MegatronModule):
    """Core attention through torch's fused kernels. Takes what megatron's core attention takes:
    ``[s, b, heads, d]`` tensors (or ``[t, heads, d]`` with THD ``packed_seq_params``), returns
    ``[s, b, heads * d_v]`` (``[t, heads, d_v]`` when packed). Causal only, no context parallelism."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, cp_comm_type=None, pg_collection=None, **_):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism needs Transformer Engine's attention; SDPAttention has none")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention supports causal self-attention only, got {attn_mask_type}")
        k_channels = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention bias")
        dropout = self.dropout_p if self.training else 0.0
        fork = dropout > 0 and not self.config.sequence_parallel  # as megatron's own core attention
        with get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                return self._packed(query, key, value, packed_seq_params, dropout)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
            mask = None if attention_mask is None else ~attention_mask  # megatron: True = masked out
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 is_causal=mask is None, scale=self.softmax_scale,
                                                 enable_gqa=k.shape[1] != q.shape[1])
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    def _packed(self, q, k, v, params, dropout):
        """[t, h, d] packed sequences, boundaries in ``cu_seqlens``: one flash call on CUDA, else a loop."""
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_k = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:  # a torch without variable-length flash attention
            varlen_attn = None
        if USE_VARLEN and varlen_attn and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not dropout:
            return _varlen_call(varlen_attn, q, k, v, cu_q, cu_k, params.max_seqlen_q, params.max_seqlen_kv,
                                self.softmax_scale)
        outs = []
        bounds = cu_q.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            qi, ki, vi = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))  # [1, h, len, d]
            o = F.scaled_dot_product_attention(qi, ki, vi, dropout_p=dropout, is_causal=True,
                                               scale=self.softmax_scale, enable_gqa=ki.shape[1] != qi.shape[1])
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs, dim=0)


def _varlen_call(varlen, q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """Call torch's varlen flash attention across its signature changes (first ``is_causal``; later
    ``window_size``, ``scale`` and ``enable_gqa``). Flash needs equal q/k/v head dims and, in
    the older signature, equal head counts: v is zero-padded and k/v heads repeated where needed."""
    params = inspect.signature(varlen).parameters
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    kw = {}
    if "enable_gqa" in params:
        kw["enable_gqa"] = k.shape[1] != q.shape[1]
    elif k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        kw["is_causal"] = True
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    if "scale" in params:
        out = varlen(q, k, v, cu_q, cu_k, int(max_q), int(max_k), scale=scale, **kw)
    else:  # the kernel's default scale is 1/sqrt(d): fold ours into q
        out = varlen(q * (scale * math.sqrt(q.shape[-1])), k, v, cu_q, cu_k, int(max_q), int(max_k), **kw)
    return out[..., :dv]


@functools.cache
def _with_post_norm(linear_cls: type, norm_cls: type) -> type:
    """``linear_cls`` followed by a norm of its output (GLM-4's post-attention / post-MLP norms)."""

    class PostNormLinear(linear_cls):
        def __init__(self, input_size, output_size, *, config, **kw):
            super().__init__(input_size, output_size, config=config, **kw)
            self.post_layernorm = norm_cls(config=config, hidden_size=output_size, eps=config.layernorm_epsilon)

        def forward(self, x):
            out, bias = super().forward(x)
            if bias is not None:
                out = out + bias
            return self.post_layernorm(out), None

    PostNormLinear.__name__ = PostNormLinear.__qualname__ = f"PostNorm{linear_cls.__name__}"
    return PostNormLinear


def resolve_attention_impl(impl: str) -> str:
    """``auto`` -> ``te`` when Transformer Engine is importable, else ``sdpa``."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl {impl!r}: expected one of {ATTENTION_IMPLS}")
    if impl == "auto":
        return "te" if HAVE_TE else "sdpa"
    if impl == "te" and not HAVE_TE:
        raise ValueError("attention impl 'te' needs Transformer Engine, which is not importable here")
    return impl


class _PassTPGroup:
    """megatron-core 0.16.1's TP linears call ``linear_with_grad_accumulation_and_async_allreduce`` without their
    TP group, which then warns on every call (a graph break under ``trainer.compile``): pass the group."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        return super()._forward_impl(input, weight, *args, **{**kwargs, "tp_group": self.tp_group})


class ColumnLinear(_PassTPGroup, ColumnParallelLinear):
    pass


class RowLinear(_PassTPGroup, RowParallelLinear):
    pass


def _local_layer_spec(config: TransformerConfig, moe: bool, post_norms: bool) -> ModuleSpec:
    """A transformer layer from megatron-core's own linears (the TP group passed: :class:`_PassTPGroup`; not
    in multi-latent attention, which accepts megatron's own classes only), our RMSNorm and SDPAttention."""
    row = RowParallelLinear if config.multi_latent_attention else RowLinear
    proj = fc2 = _with_post_norm(row, RMSNorm) if post_norms else row
    qk_norm = RMSNorm if config.qk_layernorm else IdentityOp
    if config.multi_latent_attention:
        attention = ModuleSpec(
            module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
            submodules=MLASelfAttentionSubmodules(
                linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
                linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
                linear_kv_up_proj=ColumnParallelLinear, core_attention=SDPAttention, linear_proj=proj,
                q_layernorm=qk_norm, kv_layernorm=qk_norm))
    else:
        attention = ModuleSpec(
            module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=ColumnLinear, core_attention=SDPAttention, linear_proj=proj,
                q_layernorm=qk_norm, k_layernorm=qk_norm))
    if moe:
        mlp = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=config.num_moe_experts,
                                              moe_grouped_gemm=False)
    else:
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnLinear, linear_fc2=fc2))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=RMSNorm, self_attention=attention, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=RMSNorm, mlp=mlp, mlp_bda=get_bias_dropout_add))


def _te_layer_spec(config: TransformerConfig, moe: bool, post_norms: bool, sdpa: bool) -> ModuleSpec:
    """megatron-core's Transformer Engine layer, with GLM-4's post norms and optionally SDPAttention."""
    from megatron.core.extensions.transformer_engine import TENorm, TERowParallelLinear
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec = copy.deepcopy(get_gpt_layer_with_transformer_engine_spec(
        num_experts=config.num_moe_experts if moe else None, moe_grouped_gemm=moe,
        qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention))
    attn = spec.submodules.self_attention.submodules
    if sdpa:
        attn.core_attention = SDPAttention
    if post_norms:
        attn.linear_proj = _with_post_norm(TERowParallelLinear, TENorm)
        spec.submodules.mlp.submodules.linear_fc2 = _with_post_norm(TERowParallelLinear, TENorm)
    return spec


def layer_spec(config: TransformerConfig, moe: bool, post_norms: bool = False, attention: str = "auto"):
    """The spec of one transformer layer (dense or MoE)."""
    impl = resolve_attention_impl(attention)
    if impl == "sdpa" and not HAVE_TE:
        return _local_layer_spec(config, moe, post_norms)
    return _te_layer_spec(config, moe, post_norms, sdpa=impl == "sdpa")


def is_moe_layer(config: TransformerConfig, layer: int) -> bool:
    """Whether global layer ``layer`` (0-based) is a mixture-of-experts layer (``moe_layer_freq``)."""
    if not config.num_moe_experts:
        return False
    freq = config.moe_layer_freq
    return bool(freq[layer]) if isinstance(freq, list) else layer % freq == 0


def stage_layers(config: TransformerConfig, pp_rank: int = 0, vp_stage: Optional[int] = None) -> List[int]:
    """Global ids of the decoder layers that pipeline rank ``pp_rank`` (virtual stage ``vp_stage``) builds."""
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)))


def decoder_block_spec(config: TransformerConfig, post_norms: bool = False, attention: str = "auto",
                       pp_rank: int = 0, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """The layers of one pipeline stage (or virtual stage) and the final norm."""
    specs = [layer_spec(config, is_moe_layer(config, i), post_norms, attention)
             for i in stage_layers(config, pp_rank, vp_stage)]
    resolve_attention_impl(attention)
    final_norm = RMSNorm
    if HAVE_TE:
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm)
