"""The packages of slime_hydra (config, data, rollout, train, ...) import each other without a cycle, and
so do its files.

Every import of every module counts, also those inside functions and under ``TYPE_CHECKING`` (a cycle
that only runs lazily is still two parts that cannot be understood, tested or replaced apart). A
module ``slime_hydra.<package>.<...>`` belongs to ``<package>``. Within a package, files may import each
other freely in one direction only: ``from slime_hydra.plan.memory import x`` is an edge to the file
``plan/memory.py``; importing a package (``from slime_hydra.train import algorithms``) is an edge to its
``__init__.py``, and an ``__init__.py`` that imports its own modules re-exports them (no edge back).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Set, Tuple

import networkx as nx

from conftest import ROOT

SOURCE = ROOT / "slime_hydra"



def imported_names(path: Path, root: Path = ROOT) -> List[Tuple[str, int]]:
    """Every absolute module name that ``path`` (under ``root``) imports, with its line (relative imports resolved)."""
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # `from slime_hydra import train` names a package; `from x.y import z` is in x.y
            names += [(f"{base}.{alias.name}" if base == "slime_hydra" else base, node.lineno) for alias in node.names]
    return names


def package_graph() -> Dict[Tuple[str, str], Set[str]]:
    """(importing package, imported package) -> the ``file:line`` places that make the edge."""
    edges: Dict[Tuple[str, str], Set[str]] = defaultdict(set)
    for path in sorted(SOURCE.rglob("*.py")):
        parts = path.relative_to(SOURCE).parts
        if len(parts) < 2:
            continue  # slime_hydra/__init__.py belongs to no package
        for name, line in imported_names(path):
            target = name.split(".")
            if target[0] == "slime_hydra" and len(target) > 1 and target[1] != parts[0]:
                edges[(parts[0], target[1])].add(f"{path.relative_to(ROOT)}:{line}")
    return edges


def module_file(name: str) -> str | None:
    """The file under slime_hydra/ that the module (or package) ``name`` is, if it exists."""
    parts = name.split(".")
    for n in range(len(parts), 1, -1):  # `from slime_hydra.x.y import z` may name the module x.y or the package
        base = ROOT.joinpath(*parts[:n])
        if base.with_suffix(".py").is_file():
            return str(base.with_suffix(".py").relative_to(ROOT))
        if (base / "__init__.py").is_file():
            return str((base / "__init__.py").relative_to(ROOT))
    return None


def file_graph() -> Dict[Tuple[str, str], Set[str]]:
    """(importing file, imported file) -> the lines that make the edge, for every file of the package."""
    edges: Dict[Tuple[str, str], Set[str]] = defaultdict(set)
    for path in sorted(SOURCE.rglob("*.py")):
        src = str(path.relative_to(ROOT))
        for name, line in imported_names(path):
            target = module_file(name) if name.startswith("slime_hydra.") else None
            if target is None or target == src:
                continue
            if path.name == "__init__.py" and Path(target).parent == Path(src).parent:
                continue  # a package's __init__ re-exporting its own module
            if Path(target).name == "__init__.py" and Path(src).is_relative_to(Path(target).parent):
                continue  # a module of a package importing that package's __init__ (it runs first anyway)
            edges[(src, target)].add(f"{src}:{line}")
    return edges


def cycle_edges(edges) -> Set[Tuple[str, str]]:
    graph = nx.DiGraph(list(edges))
    components = [c for c in nx.strongly_connected_components(graph) if len(c) > 1]
    return {(a, b) for a, b in edges if any(a in c and b in c for c in components)}


def describe_cycles(edges) -> str:
    lines = []
    for cycle in sorted(nx.simple_cycles(nx.DiGraph(list(edges))), key=len):
        lines.append(" -> ".join([*cycle, cycle[0]]))
        for a, b in zip(cycle, [*cycle[1:], cycle[0]]):
            lines.append(f"    {a} -> {b}: {', '.join(sorted(edges[(a, b)]))}")
    return "\n".join(lines)


def test_the_parser_sees_function_level_and_relative_imports(tmp_path):
    mod = tmp_path / "slime_hydra" / "alpha" / "mod.py"
    mod.parent.mkdir(parents=True)
    mod.write_text("import os\nfrom . import sibling\nfrom ..beta.x import y\n\n"
                   "def f():\n    from slime_hydra import gamma\n    import slime_hydra.delta.z\n")
    assert imported_names(mod, tmp_path) == [("os", 1), ("slime_hydra.alpha", 2), ("slime_hydra.beta.x", 3),
                                             ("slime_hydra.gamma", 6), ("slime_hydra.delta.z", 7)]


def test_cycles_are_found_and_described():
    edges = {("a", "b"): {"a.py:1"}, ("b", "c"): {"b.py:2"}, ("c", "a"): {"c.py:3"}, ("c", "d"): {"c.py:4"}}
    assert cycle_edges(edges) == {("a", "b"), ("b", "c"), ("c", "a")}
    assert "b -> c: b.py:2" in describe_cycles(edges)


def test_config_imports_no_other_package_but_utils():
    """Every component's rules import config (its schema and rule helpers), so config imports none of them."""
    edges = package_graph()
    assert {b for a, b in edges if a == "config"} <= {"utils"}, {e: edges[e] for e in edges if e[0] == "config"}


def test_package_imports_have_no_cycle():
    edges = package_graph()
    assert not cycle_edges(edges), "import cycles between packages:\n" + describe_cycles(edges)


def test_file_imports_have_no_cycle():
    edges = file_graph()
    assert ("slime_hydra/plan/fit.py", "slime_hydra/plan/memory.py") in edges  # the graph sees files
    assert not cycle_edges(edges), "import cycles between files:\n" + describe_cycles(edges)
