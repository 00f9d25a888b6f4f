"""A first run on one's own data: every refusal names the key and a value that works (applying it validates), a
character the tokenizer cannot write is refused with the file, the line and the characters, and a dataset smaller
than a rollout batch or a run without eval is said."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest

from conftest import ROOT, resolved
from slime_hydra.data.dataset import DataError, Row, render_prompt
from slime_hydra.data.tokenizer import builtin_tokenizer
from slime_hydra.launch.validate import validate

# chat prompts with characters the built-in digits task never uses (letters, umlauts, ß, €)
GERMAN = [
    ([{"role": "system", "content": "Antworte mit einer Zahl."},
      {"role": "user", "content": "Jürgen hat 3 Äpfel und kauft 4 dazu. Wie viele Äpfel hat er?"}], "7"),
    ([{"role": "user", "content": "Ein Brötchen kostet 2 €. Was kosten 6 Brötchen in Euro?"}], "12"),
]
DIGITS = ["model.tokenizer=builtin:digits", "model.arch.vocab_size=24"]


@pytest.fixture
def german(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "label": a}, ensure_ascii=False) + "\n" for p, a in GERMAN),
                    encoding="utf-8")
    return str(path)


def errors(overrides):
    os.chdir(ROOT)
    return validate(resolved(overrides))


def the_fix(problem: str) -> list:
    """The overrides a problem's first ``set key=value ...`` names."""
    m = re.search(r"set ((?:[\w.]+=[^\s,;)]+ ?)+)", problem)
    assert m, f"no 'set key=value' in: {problem}"
    return m.group(1).split()


def refused_then_fixed(overrides, start: str) -> str:
    """The one problem of ``overrides``, starting with ``start``; applying its fix leaves none."""
    errs = errors(overrides)
    assert len(errs) == 1 and errs[0].startswith(start), errs
    assert errors([*overrides, *the_fix(errs[0])]) == [], the_fix(errs[0])
    return errs[0]


def test_the_tiny_model_reads_any_text_with_data_jsonl(german):
    cfg = resolved(["data=jsonl", f"data.path={german}"])
    assert (cfg.model.tokenizer, cfg.model.arch.vocab_size) == ("builtin:bytes", 262)
    assert errors(["data=jsonl", f"data.path={german}"]) == []
    default = resolved([])  # the built-in task keeps its own vocabulary, and so its speed
    assert (default.model.tokenizer, default.model.arch.vocab_size) == ("builtin:digits", 24)
    assert default.model.arch.max_position_embeddings == 64


def test_characters_a_tokenizer_cannot_write_are_refused_with_file_line_and_characters(german, tmp_path):
    problem = refused_then_fixed(["data=jsonl", f"data.path={german}", *DIGITS], "model.tokenizer: builtin:digits")
    assert f"{german}:1: 'A' 'n' 't' 'w' 'o'" in problem and f"{german}:2: 'E' 'i' 'n'" in problem
    assert "model.tokenizer=builtin:bytes model.arch.vocab_size=262" in problem
    digits = tmp_path / "digits.jsonl"  # prompts it can write; a label it cannot (no answer could match it)
    digits.write_text('{"prompt": "3815=", "label": "8"}\n{"prompt": "2047=", "label": "sieben"}\n')
    problem = refused_then_fixed(["data=jsonl", f"data.path={digits}", "data.apply_chat_template=false", *DIGITS],
                                 "model.tokenizer:")
    assert f"{digits}:2: 's' 'i' 'e' 'b' 'n'" in problem and f"{digits}:1" not in problem
    evals = [f"data.path='{digits}@[0:1]'", f"eval.datasets=[{{name: de, path: '{german}'}}]"]  # an eval set's too
    problem = refused_then_fixed(["data=jsonl", *evals, *DIGITS], "model.tokenizer:")
    assert f"eval.datasets[0].path (prompt as rendered, or label): {german}:1:" in problem


def test_prompts_longer_than_the_positions_are_refused_with_the_value_that_fits(german):
    mine = ["data=jsonl", f"data.path={german}", "model.arch.max_position_embeddings=64"]
    problem = refused_then_fixed(mine, "model.arch.max_position_embeddings: 64 positions cannot hold the longest")
    assert f"({german}:1: 90 tokens) and a response of up to 32 tokens" in problem  # a token per byte, with roles
    assert "set model.arch.max_position_embeddings=128" in problem
    assert "rollout.max_prompt_len" not in problem  # it would drop every prompt: not offered
    # a cap that drops every prompt, and one that keeps the short one (then the positions fit)
    refused_then_fixed(["data=jsonl", f"data.path={german}", "rollout.max_prompt_len=10"],
                       "rollout.max_prompt_len: every prompt of data.path is longer than 10 tokens (the shortest "
                       "has 61)")
    problem = refused_then_fixed([*mine, "model.arch.max_position_embeddings=100"], "model.arch.max_position")
    assert "set model.arch.max_position_embeddings=128 or rollout.max_prompt_len=68 to drop longer prompts" in problem
    assert errors([*mine, "model.arch.max_position_embeddings=100", "rollout.max_prompt_len=68"]) == []


@pytest.mark.parametrize("overrides, start", [
    (["rollout.max_response_len=64"], "rollout.max_response_len: 64 >= model.arch.max_position_embeddings=64, "
                                      "which leaves no room for the prompt; set rollout.max_response_len=32"),
    (["model.arch.vocab_size=262"], "model.arch.vocab_size: 262 != 24, the size of the builtin:digits tokenizer"),
])
def test_length_and_vocabulary_refusals_name_a_value_that_works(overrides, start):
    refused_then_fixed(overrides, start)


def test_a_dataset_smaller_than_a_rollout_batch_is_said(german, caplog):
    mine = ["data=jsonl", f"data.path={german}"]
    with caplog.at_level(logging.INFO, logger="slime_hydra"):
        assert errors(mine) == []
    said = caplog.text
    assert ("data.path has 2 prompts, fewer than rollout.batch_size=32: every rollout walks the data 16 times "
            "(8 samples of each prompt per pass") in said and "rollout.batch_size=2 makes a rollout one pass" in said
    assert "eval.datasets is empty: no held-out reward, the run reports its training reward" in said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="slime_hydra"):
        assert errors([*mine, "rollout.batch_size=2"]) == []
    assert "fewer than rollout.batch_size" not in caplog.text
    # counted in epochs, a batch larger than the data would make no step at all
    problem = refused_then_fixed([*mine, "trainer.num_rollout=null", "data.num_epoch=3"],
                                 "data.num_epoch: data.path has 2 prompts, fewer than rollout.batch_size=32")
    assert "the run would train 0 steps; set rollout.batch_size=2" in problem


def test_a_chat_prompt_without_a_template_says_what_to_set():
    tok = builtin_tokenizer("builtin:bytes")
    tok.chat_template = None
    row = Row(prompt=[{"role": "user", "content": "Wie viele?"}], label="7", metadata={}, tools=None, source="f:3")
    with pytest.raises(DataError, match="f:3: data.apply_chat_template=true but the tokenizer has no chat template; "
                                        "set data.apply_chat_template=false for text prompts, or model.tokenizer"):
        render_prompt(row, tok, apply_chat_template=True)
