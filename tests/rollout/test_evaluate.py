"""Evaluation (slime_hydra/rollout/evaluate.py) with a scripted generate function: per-dataset
sampling, mean reward, pass@k from the unbiased estimator, multi-turn metrics and examples."""

from __future__ import annotations

import pytest

from rollout_harness import make_rollout
from slime_hydra.data.sample import Sample, Status
from slime_hydra.rollout.evaluate import pass_at_k

RIGHT = [1, 0, 4, 2]  # right answers among the 4 samples of each eval prompt


def test_pass_at_k():
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 1) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)


def test_eval_metrics_per_dataset():
    m = make_rollout(["data.num_eval=4", "logging.log_samples=1", "rollout.max_response_len=5",
                      "eval.datasets=[{name: four, n_samples_per_prompt: 4, temperature: 1.0, max_response_len: 3}, "
                      "{name: one}]"])
    seen = set()

    async def scripted(ctx, s: Sample, sp, evaluation=False) -> Sample:
        seen.add((evaluation, sp["temperature"], sp["max_new_tokens"]))
        right = s.index % s.metadata["k"] < RIGHT[s.group_index]  # sample j of prompt i has index i * k + j
        s.tokens = ctx.encode(s.prompt) + [1]
        s.append_response([1, 1], [-0.5, -0.5], text=s.label if right else "x")
        s.status = Status.TRUNCATED if s.group_index == 3 else Status.COMPLETED
        s.metadata.update(num_turns=2, tool_calls=s.group_index % 2)
        return s

    for es in m.evaluator.sets.values():  # tell the script how many samples each prompt gets
        for row in es.rows:
            row.metadata["k"] = es.cfg.n_samples_per_prompt
    m.set_generate(scripted)
    out = m.eval()
    assert seen == {(True, 1.0, 3), (True, 0.0, 5)}  # each dataset's own sampling; evaluation=True
    assert out["eval/four/reward"] == 7 / 16 == out["eval/four/pass@1"]
    assert out["eval/four/pass@2"] == pytest.approx((0.5 + 0 + 1 + 5 / 6) / 4)  # 2 of 4 right: 1 - 1/C(4,2)
    assert out["eval/four/pass@4"] == 0.75
    assert out["eval/one/reward"] == 0.75 and not any("pass@" in k for k in out if k.startswith("eval/one/"))
    assert out["eval/four/truncated_ratio"] == out["eval/one/truncated_ratio"] == 0.25
    assert out["eval/four/response_len"] == 2.0
    assert [out[f"eval/four/{k}"] for k in ("turns_mean", "tool_calls_mean", "tool_use_ratio")] == [2, 0.5, 0.5]
    assert [len(out[f"eval/{n}/examples"]) for n in ("four", "one")] == [1, 1]
    assert set(out["eval/one/examples"][0]) == {"prompt", "response", "label", "reward"}
