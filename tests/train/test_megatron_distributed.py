"""The collective parts on two real gloo ranks: vocab-parallel log-probs / entropy and their gradient
with TP = 2, the Hugging Face weight export gathered over TP = 2, PP = 2 and EP = 2, and megatron
GPTModels at TP = 2 loaded from the converter's shards giving the Hugging Face model's log-probs.

Layouts, shards and the expected log-probs are worked out here and handed to the ranks."""

from __future__ import annotations

import pytest
import torch

BUCKET_BYTES = 8 * 1024


def _logprobs_tp2(rank: int, group, fuse: bool = False) -> None:
    """``fuse``: the functions ``trainer.compile`` compiles, run as they are (the same Python): rank 1's slice is
    partly padding, and most targets are outside each rank's slice (``in_range`` False)."""
    from slime_hydra.train.backends.megatron import logprobs
    from slime_hydra.train.backends.megatron.logprobs import vocab_parallel_log_probs

    compiled = logprobs.compiled
    logprobs.compiled = lambda fn: fn
    try:
        _logprobs_tp2_checked(rank, group, vocab_parallel_log_probs, fuse)
    finally:
        logprobs.compiled = compiled


def _logprobs_tp2_checked(rank: int, group, vocab_parallel_log_probs, fuse: bool) -> None:
    torch.manual_seed(0)
    rows, vocab, padded = 33, 100, 128
    full = torch.randn(rows + 7, padded, dtype=torch.float64) * 4  # 7 rows not scored (a packed batch's prompts)
    index = torch.randperm(rows + 7)[:rows]
    targets = torch.randint(0, vocab, (rows,))
    w_lp, w_ent = torch.randn(rows, dtype=torch.float64), torch.randn(rows, dtype=torch.float64)
    mine = full.chunk(2, dim=1)[rank].clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(mine, targets, index=index, vocab_size=vocab, temperature=0.8, tp_group=group,
                                       with_entropy=True, chunk_bytes=4 * 3 * 64 * 5, fuse=fuse)  # 5-row chunks
    (lp.double() * w_lp + ent.double() * w_ent).sum().backward()

    ref = full.clone().requires_grad_(True)
    logp = torch.log_softmax(ref[index, :vocab] / 0.8, dim=-1)
    ref_lp, ref_ent = logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    assert (lp - ref_lp).abs().max() < 1e-5 and (ent - ref_ent).abs().max() < 1e-5
    assert (mine.grad - ref.grad.chunk(2, dim=1)[rank]).abs().max() < 1e-5  # unscored rows: 0 in both
    if rank == 1:  # columns past the true vocabulary get no gradient
        assert mine.grad[:, vocab - 64:].abs().max() == 0


def _export(rank: int, group, cases) -> None:
    from slime_hydra.train.backends.megatron.convert import HFCheckpoint, hf_to_megatron
    from slime_hydra.train.backends.megatron.weights import export_hf_weights

    for family, path, layout, shards, groups in cases:
        ck = HFCheckpoint(path)
        shard = shards[rank]
        got = {}
        for bucket in export_hf_weights([(hf_to_megatron(ck, layout, shard), shard)], layout,
                                        bucket_bytes=BUCKET_BYTES, **{g: group for g in groups}):
            assert sum(t.numel() * t.element_size() for _, t in bucket) <= BUCKET_BYTES or len(bucket) == 1
            for name, t in bucket:
                assert name not in got, name
                got[name] = t
        assert set(got) == set(ck), (family, set(got) ^ set(ck))
        for name in ck:
            assert torch.equal(got[name], ck[name]), (family, name)


def _megatron_tp2(rank: int, models) -> None:
    """TP = 2 megatron models (row/column-parallel linears, vocab-parallel embedding and head) on the
    converter's shards: the packed batch's response log-probs are the HF model's."""
    from megatron.core import parallel_state

    from slime_hydra.train.backends.megatron.convert import Shard
    from slime_hydra.train.backends.megatron.logprobs import packed_response_log_probs
    from slime_hydra.train.backends.megatron.weights import load_hf_weights
    from tests.megatron_cpu import cuda_on_cpu, megatron_model

    with cuda_on_cpu():
        parallel_state.initialize_model_parallel(2, 1)
        try:
            for family, hf_config, path, layout, batch, expected in models:
                model = megatron_model(hf_config, tp=2)
                load_hf_weights([model], path, layout, [Shard(tp_rank=rank, tp_size=2)])
                with torch.no_grad():
                    out = model(batch.input_ids, batch.position_ids, None,
                                packed_seq_params=batch.packed_seq_params())
                    lp, _ = packed_response_log_probs(out, batch, vocab_size=hf_config.vocab_size,
                                                      tp_group=parallel_state.get_tensor_model_parallel_group())
                assert out.shape[-1] == layout.padded_vocab_size // 2
                assert (lp - expected).abs().max() < 1e-4, (family, (lp - expected).abs().max())
        finally:
            parallel_state.destroy_model_parallel()


def _worker(rank: int, port: int, cases, models) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        _logprobs_tp2(rank, group)
        _logprobs_tp2(rank, group, fuse=True)
        _export(rank, group, cases)
        _megatron_tp2(rank, models)
    finally:
        dist.destroy_process_group()


def _hf_response_log_probs(model, seqs, resp) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for s, r in zip(seqs, resp):
            logp = torch.log_softmax(model(torch.tensor([s])).logits[0], -1)
            out.append(logp[len(s) - r - 1:len(s) - 1].gather(-1, torch.tensor(s[len(s) - r:])[:, None])[:, 0])
    return torch.cat(out)


@pytest.mark.integration
def test_two_ranks(tmp_path):
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp

    from slime_hydra.train.backends.megatron.convert import Layout, stage_shard
    from slime_hydra.train.backends.megatron.model import Parallel, transformer_config
    from slime_hydra.train.backends.megatron.packing import pack
    from tests.megatron_cpu import free_port, saved_checkpoint, tiny_hf_model

    cases, models = [], []
    for family, sizes in [("qwen3", dict(tp=2)), ("glm4", dict(tp=2)), ("llama", dict(pp=2)),
                          ("qwen3_moe", dict(ep=2)), ("deepseek_v3", dict(pp=2))]:
        model = tiny_hf_model(family)
        path = str(tmp_path / family)
        saved_checkpoint(model, path)
        tp, pp, ep = sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("ep", 1)
        config = transformer_config(model.config, Parallel(tp=tp, pp=pp, ep=ep), dtype=torch.float32)
        shards = [stage_shard(config, tp_rank=r % tp, ep_rank=r % ep, pp_rank=r % pp) for r in (0, 1)]
        groups = [f"{k}_group" for k, n in (("tp", tp), ("pp", pp), ("ep", ep)) if n > 1]
        cases.append((family, path, Layout.from_hf(model.config, tp=tp), shards, groups))
        if family in ("qwen3", "glm4", "deepseek_v3"):
            torch.manual_seed(2)
            seqs = [torch.randint(0, model.config.vocab_size, (n,)).tolist() for n in (9, 6)]
            batch = pack(seqs, [4, 2], [0, 1], pad_to_multiple=2)
            models.append((family, model.config, path, Layout.from_hf(model.config, tp=2), batch,
                           _hf_response_log_probs(model, seqs, [4, 2])))
    mp.spawn(_worker, args=(free_port(), cases, models), nprocs=2, join=True)
