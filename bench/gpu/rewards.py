"""Rewards for GPU benchmarks on random-weight models, where nothing is right or wrong but every group
must have advantages, so that each step has gradients and new weights to push."""

from __future__ import annotations


def even_tokens(cfg, sample) -> float:
    """The share of the response's token ids that are even: about 0.5 with a spread of a few percent
    between the samples of a group (a random model's next token is close to uniform)."""
    ids = sample.tokens[len(sample.tokens) - sample.response_length:]
    return sum(i % 2 == 0 for i in ids) / max(1, len(ids))
