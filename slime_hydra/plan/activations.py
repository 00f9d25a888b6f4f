"""Activation bytes of one micro-batch's forward and backward pass (docs/memory.md says what is counted)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Tuple

from slime_hydra.plan.params import head_dim, is_mla, moe_layers

if TYPE_CHECKING:
    from slime_hydra.config.schema import ArchConfig, RunConfig

LOGPROB_CHUNK = 4096  # slime_hydra.train.batch.response_log_probs processes this many positions at once
HEAD_CHUNK_ROWS = 1024  # = slime_hydra.train.logprobs.HEAD_CHUNK_ROWS (trainer.fused_logprobs)
MEGATRON_LOGPROB_CHUNK_BYTES = 256 * 2**20  # = slime_hydra.train.backends.megatron.logprobs.DEFAULT_CHUNK_BYTES

# Activation bytes per token of one decoder layer (docs/memory.md). "h": per hidden unit,
# "attn_norm"/"attn": per query + key/value width with / without Qwen3's q/k RMSNorm, "ffn": per MLP unit.
ACT_AUTOCAST = {"h": 26, "attn_norm": 10, "attn": 4, "ffn": 8, "const": 8}
ACT_FP32 = {"h": 24, "attn_norm": 16, "attn": 8, "ffn": 16, "const": 8}
# trainer.compile (the torch backend compiles each decoder layer): inductor's partitioner keeps the matmuls' outputs
# in model.dtype and recomputes the norms, rotary embedding and SiLU from them in the backward pass. Also per head:
# "heads" per query head (the attention's float32 log-sum-exp; the eager tables fold it into "attn"),
# "norm_heads" per query and key/value head (the float32 rsqrt of Qwen3's q/k norms).
ACT_COMPILED_AUTOCAST = {"h": 10, "attn_norm": 6, "attn": 4, "ffn": 6, "const": 8, "heads": 4, "norm_heads": 4}
ACT_COMPILED_FP32 = {"h": 16, "attn_norm": 12, "attn": 8, "ffn": 12, "const": 8, "heads": 4, "norm_heads": 4}
ACT_EXTRA_NORMS = 12  # GLM-4's post_self_attn / post_mlp norms, per hidden unit
ACT_MOE = {"h": 14, "expert": 4, "routed_ffn": 16, "routed": 17}
ACT_MLA_LOW_RANK = 10
ACT_BASE = 8  # per hidden unit, outside the layers (embedding output, final norm)


def layer_act_bytes(a: "ArchConfig", table: Dict[str, float], moe: bool) -> Tuple[float, float]:
    """Bytes one token keeps for the backward pass in one decoder layer, as (per-hidden-unit part, the rest):
    tensor parallelism splits the rest, and the first part only with sequence parallelism."""
    h, nh = a.hidden_size, a.num_heads
    if is_mla(a):
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        low_rank = (a.q_lora_rank or 0) + a.kv_lora_rank + a.qk_rope_head_dim
        attn = table["attn"] * nh * (2 * qk + a.v_head_dim) + ACT_MLA_LOW_RANK * low_rank
    else:
        width = (a.num_heads + a.num_kv_heads) * head_dim(a)
        qk_norm = a.type in ("qwen3", "qwen3_moe")
        attn = (table["attn_norm"] if qk_norm else table["attn"]) * width + table.get("heads", 0) * nh
        attn += table.get("norm_heads", 0) * (nh + a.num_kv_heads) if qk_norm else 0
    hidden = table["h"] * h + table["const"] + (ACT_EXTRA_NORMS * h if a.type == "glm4" else 0)
    if not moe:
        return hidden, attn + table["ffn"] * a.intermediate_size
    fm = a.moe_intermediate_size or 0
    routed = a.num_experts_per_tok * (ACT_MOE["routed_ffn"] * fm + ACT_MOE["routed"])
    shared = table["ffn"] * fm * a.num_shared_experts
    return hidden + ACT_MOE["h"] * h, attn + ACT_MOE["expert"] * a.num_experts + routed + shared


@dataclass
class MicroBatchShape:
    samples: int
    prompt_len: int
    response_len: int

    @property
    def positions(self) -> int:
        return self.samples * (self.prompt_len + self.response_len)

    @property
    def response_tokens(self) -> int:
        return self.samples * self.response_len


def rank_step_samples(cfg: "RunConfig", data_parallel: int) -> int:
    """Samples one data-parallel rank trains in an optimiser step."""
    t, r = cfg.trainer, cfg.rollout
    return max(1, (t.global_batch_size or r.batch_size * r.n_samples_per_prompt) // max(data_parallel, 1))


def micro_batch_shape(cfg: "RunConfig", data_parallel: int) -> MicroBatchShape:
    """The largest micro-batch a trainer rank runs: at most ``trainer.micro_batch_size`` full-length samples."""
    r = cfg.rollout
    return MicroBatchShape(min(cfg.trainer.micro_batch_size, rank_step_samples(cfg, data_parallel)),
                           r.max_prompt_len or 0, r.max_response_len)


def activation_bytes(a: "ArchConfig", mb: MicroBatchShape, *, compute_bytes: int, autocast: bool, residual_bytes: int,
                     checkpointing: bool, tensor_parallel: int = 1, sequence_parallel: bool = False,
                     layers_held: float = 1.0, vocab_parallel_head: bool = False, fused_head: bool = False,
                     compiled: bool = False) -> Dict[str, float]:
    """Peak activation bytes of one micro-batch's forward and backward: the decoder layers and the log-prob
    head. ``layers_held``: how many times the layer stack's activations are held (pipeline stages). The head
    is the torch backend's (``fused_head``: fused_logprobs) or the megatron one's (``vocab_parallel_head``)."""
    compiled = compiled and not is_mla(a)
    autocast_table, fp32_table = (ACT_COMPILED_AUTOCAST, ACT_COMPILED_FP32) if compiled else (ACT_AUTOCAST, ACT_FP32)
    table = autocast_table if autocast else {k: v * compute_bytes / 4 for k, v in fp32_table.items()}
    tp, h_split = tensor_parallel, tensor_parallel if sequence_parallel else 1

    def per_layer(moe: bool) -> float:
        hidden, rest = layer_act_bytes(a, table, moe)
        return hidden / h_split + rest / tp

    n_moe = moe_layers(a)
    dense_layer, moe_layer = per_layer(False), (per_layer(True) if n_moe else 0.0)
    if checkpointing:  # each layer keeps its input; one layer at a time is recomputed in full
        per_token = layers_held * a.num_layers * residual_bytes * a.hidden_size / h_split + max(dense_layer, moe_layer)
    else:
        per_token = layers_held * ((a.num_layers - n_moe) * dense_layer + n_moe * moe_layer)
    layers = (per_token + ACT_BASE * a.hidden_size / h_split) * mb.positions
    if vocab_parallel_head:
        head = a.vocab_size / tp * 2 * compute_bytes * mb.positions + MEGATRON_LOGPROB_CHUNK_BYTES
        return {"layers": layers, "logits": head}
    if fused_head:
        head = (compute_bytes * a.hidden_size * mb.response_tokens + 4 * 5 * min(HEAD_CHUNK_ROWS, mb.response_tokens)
                * a.vocab_size + (compute_bytes + 4) * a.vocab_size * a.hidden_size)
        return {"layers": layers, "logits": head}
    head = a.vocab_size / tp * (compute_bytes * mb.positions + (compute_bytes + 8) * mb.response_tokens
                                + 8 * min(LOGPROB_CHUNK, mb.response_tokens))
    return {"layers": layers, "logits": head}
