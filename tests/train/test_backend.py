"""The trainer-backend registry: names import lazily (dry_run must not pay for torch), and every
registered backend implements the whole interface."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from conftest import ROOT
from slime_hydra.train.backend import BACKENDS


def test_registry_is_importable_without_torch():
    code = ("import sys; from slime_hydra.train.backend import BACKENDS; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(sorted(BACKENDS))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_registered_backends_implement_the_interface(name):
    from slime_hydra.train.backend import TrainerBackend

    try:
        cls = BACKENDS[name]
    except ImportError as e:  # e.g. megatron-core on a machine without it
        pytest.skip(f"{name}: {e}")
    assert issubclass(cls, TrainerBackend) and not inspect.isabstract(cls)


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(KeyError, match=r"unknown trainer backend 'jax'; expected one of \[.*'torch'.*\]"):
        BACKENDS["jax"]
