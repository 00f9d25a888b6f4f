"""The docs cannot rot: the figures render from their source, and every image, every repository path and
every ``slime_hydra.x.y`` name that README.md and docs/**/*.md mention exists."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FIGURES = ("step_dataflow.png", "weight_sync.png")  # docs/diagrams.py FIGURES
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
# a repository path: starts with a top-level folder, not inside a longer path or a URL
REPO_PATH = re.compile(r"(?<![\w./-])((?:slime_hydra|conf|bench|tests|docs|examples|docker)/[\w./*-]*)")
DOTTED = re.compile(r"(?<![\w./-])(slime_hydra(?:\.\w+)+)")


def mentions(pattern: re.Pattern) -> List[Tuple[str, str]]:
    """(doc, match) for every match of ``pattern`` in the docs."""
    return [(str(doc.relative_to(ROOT)), m.group(1)) for doc in DOCS for m in pattern.finditer(doc.read_text())]


def test_figures_render(tmp_path):
    import matplotlib.image

    out = subprocess.run([sys.executable, "docs/diagrams.py", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for name in FIGURES:
        path = tmp_path / name
        assert path.is_file() and path.stat().st_size > 20_000, f"{name} was not drawn (or is nearly empty)"
        pixels = matplotlib.image.imread(path)
        assert pixels.shape[0] > 400 and pixels.shape[1] > 800, f"{name}: {pixels.shape}"
        assert pixels[..., :3].std() > 0.05, f"{name} is blank"
        assert (ROOT / "docs" / "img" / name).is_file(), f"docs/img/{name} is not committed: run `make docs`"


def test_images_exist():
    missing = [(doc, src) for doc, src in mentions(IMAGE)
               if not src.startswith("http") and not (ROOT / Path(doc).parent / src).is_file()]
    assert not missing, missing


def test_repository_paths_exist():
    missing = []
    for doc, path in mentions(REPO_PATH):
        path = path.rstrip(".,")
        found = list(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
        if not found and re.search(rf"cat > {re.escape(path)}\b", (ROOT / doc).read_text()):
            continue  # a recipe writes it (tests/repo/test_recipes.py runs that recipe)
        if not found:
            missing.append((doc, path))
    assert not missing, f"the docs name paths that do not exist: {missing}"


def _defined(body: List[ast.stmt], name: str) -> Optional[ast.AST]:
    """The statement of ``body`` that defines ``name`` (a def, a class, an assignment or an import)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name.split(".")[0]) == name for a in node.names):
            return node
    return None


def resolves(dotted: str) -> bool:
    """``slime_hydra.pkg.module.Class.method``: the longest module prefix is a file, and the rest is
    defined in it (read with ``ast``, nothing imported)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.is_file():
            break
    else:
        return False
    body = ast.parse(source.read_text()).body
    for name in parts[i:]:
        node = _defined(body, name)
        if node is None:
            return False
        body = node.body if isinstance(node, ast.ClassDef) else []
    return True


def test_dotted_names_exist():
    missing = [(doc, name) for doc, name in mentions(DOTTED) if not resolves(name)]
    assert not missing, f"the docs name functions, classes or modules that do not exist: {missing}"


@pytest.mark.parametrize("dotted, ok", [("slime_hydra.sync.push.push_weights", True),
                                        ("slime_hydra.rollout.fleet.EngineFleet.start", True),
                                        ("slime_hydra.sync.push.no_such_function", False),
                                        ("slime_hydra.no_such_package", False)])
def test_dotted_name_check_itself(dotted, ok):
    assert resolves(dotted) is ok
