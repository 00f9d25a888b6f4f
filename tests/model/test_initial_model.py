"""The random initial model of a run directory: ``initial_model/`` is rebuilt for a new model (a fingerprint of
what built it sits inside it), and kept, or refused naming the keys that differ, for a run that resumes there."""

from __future__ import annotations

import json
import os

import pytest

from conftest import ROOT, resolved
from slime_hydra.config import ConfigError
from slime_hydra.model.hf import FINGERPRINT, initial_checkpoint, initial_fingerprint


def cfg_in(run_dir, *overrides):
    os.chdir(ROOT)
    cfg = resolved(list(overrides))
    cfg.output_dir = str(run_dir)
    return cfg


def layers(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]


def test_initial_model_is_rebuilt_for_another_model_and_kept_when_resuming(tmp_path):
    three, five = cfg_in(tmp_path), cfg_in(tmp_path, "model.arch.num_layers=5")
    assert three.model.arch.num_layers == 3
    out = tmp_path / "initial_model"
    assert initial_checkpoint(three.model, str(tmp_path)) == str(out) and layers(out) == 3
    assert json.loads((out / FINGERPRINT).read_text()) == initial_fingerprint(three.model)
    mtime = (out / "config.json").stat().st_mtime_ns
    assert initial_checkpoint(three.model, str(tmp_path)) == str(out)  # the same model: reused, not rebuilt
    assert (out / "config.json").stat().st_mtime_ns == mtime

    # a run that resumes this run dir's checkpoint keeps the model it trained from, and refuses another
    with pytest.raises(ConfigError, match=r"model\.arch\.num_layers: 5, but the initial model was built with 3"):
        initial_checkpoint(five.model, str(tmp_path), resuming=True)
    assert layers(out) == 3

    # a new run builds its own (before the fix: the 3-layer model, under a config.yaml saying 5)
    initial_checkpoint(five.model, str(tmp_path))
    assert layers(out) == 5 and json.loads((out / FINGERPRINT).read_text())["model.arch.num_layers"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["initial_model"]  # no .tmp or .old left behind

    seed = cfg_in(tmp_path, "model.arch.num_layers=5", "model.init_seed=7")
    built = five.model.init_seed
    with pytest.raises(ConfigError, match=rf"model\.init_seed: 7, but the initial model was built with {built}"):
        initial_checkpoint(seed.model, str(tmp_path), resuming=True)
    os.remove(out / FINGERPRINT)  # built before fingerprints were written: a resumed run keeps it
    assert initial_checkpoint(seed.model, str(tmp_path), resuming=True) == str(out)
    assert not (out / FINGERPRINT).exists()
