"""``rollout.agent=verifiers`` with the example taskset (examples/vf_max_digit): verifiers' own episode runs in
process against the sample's session, so the sample holds the engine's tokens and log-probs and the taskset's
reward function scores it; its tasks are the dataset; a run trains a few steps; bad settings are refused before
any work, naming the key."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from conftest import ROOT, resolved
from rollout_harness import make_rollout
from runs import FAST, metrics, run
from slime_hydra.data.source import load_rows
from slime_hydra.data.tasksets import tasks, taskset
from slime_hydra.launch.validate import validate
from slime_hydra.rollout import verifiers_env
from slime_hydra.rollout.client import GenerateClient

pytestmark = pytest.mark.integration
VF = ["experiment=verifiers_max_digit", "rollout.batch_size=4", "rollout.n_samples_per_prompt=4"]
ENV = "examples.vf_max_digit"


def errors(overrides):
    os.chdir(ROOT)
    return validate(resolved(overrides))


def test_an_episode_scores_the_engines_tokens_with_the_taskset_reward(engine_url):
    m = make_rollout(VF, urls=[engine_url])
    ctx = m.ctx.sampler.ctx

    async def go():
        ctx.client = GenerateClient(engine_url, 16, retries=0)
        try:
            return await m.collect()
        finally:
            await ctx.client.aclose()

    groups, _ = asyncio.run(go())
    samples = [s for g in groups for s in g]
    assert len(samples) == 16 and all(s.status.name in ("COMPLETED", "TRUNCATED") for s in samples)
    for s in samples:
        task = tasks(ENV)[s.metadata["vf_task"]]
        assert s.metadata["messages"][0] == {"role": "user", "content": task.data.prompt}
        assert s.response_length == len(s.rollout_log_probs) > 0 and sum(s.loss_mask) == s.response_length
        answer = s.metadata["messages"][-1]["content"]  # the engine's turn, as the taskset's reward read it
        assert s.reward == float(answer.strip()[:1] == task.data.answer)


def test_a_verifiers_environment_trains_a_few_steps(tmp_path):
    d = tmp_path / "run"
    summary = run(d, "experiment=verifiers_max_digit", "trainer.num_rollout=3", "rollout.batch_size=8",
                  "trainer.save_interval=0", *FAST)
    rows = metrics(d)
    assert [r["step"] for r in rows] == [1, 2, 3] and summary["steps"] == 3
    assert all(0.0 <= r["rollout/reward_mean"] <= 1.0 and r["rollout/response_len_mean"] > 0 for r in rows)
    assert not any(r.get("rollout/agent_error_count") or r.get("rollout/agent_timeout_count") for r in rows)


def test_the_taskset_is_the_dataset_unless_data_path_is_given():
    """Without data.path the rows are the taskset's tasks; a row of one's own becomes a task of the taskset's
    type from its prompt and metadata."""
    rows = load_rows(resolved(VF).data)
    assert len(rows) == 512 and [r.prompt for r in rows[:3]] == [t.data.prompt for t in tasks(ENV)[:3]]
    assert rows[1].metadata == {"vf_task": 1}
    task = verifiers_env._task(ENV, {"prompt": "3815=", "metadata": {"answer": "8", "source": "mine.jsonl:1"}})
    assert (task.data.prompt, task.data.answer) == ("3815=", "8")


@pytest.mark.parametrize("overrides, message", [
    (["rollout.agent_env=no_such_taskset"], "rollout.agent_env='no_such_taskset' is not an installed verifiers "
                                            "taskset"),
    (["rollout.agent_env=null", "data=digits", "model.tokenizer=builtin:digits"],
     "rollout.agent_env: rollout.agent=verifiers needs the installed verifiers taskset"),
    (["rollout.agent=examples.calculator.agent.run", "data=digits", "model.tokenizer=builtin:digits"],
     "rollout.agent_env='examples.vf_max_digit' is for rollout.agent=verifiers"),
])
def test_bad_verifiers_settings_are_refused_naming_the_key(overrides, message):
    assert any(message in e for e in errors(["experiment=verifiers_max_digit", *overrides])), \
        errors(["experiment=verifiers_max_digit", *overrides])


def test_without_the_extra_rollout_agent_verifiers_is_refused(monkeypatch):
    for name in [n for n in sys.modules if n.split(".")[0] == "verifiers"] + ["verifiers"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if the extra were not installed
    taskset.cache_clear()
    try:
        assert any("rollout.agent: rollout.agent=verifiers needs the verifiers extra: pip install "
                   "'slime_hydra[verifiers]'" in e for e in errors(["experiment=verifiers_max_digit"]))
    finally:
        taskset.cache_clear()
