"""The last line of a run gives the held-out reward, or the training reward where no eval set ran (never
"nan -> nan")."""

from __future__ import annotations

from slime_hydra.launch.loop import summarize
from slime_hydra.launch.main import rewards_said


def test_the_summary_line_says_which_reward_it_gives():
    trained = [{"step": 1, "rollout/reward_mean": 0.125}, {"step": 2, "rollout/reward_mean": 0.5}]
    assert rewards_said(summarize(trained, 2, 1.0, "/runs/x")) == (
        "training reward 0.125 -> 0.500 (no held-out reward: no eval set ran, see eval.datasets)")
    evaluated = [{"step": 0, "eval/a/reward": 0.25}, *trained, {"step": 2, "eval/a/reward": 0.75}]
    assert rewards_said(summarize(evaluated, 2, 1.0, "/runs/x")) == "eval reward 0.250 -> 0.750"
    assert rewards_said(summarize([], 0, 1.0, "/runs/x")) == "no eval set ran and no training step"
