"""Every command in docs/recipes/*.md runs here, so the recipes cannot rot.

The info string of a fenced block says how CI treats it (docs/recipes/README.md repeats this):

- ``bash``: run as written, in a scratch copy of the repo (``run.py``, ``conf/``, ``examples/``; the
  package from this checkout), the blocks of one recipe in order, so that files a block writes are
  there for the next one, as for a reader following along. Each ``python run.py ...`` command gets
  ``dry_run=true`` appended in the fast suite (it must compose, validate and plan on CPU); in the slow
  suite it runs for real, shortened by :data:`SHORT`, and must write its metrics.
- ``bash after-run``: reads what a run of an earlier block wrote (metrics, plots), so it runs only in
  the slow suite, where runs are real; the fast suite checks that it parses (``bash -n``).
- ``bash gpu``: needs GPUs. Its ``run.py`` commands get ``dry_run=true`` appended in both suites, and
  they must plan on cuda.
- ``bash no-ci``: cannot run here (docker, sbatch, ray start on other machines, a download). The block
  must parse (``bash -n``), and every ``run.py ...`` command in it must compose with Hydra and the typed
  schema (``--cfg job --resolve``: keys, types, interpolations), without the validation that needs the
  machine's files and GPUs.
- ``python``: its first line names a file (``# examples/...``); the rest must be a verbatim excerpt of
  that file, which the recipe's commands then use.
- Blocks without an info string (output, file listings) are not run; any other info string fails.

The reader's own files (their CSV, their converted math set) are stand-ins written by :func:`scratch`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (ROOT / "docs" / "recipes").glob("*.md") if p.name != "README.md")
KINDS = {"bash", "bash after-run", "bash gpu", "bash no-ci", "python", ""}
# Appended to each CPU run.py command in the slow suite: two rollouts, no evaluation before or between
# steps (one after the last), no progress bar. Keys the command sets itself are left to it (append_to_run_py).
SHORT = "trainer.num_rollout=2 eval.interval=0 eval.before_train=false logging.progress=false"
DRY = "dry_run=true"
COMPOSE = "--cfg job --resolve"
RUN_PY = re.compile(r"(?:^|\s)\S*python3?\s+(?:-u\s+)?run\.py\b")
# A stand-in for the reader's question/answer file: the built-in digits task (the answer is the largest
# digit), which the tiny model's tokenizer can spell, so the recipes' CPU commands train on it for real.
QUESTIONS = ["3815=", "2047=", "9120=", "5553=", "6071=", "1234=", "8008=", "4726="]


@dataclass
class Block:
    kind: str
    code: str
    line: int  # of the opening fence, 1-based

    def where(self, path: Path) -> str:
        return f"{path.relative_to(ROOT)}:{self.line} ({self.kind or 'plain'} block)"


def blocks(path: Path) -> List[Block]:
    out, fence, kind, start, lines = [], None, "", 0, []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r"^(\s*)(```+)(.*)$", line)
        if fence is None and m:
            fence, kind, start, lines = m.group(2), m.group(3).strip(), i, []
        elif fence is not None and m and m.group(2) == fence and not m.group(3).strip():
            out.append(Block(kind, "\n".join(lines) + "\n", start))
            fence = None
        elif fence is not None:
            lines.append(line)
    assert fence is None, f"{path.relative_to(ROOT)}:{start}: the fence is never closed"
    return out


def logical_lines(code: str) -> List[str]:
    """Lines with backslash continuations joined."""
    out, cur = [], ""
    for line in code.splitlines():
        if line.endswith("\\"):
            cur += line[:-1] + " "
        else:
            out.append(cur + line)
            cur = ""
    if cur:
        out.append(cur)
    return out


def split_comment(line: str) -> "tuple[str, str]":
    """(command, trailing comment): a ``#`` outside quotes that starts a word begins the comment."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i:]
    return line.rstrip(), ""


def append_to_run_py(code: str, extra: str) -> str:
    """``code`` with the overrides of ``extra`` appended to every ``python run.py ...`` command, but for
    the keys the command sets itself (a recipe's ``trainer.num_rollout=4`` stays)."""
    out = []
    for line in logical_lines(code):
        cmd, comment = split_comment(line)
        if RUN_PY.search(cmd):
            own = set(re.findall(r"(?:^|\s)'?\+?([\w.]+)=", cmd))
            add = " ".join(o for o in extra.split() if o.split("=")[0] not in own)
            line = f"{cmd} {add}".rstrip() + (f"  {comment}" if comment else "")
        out.append(line)
    return "\n".join(out) + "\n"


def run_py_commands(code: str) -> List[str]:
    """Every ``run.py ...`` command of a block, as ``python run.py <its arguments>``."""
    out = []
    for line in logical_lines(code):
        cmd, _ = split_comment(line)
        m = re.search(r"\brun\.py\b(.*)$", cmd)
        if m:
            out.append(f"{sys.executable} run.py{m.group(1)}")
    return out


def scratch(tmp: Path) -> Path:
    """A scratch copy of the repo's entry point, configs and examples, with the reader's stand-in files."""
    shutil.copy(ROOT / "run.py", tmp / "run.py")
    for d in ("conf", "examples"):
        shutil.copytree(ROOT / d, tmp / d, ignore=shutil.ignore_patterns("__pycache__"))
    rows = [(q, max(q[:-1])) for q in QUESTIONS * 4]
    (tmp / "questions.csv").write_text("question,answer\n" + "".join(f"{q},{a}\n" for q, a in rows) + "9999=,\n")
    (tmp / "data").mkdir()
    # a math file's prompts are text (the recipes render them with data.apply_chat_template either way)
    lines = (ROOT / "tests" / "fixtures" / "prompts.jsonl").read_text().splitlines()
    (tmp / "data" / "math.jsonl").write_text("".join(f"{line}\n" for line in lines
                                                    if line.strip() and isinstance(json.loads(line)["prompt"], str)))
    return tmp


def parses(code: str) -> str:
    """A command that checks that ``code`` is valid bash without running it."""
    return f"bash -n <<'__RECIPE__'\n{code}__RECIPE__\n"


def shell(code: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "WANDB_MODE": "offline", "RAY_AUTH_MODE": "disabled", "HYDRA_FULL_ERROR": "1",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    return subprocess.run(["bash", "-eo", "pipefail", "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def check(proc: subprocess.CompletedProcess, what: str, code: str) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{what} failed (exit {proc.returncode}):\n{code}\n--- output ---\n{out[-4000:]}"
    return out


def run_recipe(path: Path, tmp: Path, real: bool) -> None:
    cwd = scratch(tmp)
    for b in blocks(path):
        where = b.where(path)
        if b.kind == "bash":
            code = append_to_run_py(b.code, SHORT if real else DRY)
            before = len(list(cwd.glob("**/metrics.jsonl")))
            out = check(shell(code, cwd, timeout=900 if real else 240), where, code)
            assert "Resource plan (cuda" not in out, f"{where}: plans GPUs; mark it ```bash gpu"
            if real and RUN_PY.search(b.code):
                assert len(list(cwd.glob("**/metrics.jsonl"))) > before, f"{where}: no new metrics.jsonl\n{out[-3000:]}"
        elif b.kind == "bash after-run":
            check(shell(b.code if real else parses(b.code), cwd, timeout=120), where, b.code)
        elif b.kind == "bash gpu":
            code = append_to_run_py(b.code, DRY)
            out = check(shell(code, cwd, timeout=240), where, code)
            assert RUN_PY.search(b.code), f"{where}: a gpu block without a run.py command; use ```bash or no-ci"
            assert "Resource plan (cpu" not in out, f"{where}: plans on CPU; mark it ```bash"
        elif b.kind == "bash no-ci":
            check(shell(parses(b.code), cwd, timeout=30), f"{where}: bash -n", b.code)
            for cmd in run_py_commands(b.code):
                cmd = cmd.rstrip().removesuffix("&")  # a driver started in the background (a Slurm trap waits on it)
                check(shell(f"{cmd} {COMPOSE}", cwd, timeout=240), f"{where}: compose", cmd)


def test_recipes_exist_and_use_known_block_kinds():
    assert RECIPES, "no recipes in docs/recipes"
    index = (ROOT / "docs" / "recipes" / "README.md").read_text()
    for path in RECIPES:
        kinds = [b.kind for b in blocks(path)]
        assert set(kinds) <= KINDS, f"{path.name}: unknown block kinds {set(kinds) - KINDS}; allowed: {KINDS}"
        assert {"bash", "bash gpu"} & set(kinds), f"{path.name}: no block that CI runs"
        assert f"({path.name})" in index, f"docs/recipes/README.md does not link {path.name}"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_python_blocks_are_excerpts_of_real_files(path):
    for b in blocks(path):
        if b.kind != "python":
            continue
        first, _, body = b.code.partition("\n")
        m = re.fullmatch(r"#\s*(\S+\.py)", first.strip())
        assert m, f"{b.where(path)}: the first line must name its file: '# examples/....py'"
        source = ROOT / m.group(1)
        assert source.is_file(), f"{b.where(path)}: {m.group(1)} does not exist"
        assert body.strip() and body in source.read_text(), f"{b.where(path)}: not a verbatim excerpt of {source}"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_commands_dry_run(path, tmp_path):
    run_recipe(path, tmp_path, real=False)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_commands_run_for_real(path, tmp_path):
    run_recipe(path, tmp_path, real=True)


def test_append_to_run_py_keeps_comments_and_continuations():
    code = "python run.py a=1 \\\n    b='x # y'   # a comment\necho run.py\npython3 run.py -m c=1,2\n"
    assert append_to_run_py(code, "d=2 a=3") == (
        "python run.py a=1      b='x # y' d=2  # a comment\necho run.py\npython3 run.py -m c=1,2 d=2 a=3\n")
    assert run_py_commands("docker run img python3 run.py x=1 \\\n  y=2  # note\n") == [
        f"{sys.executable} run.py x=1    y=2"]
