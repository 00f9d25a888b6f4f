"""constraints.txt, the exact versions `make` installs: one pin a package, inside pyproject.toml's ranges."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _pins() -> dict:
    pins = {}
    for n, line in enumerate((ROOT / "constraints.txt").read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version.strip(), f"constraints.txt:{n}: {line!r} is not name==version"
        key = canonicalize_name(name)
        assert key not in pins, f"constraints.txt:{n}: {name} pinned twice"
        pins[key] = Version(version.strip())
    return pins


def _requirements() -> list:
    """The core dependencies and the dev extra's, with the extras that dev names of slime_hydra itself."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    out, todo = [], [Requirement(r) for r in project["dependencies"] + extras["dev"]]
    while todo:
        req = todo.pop()
        if canonicalize_name(req.name) == canonicalize_name(project["name"]):
            todo += [Requirement(r) for extra in req.extras for r in extras[extra]]
        else:
            out.append(req)
    return out


def test_every_requirement_is_pinned_inside_its_range():
    pins = _pins()
    for req in _requirements():
        key = canonicalize_name(req.name)
        if key == "torch":  # installed first by the Makefile (TORCH=...), never constrained
            assert key not in pins, "constraints.txt pins torch, which the Makefile installs on its own"
            continue
        assert key in pins, f"{req.name} (pyproject.toml) has no pin in constraints.txt: run `make lock`"
        assert req.specifier.contains(pins[key], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[key]}, outside pyproject.toml's {req}: run `make lock`")


def test_makefile_installs_with_the_constraints():
    makefile = (ROOT / "Makefile").read_text()
    assert '-c constraints.txt -e ".[dev]"' in makefile
    assert "$(VENV)/.installed: pyproject.toml constraints.txt" in makefile


@pytest.mark.integration
def test_pip_check_passes_in_the_installed_environment():
    """Every installed package's requirements are met (the extras too: `make` installs the dev extra)."""
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
