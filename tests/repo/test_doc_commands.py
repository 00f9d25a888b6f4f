"""Every ``python run.py ...`` command that README.md and docs/*.md show a reader validates as
``dry_run=true`` would: composed with Hydra, resolved, fitted to its GPUs by the plan and checked by every
rule and the memory estimate. A documented command that is refused fails here, with the doc and line.

Placeholder data paths (``/data/...``) become a fixture; a sweep (``-m``) is checked for every job;
``hydra.*`` overrides and Hydra's flags (``--cfg job``) are dropped; commands with ``...`` or ``<...>`` in
them are sketches, not commands, and are skipped. In-process (compose + check): a subprocess per command
would cost seconds each. The recipes (docs/recipes/) are run step by step, their files written first, by
tests/repo/test_recipes.py, which dry-runs every run.py command in them the same way.
"""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path
from typing import List, Tuple

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from conftest import ROOT, compose
from slime_hydra.launch.validate import check

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
INLINE = re.compile(r"`(python run\.py[^`]*)`")
DATA = str(ROOT / "tests" / "fixtures" / "prompts.jsonl")
# a data file the reader brings (`data.path=/data/math.jsonl`) or an earlier recipe step writes
PLACEHOLDER = re.compile(r"(?<=\.path=)[\w./-]+\.(?:jsonl|parquet)")


def documented_commands() -> List[Tuple[str, str]]:
    """(``doc:line``, command) for every ``python run.py`` command of the docs, continuations joined."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        spans = [(m.start(1), m.group(1)) for m in FENCE.finditer(text)]
        spans += [(m.start(1), m.group(1)) for m in INLINE.finditer(text)]
        for start, code in spans:
            lines = code.replace("\\\n", " ").splitlines()
            for cmd in lines:
                cmd = cmd.split(" #")[0].strip()
                if not cmd.startswith("python run.py") or "..." in cmd or "<" in cmd:
                    continue
                line = text.count("\n", 0, start) + 1 + next(i for i, c in enumerate(code.splitlines())
                                                             if c.strip().startswith(cmd[:30]))
                out.append((f"{doc.relative_to(ROOT)}:{line}", cmd))
    return out


def jobs(cmd: str) -> List[List[str]]:
    """The override lists that ``cmd`` runs: one, or one per job of a sweep."""
    args = shlex.split(PLACEHOLDER.sub(lambda m: m.group(0) if (ROOT / m.group(0)).is_file() else DATA, cmd))[2:]
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("--cfg", "-c", "--package", "-p"):
            skip = True
        elif a.startswith("-") or a.split("=")[0].lstrip("+~").startswith("hydra."):
            continue
        else:
            kept.append(a)
    parsed = OverridesParser.create().parse_overrides(kept)
    choices = [[o.input_line] if not o.is_sweep_override() else
               [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] for o in parsed]
    return [list(c) for c in itertools.product(*choices)]


COMMANDS = documented_commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 8, COMMANDS
    assert jobs("python run.py -m algo=grpo,gspo seed=1,2 hydra.run.dir=x --cfg job") == [
        ["algo=grpo", "seed=1"], ["algo=grpo", "seed=2"], ["algo=gspo", "seed=1"], ["algo=gspo", "seed=2"]]


@pytest.mark.parametrize("where, cmd", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_command_validates(where, cmd):
    for overrides in jobs(cmd):
        try:
            check(compose(overrides))
        except Exception as e:  # noqa: BLE001 - the doc's line and the reason are the report
            pytest.fail(f"{where}: `{cmd}` is refused ({' '.join(overrides)}):\n{e}")


def test_placeholders_become_the_fixture():
    assert Path(DATA).is_file()
    assert jobs("python run.py data.path=/data/math.jsonl") == [[f"data.path={DATA}"]]
    assert jobs("python run.py data.path=tests/fixtures/tiny.jsonl") == [["data.path=tests/fixtures/tiny.jsonl"]]
