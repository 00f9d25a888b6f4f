"""docs/architecture.md's map of the code ("Where the code lives") matches the tree: every folder of
slime_hydra/ that holds Python is on it, every path it names exists, and every entry says what it is for.

The map is the first fenced block after that heading: one entry a line, ``name   what it is for``, nested
by two spaces a level under the folder above it (a folder's name ends with ``/``)."""

from __future__ import annotations

import re
from typing import List, Tuple

import pytest

from conftest import ROOT

DOC = ROOT / "docs" / "architecture.md"
HEADING = "## Where the code lives"
ENTRY = re.compile(r"^(?P<indent> *)(?P<name>[\w.-]+/?)(?:\s{2,}(?P<what>\S.*))?$")


def parse_map(text: str) -> List[Tuple[str, str]]:
    """(path relative to the repository root, description) of every entry of the map in ``text``."""
    after = text.split(HEADING, 1)[1]
    block = re.search(r"```[^\n]*\n(.*?)```", after, re.S).group(1)
    entries, parents = [], []  # parents: the folders above the current line, one a level
    for n, line in enumerate(block.splitlines(), 1):
        if not line.strip():
            continue
        m = ENTRY.match(line)
        assert m, f"map line {n} is not `name   what it is for`: {line!r}"
        depth, rem = divmod(len(m.group("indent")), 2)
        assert rem == 0 and depth <= len(parents), f"map line {n} is indented oddly: {line!r}"
        del parents[depth:]
        path = "/".join(parents + [m.group("name").rstrip("/")])
        entries.append((path + ("/" if m.group("name").endswith("/") else ""), (m.group("what") or "").strip()))
        if m.group("name").endswith("/"):
            parents.append(m.group("name").rstrip("/"))
    return entries


def package_folders() -> List[str]:
    """Every folder under slime_hydra/ (itself included) that holds a Python file."""
    top = ROOT / "slime_hydra"
    return sorted(f"{d.relative_to(ROOT).as_posix()}/" for d in [top, *top.rglob("*")]
                  if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")))


MAP = parse_map(DOC.read_text())


def test_every_package_folder_is_on_the_map():
    named = {path for path, _ in MAP}
    missing = [d for d in package_folders() if d not in named]
    assert not missing, f"docs/architecture.md's map lacks these folders of slime_hydra/: {missing}"


def test_every_path_on_the_map_exists():
    missing = [path for path, _ in MAP if not (ROOT / path).exists()
               or path.endswith("/") != (ROOT / path).is_dir()]
    assert not missing, f"docs/architecture.md's map names paths that do not exist: {missing}"


def test_every_entry_says_what_it_is_for():
    bare = [path for path, what in MAP if path != "slime_hydra/" and not what]
    assert not bare, f"map entries without a description: {bare}"
    paths = [path for path, _ in MAP]
    assert len(paths) == len(set(paths)), f"entries named twice: {sorted({p for p in paths if paths.count(p) > 1})}"


@pytest.mark.parametrize("text, expected", [
    (f"{HEADING}\n```\nrun.py    the entry\npkg/      a package\n  sub/    a folder\n    a.py  a module\n"
     f"  b.py    another\ntop/      again\n```\n",
     [("run.py", "the entry"), ("pkg/", "a package"), ("pkg/sub/", "a folder"), ("pkg/sub/a.py", "a module"),
      ("pkg/b.py", "another"), ("top/", "again")]),
])
def test_parse_map_itself(text, expected):
    assert parse_map(text) == expected


def test_the_map_was_found():
    assert ("slime_hydra/", "") in MAP and len(MAP) > 50, MAP[:5]
