"""``python run.py data=jsonl data.path=...`` with nothing else set trains the tiny model on one's own text on CPU:
chat prompts in German (and characters no built-in task uses) reach the engine and the reward exactly as the chat
template renders them, and the run says what it does with a small file and without an eval set."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from runs import ENV, leftover_processes, metrics

pytestmark = pytest.mark.integration

ROWS = [
    ([{"role": "system", "content": "Antworte mit einer Zahl."},
      {"role": "user", "content": "Jürgen hat 3 Äpfel und kauft 4 dazu. Wie viele Äpfel hat er?"}], "7"),
    ([{"role": "user", "content": "Größe: 5 Straßen mit je 2 Häusern. Wie viele Häuser?"}], "10"),
    ([{"role": "user", "content": "数学: 2 🍎 + 2 🍎 = ?"}], "4"),
]
RENDERED = {"<system>Antworte mit einer Zahl.<user>Jürgen hat 3 Äpfel und kauft 4 dazu. Wie viele Äpfel hat er?"
            "<assistant>", "<user>Größe: 5 Straßen mit je 2 Häusern. Wie viele Häuser?<assistant>",
            "<user>数学: 2 🍎 + 2 🍎 = ?<assistant>"}
# a reward of one's own that writes down what it was given
REWARD = '''
import json


def seen(cfg, sample, out):
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps({"prompt": sample.prompt, "response": sample.response, "label": sample.label}) + "\\n")
    return float(sample.label in sample.response)
'''


def test_own_chat_data_and_reward_run_end_to_end_on_cpu(tmp_path):
    data, seen, d = tmp_path / "mine.jsonl", tmp_path / "seen.jsonl", tmp_path / "run"
    data.write_text("".join(json.dumps({"prompt": p, "label": a}, ensure_ascii=False) + "\n" for p, a in ROWS),
                    encoding="utf-8")
    (tmp_path / "own_reward.py").write_text(REWARD)
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    cmd = [sys.executable, "run.py", f"hydra.run.dir={d}", "data=jsonl", f"data.path={data}", "reward.type=custom",
           f"+reward.custom={{_target_: own_reward.seen, out: '{seen}'}}", "rollout.batch_size=4",
           "rollout.n_samples_per_prompt=2", "trainer.num_rollout=2", "logging.progress=false"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-5000:]
    assert "data.path has 3 prompts, fewer than rollout.batch_size=4: every rollout walks the data 1.33 times" in said
    assert "eval.datasets is empty: no held-out reward" in said
    assert "done in" in said and " training reward " in said and "nan" not in said.split("done in")[1]
    records = [json.loads(line) for line in seen.read_text(encoding="utf-8").splitlines()]
    assert len(records) == 2 * 4 * 2  # steps x prompts x samples
    assert {r["prompt"] for r in records} == RENDERED  # every character intact, none turned into padding
    assert all(isinstance(r["response"], str) for r in records)
    assert [r["step"] for r in metrics(d)] == [1, 2]
    assert not leftover_processes()
