"""The bench/ scripts are not run by CI (they measure), so what can break them without a GPU is checked
here: their imports of this package (a module or a name moved in a refactor fails at once instead of in
the next measurement), and that each script imports and parses its arguments (``--help``) on a CPU."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import runpy
import sys

import pytest

from conftest import ROOT

SCRIPTS = sorted((ROOT / "bench").rglob("*.py")) + sorted((ROOT / "docs").glob("*.py"))
# the command-line scripts of bench/ (bench/gpu/harness.py's own command line is checked in test_bench_harness)
CLI = [p for p in sorted((ROOT / "bench").rglob("*.py")) if "argparse" in p.read_text()]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_package_names_a_script_imports_exist(script):
    for node in ast.walk(ast.parse(script.read_text(), str(script))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("slime_hydra"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
                    f"{script.name}:{node.lineno}: {node.module} has no {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("slime_hydra"):
                    importlib.import_module(alias.name)


@pytest.mark.parametrize("script", CLI, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_script_imports_and_parses_its_arguments(script, monkeypatch, capsys):
    """``python bench/X.py --help`` in this process (torch imported once for all): its module-level
    imports (bench/gpu/ included) resolve and its parser builds."""
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put bench/ first on it
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out
