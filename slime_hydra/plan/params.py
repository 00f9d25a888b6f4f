"""Parameter counts of a model shape (``model.arch``), in closed form: no torch import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Tuple

if TYPE_CHECKING:
    from slime_hydra.config.schema import ArchConfig, RunConfig

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"model.dtype: no byte size for {dtype!r} (known: {', '.join(DTYPE_BYTES)})")
    return DTYPE_BYTES[dtype]


@dataclass
class ParamCount:
    total: int
    experts: int  # routed experts' weights (expert parallelism shards these)
    lm_head: int  # an untied output layer (0 when tied to the embeddings)

    @property
    def dense(self) -> int:
        return self.total - self.experts


def head_dim(a: "ArchConfig") -> int:
    return a.head_dim or a.hidden_size // a.num_heads


def is_mla(a: "ArchConfig") -> bool:
    return a.type == "deepseek_v3"


def _attention_shapes(a: "ArchConfig") -> Dict[str, Tuple[int, int]]:
    """Hugging Face linear-layer name -> (in, out) of one decoder layer's attention."""
    h, nh = a.hidden_size, a.num_heads
    if not is_mla(a):
        q, kv = nh * head_dim(a), a.num_kv_heads * head_dim(a)
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    q = {"q_a_proj": (h, a.q_lora_rank), "q_b_proj": (a.q_lora_rank, nh * qk)} if a.q_lora_rank else \
        {"q_proj": (h, nh * qk)}
    return {**q, "kv_a_proj_with_mqa": (h, a.kv_lora_rank + a.qk_rope_head_dim),
            "kv_b_proj": (a.kv_lora_rank, nh * (a.qk_nope_head_dim + a.v_head_dim)), "o_proj": (nh * a.v_head_dim, h)}


def _attention_params(a: "ArchConfig") -> int:
    h = a.hidden_size
    n = sum(i * o for i, o in _attention_shapes(a).values())
    if is_mla(a):  # the low-rank norms, and the biases of the down-projections and o_proj
        low_rank = (a.q_lora_rank or 0) + a.kv_lora_rank
        return n + low_rank + a.attention_bias * (low_rank + a.qk_rope_head_dim + h)
    hd = head_dim(a)
    q, kv = a.num_heads * hd, a.num_kv_heads * hd
    if a.type == "qwen2" or a.attention_bias:  # Qwen2 always has q/k/v biases
        n += q + 2 * kv
    if a.attention_bias and a.type in ("qwen3", "qwen3_moe", "llama"):  # and these an o_proj bias
        n += h
    if a.type in ("qwen3", "qwen3_moe"):
        n += 2 * hd  # q_norm, k_norm
    return n


def moe_layers(a: "ArchConfig") -> int:
    return a.num_layers - (a.first_k_dense_layers if a.type == "deepseek_v3" else 0) if a.num_experts else 0


def param_count(a: "ArchConfig") -> ParamCount:
    """Parameters of the Hugging Face model that ``model.hf.hf_config(a)`` builds."""
    h = a.hidden_size
    norms = (4 if a.type == "glm4" else 2) * h
    dense_mlp = 3 * h * a.intermediate_size
    n_moe = moe_layers(a)
    routed = a.num_experts * 3 * h * (a.moe_intermediate_size or 0)
    shared = 3 * h * (a.moe_intermediate_size or 0) * a.num_shared_experts
    moe_mlp = a.num_experts * h + routed + shared  # router, routed and shared experts
    layers = a.num_layers * (_attention_params(a) + norms) + (a.num_layers - n_moe) * dense_mlp + n_moe * moe_mlp
    lm_head = 0 if a.tie_word_embeddings else a.vocab_size * h
    return ParamCount(total=a.vocab_size * h + layers + h + lm_head, experts=n_moe * routed, lm_head=lm_head)


def linear_shapes(a: "ArchConfig") -> Dict[str, Tuple[int, int, int]]:
    """Hugging Face linear-layer name -> (in, out, how many in the model): what LoRA can adapt (MLPs: the dense
    layers only, MoE experts are fused)."""
    h, f, dense = a.hidden_size, a.intermediate_size, a.num_layers - moe_layers(a)
    mlp = {"gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h), "gate_up_proj": (h, 2 * f)}
    return {**{k: (i, o, a.num_layers) for k, (i, o) in _attention_shapes(a).items()},
            **{k: (i, o, dense) for k, (i, o) in mlp.items()}}


def lora_params(cfg: "RunConfig") -> int:
    """Parameters of the LoRA adapters: rank x (in + out) per adapted linear layer."""
    from slime_hydra.train.backends.torch.lora import LORA_TARGET_MODULES

    lora, a = cfg.trainer.lora, cfg.model.arch
    names = lora.target_modules if lora.target_modules is not None else LORA_TARGET_MODULES.get(a.type, [])
    shapes = linear_shapes(a)
    return sum(lora.rank * (i + o) * k for i, o, k in (shapes[n] for n in names if n in shapes))

