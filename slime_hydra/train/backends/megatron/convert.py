"""Hugging Face checkpoints <-> megatron-core parameters, for every supported family: pure tensor functions
(the distributed gather is ``weights.py``'s).

*HF names* are a safetensors checkpoint's (what SGLang loads). *Global megatron names* are a ``GPTModel``'s
with global layer and expert ids and full tensors; *local names* are one model chunk's ``state_dict``'s
(ids from the chunk's first layer and the rank's first expert, tensors sharded by TP). ``linear_qkv`` fuses
q, k, v per query group (a TP shard is a block of groups); ``linear_fc1`` is ``[gate; up]`` per TP rank; the
vocabulary is padded with zero rows. The tables are in the local spec's names; ``Layout.te`` renames for TE.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from slime_hydra.train.backends.megatron.families import family, moe_layers, padded_vocab_size

# TP split kinds of a megatron parameter
COL, ROW, GLU, REP, VOCAB = "col", "row", "glu", "rep", "vocab"


@dataclass(frozen=True)
class Layout:
    """What conversion needs to know about a model (from its HF config; see ``from_hf``)."""

    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tied: bool
    moe: Tuple[int, ...]  # 0/1 per layer
    num_experts: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False  # GLM-4
    mla: bool = False
    q_lora: bool = False
    shared_experts: bool = False
    expert_bias: bool = False
    te: bool = False  # Transformer Engine module names

    @classmethod
    def from_hf(cls, hf, tp: int = 1, te: Optional[bool] = None) -> "Layout":
        """``te``: Transformer Engine module names (None: whether the spec uses TE, i.e. it is importable)."""
        if te is None:
            from slime_hydra.train.backends.megatron.spec import HAVE_TE as te
        fam = family(hf)
        moe = tuple(moe_layers(hf))
        return cls(
            family=fam, num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            vocab_size=hf.vocab_size, padded_vocab_size=padded_vocab_size(hf.vocab_size, tp),
            tied=bool(hf.tie_word_embeddings), moe=moe,
            num_experts=0 if not any(moe) else hf.n_routed_experts if fam == "deepseek_v3" else hf.num_experts,
            qkv_bias=fam == "glm4" and bool(hf.attention_bias), qk_norm=fam in ("qwen3", "qwen3_moe"),
            post_norms=fam == "glm4", mla=fam == "deepseek_v3",
            q_lora=fam == "deepseek_v3" and hf.q_lora_rank is not None,
            shared_experts=fam == "deepseek_v3" and bool(hf.n_shared_experts),
            expert_bias=fam == "deepseek_v3", te=te,
        )


@dataclass(frozen=True)
class Rule:
    """One megatron parameter of a layer: its HF sources and how it is TP-split."""

    megatron: str  # suffix after ``decoder.layers.<i>.``
    hf: Tuple[str, ...]  # suffixes after ``model.layers.<i>.``; several are fused
    split: str  # COL | ROW | GLU | REP
    fuse: str = "cat"  # cat | qkv (several HF tensors -> one megatron tensor)


def layer_rules(layout: Layout, layer: int) -> List[Rule]:
    """The rules of global layer ``layer``, except the routed experts (``expert_rules``)."""
    rules = [Rule("input_layernorm.weight", ("input_layernorm.weight",), REP)]
    if layout.mla:
        down = COL  # the local spec's ColumnParallelLinear shards the down projections (TE replicates them)
        if layout.q_lora:
            rules += [Rule("self_attention.linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",), down),
                      Rule("self_attention.q_layernorm.weight", ("self_attn.q_a_layernorm.weight",), REP),
                      Rule("self_attention.linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",), COL)]
        else:
            rules.append(Rule("self_attention.linear_q_proj.weight", ("self_attn.q_proj.weight",), COL))
        rules += [Rule("self_attention.linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",), down),
                  Rule("self_attention.kv_layernorm.weight", ("self_attn.kv_a_layernorm.weight",), REP),
                  Rule("self_attention.linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",), COL)]
    else:
        qkv = tuple(f"self_attn.{p}_proj.weight" for p in "qkv")
        rules.append(Rule("self_attention.linear_qkv.weight", qkv, COL, fuse="qkv"))
        if layout.qkv_bias:
            rules.append(Rule("self_attention.linear_qkv.bias", tuple(f"self_attn.{p}_proj.bias" for p in "qkv"),
                              COL, fuse="qkv"))
        if layout.qk_norm:
            rules += [Rule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), REP),
                      Rule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), REP)]
    rules.append(Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), ROW))
    rules.append(Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), REP))
    if layout.post_norms:
        rules += [Rule("self_attention.linear_proj.post_layernorm.weight", ("post_self_attn_layernorm.weight",), REP),
                  Rule("mlp.linear_fc2.post_layernorm.weight", ("post_mlp_layernorm.weight",), REP)]
    if layout.moe[layer]:
        rules.append(Rule("mlp.router.weight", ("mlp.gate.weight",), REP))
        if layout.expert_bias:
            rules.append(Rule("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",), REP))
        if layout.shared_experts:
            rules += [Rule("mlp.shared_experts.linear_fc1.weight",
                           ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"), GLU),
                      Rule("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_experts.down_proj.weight",), ROW)]
    elif layout.family == "glm4":
        rules += [Rule("mlp.linear_fc1.weight", ("mlp.gate_up_proj.weight",), GLU),
                  Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), ROW)]
    else:
        rules += [Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GLU),
                  Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), ROW)]
    return rules


def expert_rules(e: int) -> List[Rule]:
    """Routed expert ``e`` (global id) of an MoE layer; split by expert tensor parallelism."""
    return [Rule(f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                 (f"mlp.experts.{e}.gate_proj.weight", f"mlp.experts.{e}.up_proj.weight"), GLU),
            Rule(f"mlp.experts.local_experts.{e}.linear_fc2.weight", (f"mlp.experts.{e}.down_proj.weight",), ROW)]


TOP_RULES = {  # megatron name -> (HF name, split)
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", VOCAB),
    "decoder.final_layernorm.weight": ("model.norm.weight", REP),
    "output_layer.weight": ("lm_head.weight", VOCAB),
}


@dataclass(frozen=True)
class Shard:
    """Which part of the model one megatron model chunk holds."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: Optional[int] = None  # None: = tp_rank (megatron's default expert TP is the TP)
    etp_size: Optional[int] = None
    layers: Optional[Tuple[int, ...]] = None  # global layer ids of the chunk; None: all
    pre_process: bool = True  # holds the embedding (first pipeline stage)
    post_process: bool = True  # holds the final norm and output layer (last stage)

    def chunk_layers(self, layout: Layout) -> Tuple[int, ...]:
        return tuple(range(layout.num_layers)) if self.layers is None else tuple(self.layers)

    @property
    def etp(self) -> Tuple[int, int]:
        return (self.tp_rank if self.etp_rank is None else self.etp_rank,
                self.tp_size if self.etp_size is None else self.etp_size)

    def local_experts(self, layout: Layout) -> range:
        if layout.num_experts % self.ep_size:
            raise ValueError(f"{layout.num_experts} experts do not split over expert parallel size {self.ep_size}")
        n = layout.num_experts // self.ep_size
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)


def stage_shard(config, *, tp_rank: int = 0, ep_rank: int = 0, etp_rank: Optional[int] = None, pp_rank: int = 0,
                vp_stage: Optional[int] = None) -> Shard:
    """The shard (``pp_rank``, ``vp_stage``) builds; ``etp_rank`` is needed where expert TP differs from TP."""
    from slime_hydra.train.backends.megatron.spec import stage_layers

    tp, etp = config.tensor_model_parallel_size, config.expert_tensor_parallel_size
    if etp_rank is None:
        if etp != tp:
            raise ValueError(f"expert tensor parallel size {etp} != TP size {tp}: pass etp_rank")
        etp_rank = tp_rank
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    first = pp_rank == 0 and (vp_stage is None or vp_stage == 0)
    last = pp_rank == pp - 1 and (vp_stage is None or vpp is None or vp_stage == vpp - 1)
    return Shard(tp_rank=tp_rank, tp_size=tp, ep_rank=ep_rank, ep_size=config.expert_model_parallel_size,
                 etp_rank=etp_rank, etp_size=etp, layers=tuple(stage_layers(config, pp_rank, vp_stage)),
                 pre_process=first, post_process=last)


def split_tp(full: torch.Tensor, split: str, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s piece of a full megatron tensor."""
    if size == 1 or split == REP:
        return full
    if split in (COL, VOCAB):
        return full.chunk(size, dim=0)[rank]
    if split == ROW:
        return full.chunk(size, dim=1)[rank]
    if split == GLU:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    raise ValueError(split)


def gather_tp(pieces: Sequence[torch.Tensor], split: str) -> torch.Tensor:
    """The full megatron tensor from every TP rank's piece (inverse of ``split_tp``)."""
    if len(pieces) == 1 or split == REP:
        return pieces[0]
    if split in (COL, VOCAB):
        return torch.cat(list(pieces), dim=0)
    if split == ROW:
        return torch.cat(list(pieces), dim=1)
    if split == GLU:
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    raise ValueError(split)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_TE_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def te_name(suffix: str, layout: Layout, layer: int) -> str:
    """A layer parameter's local-spec suffix -> its Transformer Engine spec suffix."""
    if layout.mla:
        suffix = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
                  "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
                  }.get(suffix, suffix)
    elif suffix == "input_layernorm.weight":
        suffix = "self_attention.linear_qkv.layer_norm_weight"
    if suffix == "pre_mlp_layernorm.weight" and not layout.moe[layer]:
        suffix = "mlp.linear_fc1.layer_norm_weight"
    m = _EXPERT.match(suffix)
    if m:
        suffix = f"mlp.experts.{m.group(2).replace('.weight', '')}.weight{m.group(1)}"
    return suffix


def from_te_name(suffix: str) -> str:
    """Inverse of ``te_name``."""
    m = _TE_EXPERT.match(suffix)
    if m:
        return f"mlp.experts.local_experts.{m.group(2)}.{m.group(1)}.weight"
    return {"self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
            "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
            "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}.get(suffix, suffix)


def split_kind(layout: Layout, name: str) -> Tuple[str, bool]:
    """(TP split kind, is a routed-expert parameter) of a global megatron name in local-spec naming."""
    if name in TOP_RULES:
        return TOP_RULES[name][1], False
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"not a megatron parameter name: {name!r}")
    layer, suffix = int(m.group(1)), m.group(2)
    e = _EXPERT.match(suffix)
    if e:
        return (GLU if e.group(2).startswith("linear_fc1") else ROW), True
    if layout.te and suffix in ("self_attention.linear_q_down_proj.weight",
                                "self_attention.linear_kv_down_proj.weight"):
        return REP, False  # TE's MLA down projections are duplicated across TP
    for rule in layer_rules(layout, layer):
        if rule.megatron == suffix:
            return rule.split, False
    raise KeyError(f"no conversion rule for decoder layer {layer} parameter {suffix!r} ({layout.family})")


def to_local(name: str, layout: Layout, shard: Shard) -> str:
    """Global megatron name -> the chunk's ``state_dict`` key (local layer / expert ids, TE names)."""
    m = _LAYER.match(name)
    if not m:
        return name
    layer, suffix = int(m.group(1)), m.group(2)
    local_layer = shard.chunk_layers(layout).index(layer)
    e = _EXPERT.match(suffix)
    if e:
        suffix = f"mlp.experts.local_experts.{int(e.group(1)) - shard.local_experts(layout).start}.{e.group(2)}"
    if layout.te:
        suffix = te_name(suffix, layout, layer)
    return f"decoder.layers.{local_layer}.{suffix}"


def to_global(local: str, layout: Layout, shard: Shard) -> str:
    """A chunk's ``state_dict`` key -> the global megatron name (local-spec naming)."""
    local = local.removeprefix("module.")
    m = _LAYER.match(local)
    if not m:
        return local
    layer, suffix = shard.chunk_layers(layout)[int(m.group(1))], m.group(2)
    if layout.te:
        suffix = from_te_name(suffix)
    e = _EXPERT.match(suffix)
    if e:
        suffix = f"mlp.experts.local_experts.{int(e.group(1)) + shard.local_experts(layout).start}.{e.group(2)}"
    return f"decoder.layers.{layer}.{suffix}"


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> torch.Tensor:
    g, d = layout.num_kv_heads, layout.head_dim
    rest = q.shape[1:]
    parts = [q.reshape(g, -1, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _unfuse_qkv(qkv: torch.Tensor, layout: Layout) -> List[torch.Tensor]:
    g, d = layout.num_kv_heads, layout.head_dim
    q_per_group = layout.num_heads // g * d
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g, q_per_group + 2 * d, *rest).split([q_per_group, d, d], dim=1)
    return [t.reshape(-1, *rest).clone() for t in (q, k, v)]


def _pad_vocab(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    extra = layout.padded_vocab_size - t.shape[0]
    if extra < 0:
        raise ValueError(f"vocabulary of {t.shape[0]} rows exceeds the padded size {layout.padded_vocab_size}")
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t


def _hf_get(hf: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return hf[name]
    except KeyError:
        raise KeyError(f"the Hugging Face checkpoint has no tensor {name!r}") from None


def megatron_params(layout: Layout, shard: Shard = Shard()) -> Iterator[Tuple[str, object]]:
    """(global megatron name, source: a layer's ``Rule`` or a top-level HF name) of each parameter of the chunk."""
    if shard.pre_process:
        yield "embedding.word_embeddings.weight", "model.embed_tokens.weight"
    for layer in shard.chunk_layers(layout):
        for rule in layer_rules(layout, layer):
            yield f"decoder.layers.{layer}.{rule.megatron}", rule
        if layout.moe[layer]:
            for e in shard.local_experts(layout):
                for rule in expert_rules(e):
                    yield f"decoder.layers.{layer}.{rule.megatron}", rule
    if shard.post_process:
        yield "decoder.final_layernorm.weight", "model.norm.weight"
        if not layout.tied:
            yield "output_layer.weight", "lm_head.weight"
        elif not shard.pre_process:  # a last stage keeps its own copy of the tied embedding
            yield "output_layer.weight", "model.embed_tokens.weight"


def full_megatron_tensor(hf: Mapping[str, torch.Tensor], layout: Layout, name: str, source) -> torch.Tensor:
    """One unsharded megatron tensor built from its HF tensors."""
    if isinstance(source, str):
        t = _hf_get(hf, source)
        return _pad_vocab(t, layout) if TOP_RULES[name][1] == VOCAB else t
    layer = int(_LAYER.match(name).group(1))
    parts = [_hf_get(hf, f"model.layers.{layer}.{s}") for s in source.hf]
    if source.fuse == "qkv":
        return _fuse_qkv(*parts, layout)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def iter_hf_to_megatron(hf: Mapping[str, torch.Tensor], layout: Layout,
                        shard: Shard = Shard()) -> Iterator[Tuple[str, torch.Tensor]]:
    """(local name, tensor) of one model chunk, one at a time, from a full HF state (a dict or ``HFCheckpoint``)."""
    for name, source in megatron_params(layout, shard):
        split, expert = split_kind(layout, name)
        rank, size = shard.etp if expert else (shard.tp_rank, shard.tp_size)
        full = full_megatron_tensor(hf, layout, name, source)
        yield to_local(name, layout, shard), split_tp(full, split, rank, size).contiguous()


def hf_to_megatron(hf: Mapping[str, torch.Tensor], layout: Layout, shard: Shard = Shard()) -> Dict[str, torch.Tensor]:
    """The ``state_dict`` (local names) of one model chunk."""
    return dict(iter_hf_to_megatron(hf, layout, shard))


def local_names(layout: Layout, shard: Shard = Shard()) -> List[str]:
    """The ``state_dict`` keys of one model chunk (``_extra_state`` entries aside)."""
    return [to_local(name, layout, shard) for name, _ in megatron_params(layout, shard)]


def megatron_to_hf(name: str, tensor: torch.Tensor, layout: Layout) -> List[Tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one full megatron tensor (global name); none for a tied output layer."""
    if name in TOP_RULES:
        if name == "output_layer.weight" and layout.tied:
            return []
        hf_name, split = TOP_RULES[name]
        return [(hf_name, tensor[: layout.vocab_size] if split == VOCAB else tensor)]
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"not a megatron parameter name: {name!r}")
    layer, suffix = int(m.group(1)), m.group(2)
    e = _EXPERT.match(suffix)
    rules = expert_rules(int(e.group(1))) if e else layer_rules(layout, layer)
    rule = next((r for r in rules if r.megatron == suffix), None)
    if rule is None:
        raise KeyError(f"no conversion rule for {name!r} ({layout.family})")
    names = [f"model.layers.{layer}.{s}" for s in rule.hf]
    if rule.fuse == "qkv":
        return list(zip(names, _unfuse_qkv(tensor, layout)))
    if len(names) == 1:
        return [(names[0], tensor)]
    return list(zip(names, [t.clone() for t in tensor.chunk(len(names), dim=0)]))


def megatron_state_to_hf(state: Mapping[str, torch.Tensor], layout: Layout) -> Dict[str, torch.Tensor]:
    """A whole unsharded megatron state (global names) -> HF state dict."""
    return {k: v for name, t in state.items() for k, v in megatron_to_hf(name, t, layout)}


def buckets(named: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    bucket: List[Tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


class HFCheckpoint(Mapping):
    """A (sharded) safetensors checkpoint directory as a read-on-demand mapping name -> tensor."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self._files = {k: os.path.join(path, v) for k, v in weight_map.items()}
        elif os.path.isfile(single):
            from safetensors import safe_open

            with safe_open(single, "pt") as f:
                self._files = {k: single for k in f.keys()}
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._files:
            raise KeyError(name)
        with safe_open(self._files[name], "pt") as f:
            return f.get_tensor(name)

    def __iter__(self):
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)
