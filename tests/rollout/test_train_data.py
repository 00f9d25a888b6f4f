"""A rollout's samples -> training data (slime_hydra/rollout/train_data.py) on hand-made samples:
reward post-processing per algorithm setting, loss masks, removed samples, log-prob fill, metrics,
and which rows each data-parallel rank gets for each optimiser step."""

from __future__ import annotations

import math

import pytest

from slime_hydra.config.schema import AlgoConfig
from slime_hydra.data.sample import Sample, Status
from slime_hydra.rollout.train_data import rank_rows, split_by_rank, train_data

RAW = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]  # two groups of four


def samples(rewards=RAW):
    out = []
    for i, r in enumerate(rewards):
        s = Sample(prompt="p", group_index=i // 4, index=i, tokens=[5, 6, 7], reward=r, status=Status.COMPLETED)
        s.append_response([8] * (i % 3 + 1), [-0.5] * (i % 3 + 1))
        out.append(s)
    return out


def algo(estimator="grpo", normalize_rewards=True, normalize_std=True) -> AlgoConfig:
    return AlgoConfig(name="t", advantage_estimator=estimator, normalize_rewards=normalize_rewards,
                      normalize_std=normalize_std)


# --------------------------------------------------------------------------- reward post-processing
def test_group_mean_and_std():
    data, _ = train_data(samples(), algo(), 4)
    z1 = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # group 1: mean 0.5, unbiased std sqrt(1/3)
    z2 = 0.25 / (0.5 + 1e-6)  # group 2: mean 0.75, unbiased std sqrt(0.75 / 3) = 0.5
    assert data["rewards"] == pytest.approx([z1, -z1, -z1, z1, z2, z2, z2, -3 * z2], abs=1e-6)
    assert data["raw_rewards"] == RAW


def test_group_mean_only():
    data, _ = train_data(samples(), algo(normalize_std=False), 4)
    assert data["rewards"] == [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]
    # an estimator registered with group_rewards="mean" never divides by the std
    data, _ = train_data(samples(), algo("reinforce_plus_plus_baseline", normalize_std=True), 4)
    assert data["rewards"] == [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]


@pytest.mark.parametrize("settings", [dict(normalize_rewards=False), dict(estimator="reinforce_plus_plus")])
def test_raw_rewards(settings):
    data, _ = train_data(samples(), algo(**settings), 4)
    assert data["rewards"] == RAW == data["raw_rewards"]


def test_dapo_overlong_penalty_is_added_before_the_group_normalisation():
    # response lengths 1 2 3 1 2 3 1 2; limit 3, buffer 2: the penalty starts after 1 token, -0.5 a token
    a = algo(normalize_rewards=False)
    a.overlong_buffer_len, a.overlong_penalty_factor = 2, 0.4
    data, metrics = train_data(samples(), a, 4, max_response_len=3)
    penalty = [0, -0.2, -0.4, 0, -0.2, -0.4, 0, -0.2]
    assert data["rewards"] == pytest.approx([r + p for r, p in zip(RAW, penalty)])
    assert data["raw_rewards"] == RAW  # what the reward function said, for the reward metrics
    assert metrics["rollout/overlong_penalty_mean"] == pytest.approx(sum(penalty) / 8)
    assert metrics["rollout/overlong_penalized_ratio"] == 5 / 8
    assert metrics["rollout/reward_mean"] == sum(RAW) / 8
    a.normalize_rewards = True  # the shaped rewards are what the group statistics see
    normalised, _ = train_data(samples(), a, 4, max_response_len=3)
    grouped, _ = train_data(samples([r + p for r, p in zip(RAW, penalty)]), algo(), 4)
    assert normalised["rewards"] == pytest.approx(grouped["rewards"])
    with pytest.raises(ValueError, match="needs max_response_len"):
        train_data(samples(), a, 4)


def test_no_overlong_penalty_by_default():
    data, metrics = train_data(samples(), algo(normalize_rewards=False), 4, max_response_len=3)
    assert data["rewards"] == RAW and "rollout/overlong_penalty_mean" not in metrics


def test_dict_rewards_use_the_reward_key():
    ss = samples()
    for s, r in zip(ss, RAW):
        s.reward = {"acc": r, "len": 3}
    data, metrics = train_data(ss, algo(normalize_rewards=False), 4, reward_key="acc")
    assert data["raw_rewards"] == RAW and metrics["rollout/reward_mean"] == 0.625
    with pytest.raises(ValueError, match="set reward.key"):
        train_data(ss, algo(), 4)


# ------------------------------------------------------------------------------ per-sample fields
def test_masks_log_probs_and_fields():
    ss = samples()
    ss[1].loss_mask = None  # no mask: all ones
    ss[2].remove_sample = True  # in the group's statistics, not in the loss
    ss[4].loss_mask = [0, 1]  # e.g. a tool token, then a model token
    ss[4].rollout_log_probs = [0.0, -0.25]
    ss[5].status = Status.TRUNCATED
    data, _ = train_data(ss, algo(normalize_rewards=False), 4)
    assert data["response_lengths"] == [1, 2, 3, 1, 2, 3, 1, 2]
    assert data["tokens"][2] == [5, 6, 7, 8, 8, 8]
    assert data["loss_masks"] == [[1], [1, 1], [0, 0, 0], [1], [0, 1], [1, 1, 1], [1], [1, 1]]
    assert data["rollout_log_probs"] == [[-0.5], [-0.5] * 2, [-0.5] * 3, [-0.5], [0.0, -0.25], [-0.5] * 3, [-0.5],
                                         [-0.5] * 2]
    assert data["group_indices"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert data["truncated"] == [False] * 5 + [True] + [False] * 2
    assert data["rewards"][2] == 0.0  # removed, yet its reward stays in the data
    assert sorted(data) == sorted(["tokens", "response_lengths", "loss_masks", "rewards", "raw_rewards",
                                   "rollout_log_probs", "group_indices", "truncated"])


def test_a_sample_without_its_log_probs_raises_naming_it():
    ss = samples()
    ss[1].rollout_log_probs = None
    with pytest.raises(ValueError, match=r"group 0, sample 1, .*0 rollout log-probs for 2 response tokens"):
        train_data(ss, algo(normalize_rewards=False), 4)


def test_a_failed_sample_is_kept_out_of_the_loss_and_counted():
    from slime_hydra.rewards import counters

    counters.drain()
    ss = samples()
    ss[3].status = Status.FAILED
    data, _ = train_data(ss, algo(normalize_rewards=False), 4)
    assert data["loss_masks"][3] == [0]
    assert counters.drain() == {"rollout/failed_count": 1.0}


def test_metrics():
    ss = samples([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    ss[7].status = Status.TRUNCATED
    _, m = train_data(ss, algo(), 4)
    assert m == {"rollout/reward_mean": 0.75, "rollout/response_len_mean": 15 / 8, "rollout/response_len_max": 3.0,
                 "rollout/truncated_ratio": 1 / 8, "rollout/zero_std_groups": 0.5, "rollout/response_tokens": 15.0,
                 "rollout/samples": 8.0}
    _, m = train_data(samples([1.0, 0.0]), algo(), 1)
    assert m["rollout/zero_std_groups"] == 0.0  # one sample per prompt: no groups to speak of


# ------------------------------------------------------------------- data-parallel ranks x steps
def test_rank_rows_per_step_and_rank():
    # 16 samples, optimiser steps of 8, 2 ranks: per step, rank r gets the r-th consecutive half
    assert rank_rows(16, 2, 8) == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    # 3 steps of 4 over 4 ranks: rank r gets row r of each step
    assert rank_rows(12, 4, 4) == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    assert rank_rows(6, 1, 6) == [[0, 1, 2, 3, 4, 5]]
    with pytest.raises(RuntimeError, match="10 training samples do not fill whole optimiser steps of "
                                           "trainer.global_batch_size=4"):
        rank_rows(10, 2, 4)


def test_split_by_rank_takes_every_field_of_those_rows():
    data, _ = train_data(samples(), algo(normalize_rewards=False), 4)
    parts = split_by_rank(data, 2, 4)
    assert [p["group_indices"] for p in parts] == [[0, 0, 1, 1], [0, 0, 1, 1]]
    assert parts[1]["raw_rewards"] == [0.0, 1.0, 1.0, 0.0]  # rows 2, 3, 6, 7
    assert parts[1]["response_lengths"] == [3, 1, 1, 2]
    for part, rows in zip(parts, rank_rows(8, 2, 4)):
        assert part == {k: [v[i] for i in rows] for k, v in data.items()}
