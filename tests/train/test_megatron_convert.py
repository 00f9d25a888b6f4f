"""Hugging Face <-> Megatron conversion is exact for every supported family (tiny random models):
the converted megatron GPTModel gives the HF model's logits and log-probs, and the weights come back
bit for bit, whole or split over TP / PP / EP ranks."""

from __future__ import annotations

import pytest
import torch

from slime_hydra.train.backends.megatron.convert import (  # noqa: E402  (after the importorskip in megatron_cpu)
    HFCheckpoint,
    Layout,
    Shard,
    gather_tp,
    hf_to_megatron,
    megatron_state_to_hf,
    split_kind,
    stage_shard,
    to_global,
)
from tests.megatron_cpu import (
    FAMILIES,
    megatron_model,
    megatron_on_cpu,
    saved_checkpoint,
    tiny_hf_config,
    tiny_hf_model,
)


@pytest.fixture(scope="module")
def cpu_megatron():
    with megatron_on_cpu():
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (HF model, its sharded checkpoint directory, the checkpoint's tensors)."""
    out = {}
    for fam in FAMILIES:
        model = tiny_hf_model(fam)
        path = str(tmp_path_factory.mktemp(fam))
        out[fam] = (model, path, saved_checkpoint(model, path))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_forward_matches_hf(family, checkpoints, cpu_megatron):
    """HF checkpoint -> megatron: the same logits (batched [s, b] inputs) and the same response
    log-probs (packed THD micro-batch through SDPAttention's packed path), to 1e-4 in float32."""
    from slime_hydra.train.backends.megatron.logprobs import packed_response_log_probs
    from slime_hydra.train.backends.megatron.packing import pack

    hf_model, path, _ = checkpoints[family]
    hf_config = hf_model.config
    model = megatron_model(hf_config)
    own = model.state_dict()
    converted = hf_to_megatron(HFCheckpoint(path), Layout.from_hf(hf_config))
    assert {k for k in own if not k.endswith("_extra_state")} == set(converted)
    model.load_state_dict(converted, strict=False)

    torch.manual_seed(1)
    ids = torch.randint(0, hf_config.vocab_size, (2, 16))
    with torch.no_grad():
        ref = hf_model(ids).logits
        out = model(ids, torch.arange(16).expand(2, 16), None)
    assert out.shape[-1] == 128  # vocabulary padded to a multiple of 128
    assert (out[..., :hf_config.vocab_size] - ref).abs().max() < 1e-4
    assert ref.abs().max() > 0.5  # the comparison is not between near-zero logits

    seqs = [torch.randint(0, hf_config.vocab_size, (n,)).tolist() for n in (7, 12, 4)]
    resp = [3, 5, 1]
    batch = pack(seqs, resp, [0, 1, 2], pad_to_multiple=8)
    with torch.no_grad():
        packed = model(batch.input_ids, batch.position_ids, None, packed_seq_params=batch.packed_seq_params())
        lp, _ = packed_response_log_probs(packed, batch, vocab_size=hf_config.vocab_size)
        expect = []
        for s, r in zip(seqs, resp):
            logp = torch.log_softmax(hf_model(torch.tensor([s])).logits[0], -1)
            expect.append(logp[len(s) - r - 1:len(s) - 1].gather(-1, torch.tensor(s[len(s) - r:])[:, None])[:, 0])
    assert (lp - torch.cat(expect)).abs().max() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_exact(family, checkpoints):
    """HF -> megatron (unsharded) -> HF gives back every tensor of the checkpoint, bit for bit."""
    hf_model, _, tensors = checkpoints[family]
    layout = Layout.from_hf(hf_model.config)
    back = megatron_state_to_hf(hf_to_megatron(tensors, layout), layout)
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def _merge(shards_state, layout, shards):
    """Per-rank local state dicts -> global names -> full tensors (gathering TP pieces)."""
    pieces = {}
    for state, shard in zip(shards_state, shards):
        for local, t in state.items():
            by_tp = pieces.setdefault(to_global(local, layout, shard), {})
            if shard.tp_rank in by_tp:  # replicated over EP (or a tied copy): must agree
                assert torch.equal(by_tp[shard.tp_rank], t), local
            by_tp[shard.tp_rank] = t
    return {name: gather_tp([by_tp[r] for r in sorted(by_tp)], split_kind(layout, name)[0])
            for name, by_tp in pieces.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_shards_round_trip(family, checkpoints):
    """TP = 2: each rank's tensors are the halves megatron expects, and gathering them gives the
    unsharded conversion back, hence the HF checkpoint bit for bit."""
    hf_model, _, tensors = checkpoints[family]
    layout = Layout.from_hf(hf_model.config, tp=2)
    assert layout.padded_vocab_size == 256
    shards = [Shard(tp_rank=r, tp_size=2) for r in (0, 1)]
    states = [hf_to_megatron(tensors, layout, s) for s in shards]
    full = hf_to_megatron(tensors, layout)
    for name, t in states[0].items():
        split, _ = split_kind(layout, name)
        assert t.shape == (full[name].shape if split == "rep" else
                           (full[name].shape[0] // 2, *full[name].shape[1:]) if split != "row" else
                           (full[name].shape[0], full[name].shape[1] // 2)), name
        if split != "rep":
            assert not torch.equal(t, states[1][name]), name
    merged = {}
    for name in full:
        split, _ = split_kind(layout, name)
        merged[name] = gather_tp([s[name] for s in states], split)
        assert torch.equal(merged[name], full[name]), name
    back = megatron_state_to_hf(merged, layout)
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_tp2_qkv_shard_holds_whole_query_groups(checkpoints):
    """A TP rank's fused QKV rows are its query groups' q, k and v (megatron's interleaved layout)."""
    hf_model, _, tensors = checkpoints["qwen3"]
    layout = Layout.from_hf(hf_model.config, tp=2)
    rank1 = hf_to_megatron(tensors, layout, Shard(tp_rank=1, tp_size=2))
    rank1 = rank1["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (tensors[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    d = layout.head_dim  # 2 groups, 2 query heads each: rank 1 holds group 1
    assert torch.equal(rank1, torch.cat([q[2 * d:4 * d], k[d:2 * d], v[d:2 * d]]))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "llama"])
def test_pp2_ep2_shards_round_trip(family, checkpoints, cpu_megatron):
    """PP = 2 (megatron's own layer split) x EP = 2 x TP = 2: every tensor lands on exactly the ranks
    that hold it (embedding first stage, head last stage; a tied embedding's copy on the last stage),
    and merging all ranks gives the checkpoint back bit for bit."""
    from slime_hydra.train.backends.megatron.model import Parallel, transformer_config

    hf_model, _, tensors = checkpoints[family]
    moe = family != "llama"
    config = transformer_config(hf_model.config, Parallel(tp=2, pp=2, ep=2 if moe else 1), dtype=torch.float32)
    layout = Layout.from_hf(hf_model.config, tp=2)
    shards = [stage_shard(config, tp_rank=t, ep_rank=e, pp_rank=p)
              for p in (0, 1) for e in ((0, 1) if moe else (0,)) for t in (0, 1)]
    assert [s.layers for s in shards[:1] + shards[-1:]] == [(0,), (1,)]
    states = [hf_to_megatron(tensors, layout, s) for s in shards]
    first, last = states[0], states[-1]
    assert "embedding.word_embeddings.weight" in first and "embedding.word_embeddings.weight" not in last
    assert "output_layer.weight" in last and "decoder.final_layernorm.weight" not in first
    if moe:  # local expert ids restart at 0 on each EP rank
        assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight" in last
        assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in last
    merged = _merge(states, layout, shards)
    if layout.tied:  # the last stage's copy of the tied embedding is the embedding
        assert torch.equal(merged.pop("output_layer.weight"), merged["embedding.word_embeddings.weight"])
    back = megatron_state_to_hf(merged, layout)
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_unsupported_configs_are_named():
    from transformers import Qwen2Config

    from slime_hydra.train.backends.megatron.model import transformer_config

    with pytest.raises(ValueError, match="model_type 'qwen2'"):
        transformer_config(Qwen2Config(num_hidden_layers=1))
    with pytest.raises(ValueError, match="unknown TransformerConfig field.*recompute_granularty"):
        transformer_config(tiny_hf_config("qwen3"), overrides={"recompute_granularty": "full"})
    with pytest.raises(KeyError, match="no tensor 'model.layers.0.input_layernorm.weight'"):
        hf_to_megatron({}, Layout.from_hf(tiny_hf_config("qwen3")), Shard(layers=(0,), pre_process=False,
                                                                            post_process=False))


def test_virtual_pipeline_and_uneven_stages_follow_megatron():
    """Chunks of the interleaved schedule (PP = 2 x VPP = 2 of 8 layers) and uneven first/last stages
    get megatron's layers; only the very first chunk embeds and only the very last one has the head."""
    from slime_hydra.train.backends.megatron.model import Parallel, transformer_config

    hf = tiny_hf_config("qwen3")
    config = transformer_config(hf, Parallel(pp=2, vpp=2), dtype=torch.float32, overrides={"num_layers": 8})
    chunks = {(p, v): stage_shard(config, pp_rank=p, vp_stage=v) for p in (0, 1) for v in (0, 1)}
    assert {k: s.layers for k, s in chunks.items()} == {(0, 0): (0, 1), (1, 0): (2, 3), (0, 1): (4, 5),
                                                       (1, 1): (6, 7)}
    assert [k for k, s in chunks.items() if s.pre_process] == [(0, 0)]
    assert [k for k, s in chunks.items() if s.post_process] == [(1, 1)]
    uneven = transformer_config(hf, Parallel(pp=3), dtype=torch.float32,
                                overrides={"num_layers": 7, "num_layers_in_first_pipeline_stage": 1,
                                           "num_layers_in_last_pipeline_stage": 2})
    assert [stage_shard(uneven, pp_rank=p).layers for p in range(3)] == [(0,), (1, 2, 3, 4), (5, 6)]


@pytest.mark.parametrize("family", FAMILIES)
def test_transformer_engine_names_round_trip(family):
    """With Transformer Engine the norms fuse into the next linear and experts are grouped: every
    parameter gets a distinct TE name, which maps back."""
    from slime_hydra.train.backends.megatron.convert import from_te_name, megatron_params, te_name

    layout = Layout.from_hf(tiny_hf_config(family), te=False)
    seen = set()
    for name, _ in megatron_params(layout):
        if not name.startswith("decoder.layers."):
            continue
        layer, suffix = int(name.split(".")[2]), name.split(".", 3)[3]
        te = te_name(suffix, layout, layer)
        assert from_te_name(te) == suffix and (layer, te) not in seen
        seen.add((layer, te))
    if family == "qwen3":
        assert te_name("input_layernorm.weight", layout, 0) == "self_attention.linear_qkv.layer_norm_weight"
        assert te_name("pre_mlp_layernorm.weight", layout, 0) == "mlp.linear_fc1.layer_norm_weight"
    if family == "qwen3_moe":
        assert te_name("pre_mlp_layernorm.weight", layout, 0) == "pre_mlp_layernorm.weight"
        assert te_name("mlp.experts.local_experts.3.linear_fc2.weight", layout, 0) == "mlp.experts.linear_fc2.weight3"
