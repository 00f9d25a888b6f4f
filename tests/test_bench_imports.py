"""The bench/ scripts are not run by CI (they measure), so their imports of this package are checked
here: a module or a name moved in a refactor fails at once instead of in the next measurement."""

from __future__ import annotations

import ast
import importlib
import importlib.util

import pytest

from conftest import ROOT

SCRIPTS = sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "docs").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
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
