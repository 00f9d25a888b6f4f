"""Packed micro-batches by token budget, and chunked log-probs (single process; the TP = 2 case is in
test_megatron_distributed.py)."""

from __future__ import annotations

import random

import pytest
import torch

from slime_hydra.train.backends.megatron.logprobs import vocab_parallel_log_probs
from slime_hydra.train.backends.megatron.packing import pack, pack_micro_batches, token_budget_micro_batches


def test_micro_batches_fit_the_budget_and_are_few_and_balanced():
    rng = random.Random(0)
    lengths = [rng.randint(50, 900) for _ in range(200)]
    budget = 2048
    groups = token_budget_micro_batches(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(200))
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert max(loads) <= budget
    lower_bound = -(-sum(lengths) // budget)
    assert len(groups) <= lower_bound + 2, (len(groups), lower_bound)
    assert max(loads) - min(loads) <= max(lengths)  # balanced to within one sample
    assert all(g == sorted(g) for g in groups) and [g[0] for g in groups] == sorted(g[0] for g in groups)


def test_micro_batch_edge_cases():
    assert token_budget_micro_batches([], 10) == []
    assert token_budget_micro_batches([3, 3, 3], 10) == [[0, 1, 2]]
    assert len(token_budget_micro_batches([3, 3, 3], 10, min_micro_batches=3)) == 3  # equal counts across DP
    with pytest.raises(ValueError, match="sample 1 has 11 tokens, more than the micro-batch token budget 10"):
        token_budget_micro_batches([3, 11], 10)
    with pytest.raises(ValueError, match="2 samples cannot fill 3 micro-batches"):
        token_budget_micro_batches([3, 3], 10, min_micro_batches=3)


def test_pack_layout():
    tokens = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    b = pack(tokens, [2, 1, 3], [2, 0], loss_masks=[[1, 0], None, None], pad_to_multiple=4)
    assert b.input_ids.tolist() == [[9, 10, 11, 12, 1, 2, 3, 4, 5, 0, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]]
    assert b.cu_seqlens.tolist() == [0, 4, 9, 12] and b.cu_seqlens.dtype == torch.int32 and b.max_seqlen == 5
    # response tokens 10, 11, 12 (positions 1-3) are predicted at positions 0-2; 4, 5 at 6, 7
    assert b.logit_index.tolist() == [0, 1, 2, 6, 7] and b.targets.tolist() == [10, 11, 12, 4, 5]
    assert b.loss_mask.tolist() == [1, 1, 1, 1, 0]
    assert b.per_sample(torch.arange(5.0), width=4).tolist() == [[0, 1, 2, 0], [3, 4, 0, 0]]
    with pytest.raises(ValueError, match="sample 0: response length 5 for 5 tokens"):
        pack(tokens, [5], [0])


def test_pack_micro_batches_from_rollout_data():
    data = {"tokens": [[1] * n for n in (5, 7, 3, 6)], "response_lengths": [2, 3, 1, 2],
            "loss_masks": [None, [1, 1, 0], None, None]}
    mbs = pack_micro_batches(data, [0, 1, 2, 3], max_tokens=12, pad_to_multiple=2)
    assert sorted(i for mb in mbs for i in mb.indices) == [0, 1, 2, 3]
    assert all(mb.num_tokens <= 12 and mb.num_tokens % 2 == 0 for mb in mbs)


@pytest.mark.parametrize("fuse", [False, True])
def test_log_probs_match_log_softmax_and_skip_padding(fuse, monkeypatch):
    """Eager, and with ``fuse``'s functions (``trainer.compile``; run uncompiled here, the same Python)."""
    from slime_hydra.train.backends.megatron import logprobs

    monkeypatch.setattr(logprobs, "compiled", lambda fn: fn)
    torch.manual_seed(0)
    rows, vocab = 50, 90
    logits = (torch.randn(rows, 128) * 3).to(torch.bfloat16)
    logits[:, vocab:] = 30  # padding columns: would dominate the softmax if they were counted
    targets = torch.randint(0, vocab, (rows,))
    x = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(x, targets, vocab_size=vocab, temperature=0.9, with_entropy=True,
                                       chunk_bytes=4 * 3 * 128 * 7, fuse=fuse)
    assert lp.dtype == torch.float32 and lp.shape == (rows,)
    (lp.sum() + 0.5 * ent.sum()).backward()
    ref_x = logits.float().clone().requires_grad_(True)
    ref = torch.log_softmax(ref_x[:, :vocab] / 0.9, -1)
    ref_lp, ref_ent = ref.gather(-1, targets[:, None])[:, 0], -(ref.exp() * ref).sum(-1)
    (ref_lp.sum() + 0.5 * ref_ent.sum()).backward()
    assert (lp - ref_lp).abs().max() < 1e-4 and (ent - ref_ent).abs().max() < 1e-4
    assert x.grad.dtype == torch.bfloat16 and x.grad[:, vocab:].abs().max() == 0
    assert (x.grad.float() - ref_x.grad).abs().max() < 1e-2  # bf16 gradient of an fp32 computation


@pytest.mark.parametrize("fuse", [False, True])
def test_log_probs_of_indexed_rows_equal_those_of_the_selected_rows(fuse, monkeypatch):
    """``index`` (a packed batch's response positions, in any order): the same log-probs, entropies and
    gradients as scoring ``logits[index]``, and rows that are not read get a zero gradient."""
    from slime_hydra.train.backends.megatron import logprobs

    monkeypatch.setattr(logprobs, "compiled", lambda fn: fn)
    torch.manual_seed(1)
    n, vocab = 40, 90
    logits = (torch.randn(n, 96) * 3).to(torch.bfloat16)
    index = torch.randperm(n)[:23]
    targets = torch.randint(0, vocab, (23,))
    got_x, ref_x = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    kw = dict(vocab_size=vocab, temperature=0.7, with_entropy=True, chunk_bytes=4 * 3 * 96 * 5, fuse=fuse)
    lp, ent = vocab_parallel_log_probs(got_x, targets, index=index, **kw)
    ref_lp, ref_ent = vocab_parallel_log_probs(ref_x.index_select(0, index), targets, **kw)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=0)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=0)
    w = torch.randn(23)
    (lp * w + 0.3 * ent).sum().backward()
    (ref_lp * w + 0.3 * ref_ent).sum().backward()
    torch.testing.assert_close(got_x.grad, ref_x.grad, rtol=0, atol=0)
    unread = torch.ones(n, dtype=torch.bool)
    unread[index] = False
    assert got_x.grad[unread].abs().max() == 0 and got_x.grad[index].abs().max() > 0
    with pytest.raises(ValueError, match="22 targets for 23 rows of logits \\(the index's length; the logits have 40"):
        vocab_parallel_log_probs(got_x, targets[:22], index=index, **kw)
    with pytest.raises(ValueError, match="23 targets for 40 rows of logits$"):
        vocab_parallel_log_probs(got_x, targets, **kw)


@pytest.mark.parametrize("rot_dim", [8, 4])  # all of the head, and part of it (the rest passes through)
def test_packed_rope_equals_megatrons_per_sequence_loop(rot_dim):
    """The packed RoPE (``spec.packed_rotary_pos_emb``, no host sync) gives exactly what megatron's own
    THD path gives, for sequences of different lengths, a padding tail included; and the families that
    use it have megatron route their RoPE there (``apply_rope_fusion``)."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings import rope_utils
    from megatron_cpu import megatron_on_cpu, tiny_hf_config

    from slime_hydra.train.backends.megatron.model import transformer_config
    from slime_hydra.train.backends.megatron.spec import HAVE_TE, packed_rotary_pos_emb

    torch.manual_seed(0)
    lengths = [5, 1, 9, 3, 2]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = torch.randn(int(cu[-1]), 3, 8, requires_grad=True)
    freqs = torch.randn(max(lengths), 1, 1, rot_dim)
    with megatron_on_cpu():
        from megatron.core import parallel_state

        want = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=parallel_state.get_context_parallel_group())
        got = packed_rotary_pos_emb(t, cu, freqs)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        g_want, = torch.autograd.grad(want.square().sum(), t)
        g_got, = torch.autograd.grad(got.square().sum(), t)
        torch.testing.assert_close(g_got, g_want)
        if not HAVE_TE:
            assert rope_utils.fused_apply_rotary_pos_emb_thd is packed_rotary_pos_emb
            fusion = {f: transformer_config(tiny_hf_config(f)).apply_rope_fusion for f in ("qwen3", "llama", "glm4")}
            assert fusion == {"qwen3": True, "llama": True, "glm4": False}  # GLM-4's rope is interleaved
