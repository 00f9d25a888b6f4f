"""Training data: the rollout manager's per-sample lists -> padded tensors for one micro-batch (prompt +
response, right-padded: real tokens keep positions 0..n-1), and the response tokens' log-probs from a causal
LM's logits. Response-aligned tensors are ``[B, T]``, ``T`` the longest response of the whole rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from slime_hydra.train.logprobs import response_rows

# Keys of the per-sample training data the rollout manager sends (one list entry per sample).
TRAIN_KEYS = ("tokens", "response_lengths", "loss_masks", "rewards", "raw_rewards", "rollout_log_probs",
              "group_indices", "truncated")


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_start: torch.Tensor  # [B] index of the first response token in input_ids
    response_ids: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] float, 0 on padding and on masked (tool) tokens
    indices: List[int]  # rows of the local rollout data

    def to(self, device: torch.device) -> "MicroBatch":
        return MicroBatch(self.input_ids.to(device), self.attention_mask.to(device), self.response_start.to(device),
                          self.response_ids.to(device), self.loss_mask.to(device), self.indices)


def make_micro_batch(data: Dict[str, list], indices: Sequence[int], resp_len: int, pad_id: int = 0) -> MicroBatch:
    seqs = [list(data["tokens"][i]) for i in indices]
    rlens = [data["response_lengths"][i] for i in indices]
    lens = [len(s) for s in seqs]
    L = max(lens)
    # padded Python lists, then one tensor each (not a tensor per row)
    ids = torch.tensor([s + [pad_id] * (L - n) for s, n in zip(seqs, lens)], dtype=torch.long)
    attn = (torch.arange(L)[None, :] < torch.tensor(lens)[:, None]).long()
    resp = torch.tensor([s[n - r:] + [pad_id] * (resp_len - r) if r else [pad_id] * resp_len
                         for s, n, r in zip(seqs, lens, rlens)], dtype=torch.long).reshape(len(seqs), resp_len)
    start = torch.tensor([n - r for n, r in zip(lens, rlens)], dtype=torch.long)
    return MicroBatch(ids, attn, start, resp, response_mask(data, indices, resp_len), list(indices))


def _padded(rows: Sequence[Sequence[float]], resp_len: int) -> torch.Tensor:
    """Rows of at most ``resp_len`` numbers -> ``[len(rows), resp_len]`` float32, zero-padded."""
    return torch.tensor([list(r) + [0.0] * (resp_len - len(r)) for r in rows],
                        dtype=torch.float32).reshape(len(rows), resp_len)


def response_tensor(data: Dict[str, list], key: str, indices: Sequence[int], resp_len: int) -> torch.Tensor:
    """A per-response-token list field (e.g. rollout_log_probs) -> [B, T] float, zero-padded."""
    return _padded([data[key][i] or () for i in indices], resp_len)


def response_mask(data: Dict[str, list], indices: Sequence[int], resp_len: int) -> torch.Tensor:
    """The loss masks of ``indices`` as ``[B, T]`` float (a missing mask: every response token)."""
    rows = []
    for i in indices:
        r, m = data["response_lengths"][i], data["loss_masks"][i]
        rows.append(([1.0] * r if m is None else m) if r else ())
    return _padded(rows, resp_len)


def response_log_probs(logits: torch.Tensor, mb: MicroBatch, temperature: float = 1.0,
                       with_entropy: bool = False, chunk: int = 4096, entropy_grad: bool = True) -> tuple:
    """Log-probs (and entropies) of the response tokens under ``softmax(logits / temperature)``: response
    token t of row b is scored by logits[b, start_b - 1 + t]; only those ``B x T`` rows reach the float32
    log-softmax, ``chunk`` at a time. ``entropy_grad=False``: the entropies are a metric, kept out of autograd."""
    B, T = mb.response_ids.shape
    rows = response_rows(logits, mb.response_start, T)
    targets = mb.response_ids.reshape(-1)
    lps, ents = [], []
    for s in range(0, rows.shape[0], chunk):
        lp = torch.log_softmax(rows[s:s + chunk].float() / temperature, dim=-1)
        lps.append(lp.gather(-1, targets[s:s + chunk, None])[:, 0])
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ents.append(-(lp.exp() * lp).sum(-1))
    log_probs = torch.cat(lps).view(B, T)
    entropy: Optional[torch.Tensor] = torch.cat(ents).view(B, T) if with_entropy else None
    return log_probs, entropy
