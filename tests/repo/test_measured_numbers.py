"""One home per number: a number the docs quote beside a measurement file is in that file (so a re-measured
number cannot stay stale in a doc that copied it), every link into bench/measured/ or docs/ resolves, and every
file under bench/measured/ is linked by a doc (what nothing links is superseded: git keeps it).

The docs: README.md, docs/**/*.md and bench/README.md. The rule for numbers:

- A doc is cut into *units*: runs of non-blank lines, where every list item (``- ``, ``* ``, ``1. ``)
  and every table row starts a unit of its own. Fenced code blocks are left out, and numbers inside
  inline code are not counted: commands and config keys (``--steps 6``, ``max_new_tokens=1``) are not
  quotes (a path in inline code still names a file).
- A unit that names files under ``bench/measured/`` (as a path anywhere in it, ``bench/measured/x.md``
  or ``../bench/measured/x.md``, or as a markdown link resolved from the doc's folder) is a quote of
  those files; a glob (``long_run_*.md``) names every file it matches.
- Every *number* in such a unit must appear, as a number, in at least one of the files it names: the
  same digits, not inside a longer number (``1.41`` is not found in ``11.41``), or, for a decimal, a
  longer decimal of the file rounded to the places the doc writes (``0.229`` for a JSON's
  ``0.2290246``; ``1.4`` for ``1.41``, not for ``1.46``). Thousands separators are ignored on both sides.
  The unit after a number is not compared (tables keep units in their headers).
- A number is a decimal (``0.94``, ``1.41 s``), a number with ``%`` or ``x`` attached (``44.7%``,
  ``7.1x``), or an integer followed by a unit of time, size, rate or speed (``6 s``, ``41 ms/GB``,
  ``2 min``, ``92.5 GiB``, ``13223 tokens/s``). Not numbers: bare integers (step counts, seeds, list
  markers), dates and times (``2026-12-01``, ``06:38``), versions (``0.5.17``; a decimal right after a
  package name: ``SGLang 0.5``, ``TRL 1.16``) and names with digits (``Qwen3-0.6B``, ``H200``, ``bf16``,
  ``1e-3``, ``GLM-4.5``).

A unit that quotes a number from elsewhere must not name a measurement file, or the number must be
added to that file with how it was measured.
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

from conftest import ROOT

MEASURED = ROOT / "bench" / "measured"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "bench" / "README.md"]

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
UNIT_START = re.compile(r"^\s*(?:[-*+]\s|\d+\.\s|\|)")
MEASURED_PATH = re.compile(r"bench/measured/([\w.*-]+)")
MD_LINK = re.compile(r"\]\(([^)\s#]+)")
# A number: digits (thousands separated by commas allowed), an optional decimal part, an optional glued
# suffix; not part of a word, a longer number, a version (x.y.z) or a name like GLM-4.5 / Qwen3-0.6B.
NUMBER = re.compile(r"(?<![\w.,])(?<![A-Za-z]-)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(%|x)?(?![\w]|[.,]\d)")
UNIT_AFTER = re.compile(r"\s?(?:ms/GB|ms|s|min|h|GiB|GB|MiB|MB|tokens/s|TFLOP/s|GB/s|ms/step)(?![\w/])")
VERSION_BEFORE = re.compile(r"(?:SGLang|sglang|sglang-router|TRL|Ray|Python|torch|transformers|vLLM|Megatron-core|"
                            r"megatron-core|CUDA|Qwen|Llama|version|\bv)\s?$")
FILE_NUMBER = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?![\d]|[.,]\d)")


def units(text: str) -> Iterator[Tuple[int, str]]:
    """(first line number, text) of every unit of a markdown text, without its fenced code blocks."""
    start, lines, fenced = 0, [], False
    for i, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            line = ""
        if fenced or not line.strip() or UNIT_START.match(line):
            if lines:
                yield start, "\n".join(lines)
            start, lines = i, []
            if fenced or not line.strip():
                continue
        if not lines:
            start = i
        lines.append(line)
    if lines:
        yield start, "\n".join(lines)


def numbers(text: str) -> List[str]:
    """The numbers of a unit outside its code spans, as written (without thousands separators)."""
    text = CODE_SPAN.sub(" ", text)
    found = []
    for m in NUMBER.finditer(text):
        integer, decimal, glued = m.group(1), m.group(2) or "", m.group(3)
        if decimal and VERSION_BEFORE.search(text[:m.start()]):
            continue
        if decimal or glued or UNIT_AFTER.match(text, m.end()):
            found.append(integer.replace(",", "") + decimal)
    return found


def file_numbers(path: Path) -> Set[str]:
    """Every number of a file, as written and rounded to each shorter number of decimal places."""
    held = set()
    for m in FILE_NUMBER.finditer(path.read_text()):
        integer, decimal = m.group(1).replace(",", ""), m.group(2) or ""
        held.add(integer + decimal)
        for places in range(1, len(decimal) - 1):
            held.add(str(Decimal(integer + decimal).quantize(Decimal(1).scaleb(-places), ROUND_HALF_UP)))
    return held


def linked_files(doc: Path, unit: str, root: Path) -> Tuple[List[Path], List[str]]:
    """The files under bench/measured/ that a unit names (paths from the repository root, or links from
    the doc's folder), and the names that match no file."""
    measured = (root / "bench" / "measured").resolve()
    files: List[Path] = []
    missing: List[str] = []
    for m in MEASURED_PATH.finditer(unit):
        found = sorted(p.resolve() for p in measured.glob(m.group(1).rstrip(".,")))
        files += found
        missing += [] if found else [m.group(0).rstrip(".,")]
    for m in MD_LINK.finditer(unit):
        target = (doc.parent / m.group(1)).resolve()
        if measured in target.parents and target.is_file():
            files.append(target)
    return sorted(set(files)), missing


def stale(doc: Path, root: Path) -> List[str]:
    """Every number of ``doc`` that its unit quotes beside measurement files but none of them holds, and
    every measurement file a unit names that does not exist."""
    root = root.resolve()
    where = doc.resolve().relative_to(root)
    cache: Dict[Path, Set[str]] = {}
    problems = []
    for line, unit in units(doc.read_text()):
        files, missing = linked_files(doc, unit, root)
        problems += [f"{where}:{line}: {name} does not exist" for name in missing]
        if not files:
            continue
        held = set().union(*(cache.setdefault(f, file_numbers(f)) for f in files))
        names = ", ".join(str(f.relative_to(root)) for f in files)
        problems += [f"{where}:{line}: {number} is not in {names}" for number in numbers(unit) if number not in held]
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_numbers_are_in_their_measurement_files(doc):
    assert doc.is_file(), f"{doc} is missing"
    problems = stale(doc, ROOT)
    assert not problems, "numbers the docs quote are not in the files they link (re-measured? copy the new " \
                         "number, or drop the link):\n" + "\n".join(problems)


def links(doc: Path, root: Path) -> Iterator[Tuple[int, Path]]:
    """(line, target) of every markdown link and ``bench/measured/`` path of a doc that points into
    bench/measured/ or docs/ (resolved from the doc's folder; paths from the repository root)."""
    root = root.resolve()
    places = [(root / "bench" / "measured"), (root / "docs")]
    for i, line in enumerate(doc.read_text().splitlines(), 1):
        targets = [(doc.parent / m.group(1)).resolve() for m in MD_LINK.finditer(line)
                   if "://" not in m.group(1) and not m.group(1).startswith("mailto:")]
        targets += [root / "bench" / "measured" / m.group(1).rstrip(".,") for m in MEASURED_PATH.finditer(line)
                    if "*" not in m.group(1)]
        for target in dict.fromkeys(targets):  # a link to bench/measured/ is a path too: once each
            if any(place == target or place in target.parents for place in places):
                yield i, target


def broken_links(doc: Path, root: Path) -> List[str]:
    where = doc.resolve().relative_to(root.resolve())
    return [f"{where}:{line}: {target.relative_to(root.resolve())} does not exist"
            for line, target in links(doc, root) if not target.exists()]


def unlinked(root: Path, docs: List[Path]) -> List[str]:
    """The files under bench/measured/ that no doc links (by a markdown link, a path, or a glob)."""
    linked = {target for doc in docs if doc.is_file() for _, target in links(doc, root)}
    for doc in docs:
        if doc.is_file():
            for m in MEASURED_PATH.finditer(doc.read_text()):
                linked.update((root / "bench" / "measured").resolve().glob(m.group(1).rstrip(".,")))
    return sorted(str(p.relative_to(root.resolve())) for p in (root / "bench" / "measured").resolve().iterdir()
                  if p.is_file() and p not in linked)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_into_measured_and_docs_resolve(doc):
    problems = broken_links(doc, ROOT)
    assert not problems, "links that do not resolve:\n" + "\n".join(problems)


def test_every_measured_file_is_linked_by_a_doc():
    orphans = unlinked(ROOT, DOCS)
    assert not orphans, (f"no doc links {orphans}: delete what is superseded (git keeps it), or link it from "
                         "docs/performance.md")


def test_links_and_orphans_are_caught(tmp_path):
    (tmp_path / "bench" / "measured").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    for name in ("a.md", "b.json", "c.md"):
        (tmp_path / "bench" / "measured" / name).write_text("1.0\n")
    doc = tmp_path / "docs" / "page.md"
    doc.write_text("[a](../bench/measured/a.md) and `bench/measured/b.json`, [gone](../bench/measured/x.md),\n"
                   "[other](other.md), [web](https://example.com/docs/y.md), [src](../run.py)\n")
    assert broken_links(doc, tmp_path) == ["docs/page.md:1: bench/measured/x.md does not exist",
                                           "docs/page.md:2: docs/other.md does not exist"]
    assert unlinked(tmp_path, [doc]) == ["bench/measured/c.md"]


def test_numbers_rule():
    text = ("1.41 s a step, 44.7% MFU, 7.1x TRL, 41 ms/GB, 13,223 tokens/s, 2 min 6 s, held-out 0.91-1.00; "
            "not: 150 steps, seed 1234, 2026-12-01 at 06:38 UTC, SGLang 0.5.17, TRL 1.16, Qwen3-0.6B, H200, "
            "bf16, 1e-3, GLM-4.5, 8 prompts x 8 samples")
    assert numbers(text) == ["1.41", "44.7", "7.1", "41", "13223", "2", "6", "0.91", "1.00"]
    assert list(units("a\nb\n\n- c\n- d\n| e |\n```\n9.9 s\n```\nf `2.5 s` g")) == [
        (1, "a\nb"), (4, "- c"), (5, "- d"), (6, "| e |"), (10, "f `2.5 s` g")]
    assert numbers("f `2.5 s` g 3.5") == ["3.5"]


def test_a_stale_number_is_caught(tmp_path):
    """A hand-made doc and measurement file: the number the file holds passes, a stale one fails and is
    named with its doc, line and file; a link to a file that is not there fails too."""
    (tmp_path / "bench" / "measured").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench" / "measured" / "run.md").write_text("| step s | MFU |\n| **1.41** | 44.7% |\n11.41 2.6\n"
                                                           "0.2290246\n")
    doc = tmp_path / "docs" / "page.md"
    doc.write_text("Measured (`bench/measured/run.md`): 1.41 s a step,\n44.7% MFU.\n\n"
                   "- [a link](../bench/measured/run.md) to 2.65 s a step\n\n"
                   "Not quoted: 2.65 s with no link.\n\nGone: `bench/measured/old.md` says 3.0 s.\n")
    assert stale(doc, tmp_path) == [
        "docs/page.md:4: 2.65 is not in bench/measured/run.md",
        "docs/page.md:8: bench/measured/old.md does not exist"]
    doc.write_text("Measured (`bench/measured/run.md`): 1.41 s a step,\n44.7% MFU, 0.229 s, 0.23 s.\n")
    assert stale(doc, tmp_path) == []
    doc.write_text("Measured (`bench/measured/run.md`): 1.5 s, 1.4 s, 0.2290 s, 2.65 s, 0.22 s, 41 ms.\n")
    assert stale(doc, tmp_path) == [f"docs/page.md:1: {n} is not in bench/measured/run.md"
                                    for n in ("1.5", "2.65", "0.22", "41")]
