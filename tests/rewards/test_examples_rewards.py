"""The reward examples of docs/recipes (custom-reward.md, remote-reward.md) score as their docstrings say,
and the remote one speaks the protocol of slime_hydra.rewards.remote."""

from __future__ import annotations

import asyncio

from fastapi.testclient import TestClient

from examples.custom_reward.reward import digit_distance, rank_in_group
from examples.remote_reward.server import app
from slime_hydra.config.schema import RewardConfig
from slime_hydra.data.sample import Sample
from slime_hydra.rewards import compute_group_reward, compute_reward


def _sample(response: str, label: str = "8", index: int = 0) -> Sample:
    return Sample(prompt="3815=", label=label, response=response, index=index)


def test_digit_distance_gives_partial_credit():
    assert digit_distance(None, _sample("8")) == 1.0
    assert digit_distance(None, _sample("5")) == 1.0 - 3 / 9
    assert digit_distance(None, _sample("5"), scale=3.0) == 0.0
    assert digit_distance(None, _sample("=")) == 0.0


def test_rank_in_group_half_credit_for_the_common_wrong_answer():
    samples = [_sample(r, index=i) for i, r in enumerate(["8", "6", "6", "5"])]
    assert rank_in_group(None, samples) == [1.0, 0.5, 0.5, 0.0]
    cfg = RewardConfig(type="custom", custom="examples.custom_reward.reward.rank_in_group", group=True)
    assert asyncio.run(compute_group_reward(cfg, samples)) == [1.0, 0.5, 0.5, 0.0]


def test_custom_reward_target_node_passes_arguments():
    cfg = RewardConfig(type="custom", custom={"_target_": "examples.custom_reward.reward.digit_distance", "scale": 3.0})
    assert asyncio.run(compute_reward(cfg, _sample("7"))) == 1.0 - 1 / 3


def test_remote_reward_server_answers_the_protocol():
    client = TestClient(app)
    body = {"prompt": "3815=", "response": "8", "label": "8", "metadata": {}}
    assert client.post("/score", json=body).json() == {"score": 1.0, "answered": True}
    chat = {"prompt": [{"role": "user", "content": "3815="}], "response": "x", "label": "8", "metadata": {}}
    assert client.post("/score", json=chat).json() == {"score": 0.0, "answered": False}
    assert client.post("/score", json={"prompt": "1="}).status_code == 422  # no response: not retried by the run
