"""A rollout's samples -> the trainer's data (a dict of per-sample lists; per-token lists cover the response
only), and its split across data-parallel ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from slime_hydra.data.sample import Sample, Status
from slime_hydra.rollout.filters import zero_std

if TYPE_CHECKING:
    from slime_hydra.config.schema import AlgoConfig

TrainData = Dict[str, list]


def train_data(samples: Sequence[Sample], algo: "AlgoConfig", n_samples_per_prompt: int,
               reward_key: Optional[str] = None, max_response_len: Optional[int] = None,
               ) -> Tuple[TrainData, Dict[str, float]]:
    """``samples`` (whole groups of ``n_samples_per_prompt``, in order) -> (data, metrics).

    - ``rewards``: the raw rewards plus DAPO's overlong penalty (``algo.overlong_buffer_len``; needs
      ``max_response_len``), post-processed for ``algo`` by ``rewards_for_estimator``;
    - ``loss_masks``: the sample's mask (ones when it has none), zeros for a ``remove_sample`` and for a sample
      marked ``Status.FAILED`` (counted in ``rollout/failed_count``);
    - ``rollout_log_probs``: the engine's, one per response token (a sample without them raises)."""
    import torch

    from slime_hydra.rewards import counters
    from slime_hydra.train.algorithms import overlong_penalty, rewards_for_estimator

    for s in samples:
        if s.response_length and len(s.rollout_log_probs or ()) != s.response_length:
            raise ValueError(f"{s.identity()}: {len(s.rollout_log_probs or ())} rollout log-probs for "
                             f"{s.response_length} response tokens; a generate function must keep one per token "
                             "(Sample.append_response with the engine's output_token_logprobs)")
        if s.status == Status.FAILED:
            counters.count("failed", f"{s.identity()}: marked FAILED by the generate function; kept out of the loss")
    n = n_samples_per_prompt
    raw = torch.tensor([s.reward_value(reward_key) for s in samples], dtype=torch.float32)
    lens = [s.response_length for s in samples]
    shaped = raw
    if algo.overlong_buffer_len:
        if max_response_len is None:
            raise ValueError("algo.overlong_buffer_len needs max_response_len")
        shaped = raw + (penalty := overlong_penalty(algo, torch.tensor(lens), max_response_len))
    rewards = rewards_for_estimator(algo, shaped, n)
    data = {
        "tokens": [s.tokens for s in samples],
        "response_lengths": lens,
        "loss_masks": [[0] * s.response_length if s.remove_sample or s.status == Status.FAILED
                       else (s.loss_mask or [1] * s.response_length) for s in samples],
        "rewards": rewards.tolist(),
        "raw_rewards": raw.tolist(),
        "rollout_log_probs": [list(s.rollout_log_probs or ()) for s in samples],
        "group_indices": [s.group_index for s in samples],
        "truncated": [s.status == Status.TRUNCATED for s in samples],
    }
    groups = raw.view(-1, n)
    metrics = {
        "rollout/reward_mean": float(raw.mean()),
        "rollout/response_len_mean": sum(lens) / len(lens),
        "rollout/response_len_max": float(max(lens)),
        "rollout/truncated_ratio": sum(data["truncated"]) / len(samples),
        "rollout/zero_std_groups": sum(map(zero_std, groups.tolist())) / len(groups) if n > 1 else 0.0,
        "rollout/response_tokens": float(sum(lens)),
        "rollout/samples": float(len(samples)),
    }
    if algo.overlong_buffer_len:
        metrics["rollout/overlong_penalty_mean"] = float(penalty.mean())
        metrics["rollout/overlong_penalized_ratio"] = float((penalty < 0).float().mean())
    return data, metrics


def rank_rows(n_samples: int, data_parallel: int, global_batch_size: int) -> List[List[int]]:
    """The sample rows of each data-parallel rank: of each optimiser step (``global_batch_size`` consecutive
    samples), rank ``r`` gets the ``r``-th of ``data_parallel`` equal consecutive slices."""
    if n_samples % global_batch_size:  # validation makes rollout_batch_size x n_samples_per_prompt a multiple of it
        raise RuntimeError(f"{n_samples} training samples do not fill whole optimiser steps of "
                           f"trainer.global_batch_size={global_batch_size}")
    share = global_batch_size // data_parallel
    per_rank: List[List[int]] = [[] for _ in range(data_parallel)]
    for start in range(0, n_samples, global_batch_size):
        for r in range(data_parallel):
            per_rank[r].extend(range(start + r * share, start + (r + 1) * share))
    return per_rank


def split_by_rank(data: TrainData, data_parallel: int, global_batch_size: int) -> List[TrainData]:
    """``data`` cut into each data-parallel rank's part (:func:`rank_rows`)."""
    return [{k: [v[i] for i in rows] for k, v in data.items()}
            for rows in rank_rows(len(data["tokens"]), data_parallel, global_batch_size)]
