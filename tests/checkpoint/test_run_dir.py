"""A reused run directory: a run that resumes there with another model is refused naming the keys that differ,
and a new run is refused where an earlier run's checkpoints would be pruned with its own or resumed from."""

from __future__ import annotations

import json
import os

from conftest import ROOT, resolved
from slime_hydra.checkpoint.ckpt import find_checkpoint, save_checkpoint
from slime_hydra.launch.validate import validate
from slime_hydra.model.hf import FINGERPRINT, initial_fingerprint


def cfg_in(run_dir, *overrides):
    os.chdir(ROOT)
    cfg = resolved(list(overrides))
    cfg.output_dir = str(run_dir)
    return cfg


def save(run_dir, step, hf_config=None):
    def write(d):
        if hf_config is not None:
            os.makedirs(os.path.join(d, "hf"))
            with open(os.path.join(d, "hf", "config.json"), "w") as f:
                json.dump(hf_config, f)

    return save_checkpoint(str(run_dir), step, write, {"epoch": 0}, keep=5)


def test_resuming_with_another_model_is_refused_naming_the_keys(tmp_path):
    three = cfg_in(tmp_path)
    os.makedirs(tmp_path / "initial_model")
    (tmp_path / "initial_model" / FINGERPRINT).write_text(json.dumps(initial_fingerprint(three.model)))
    save(tmp_path, 10)
    assert validate(cfg_in(tmp_path, "trainer.resume=auto")) == []
    errs = validate(cfg_in(tmp_path, "trainer.resume=auto", "model.arch.num_layers=5"))
    assert len(errs) == 1 and errs[0].startswith("model.arch.num_layers: 5, but the initial model was built with 3; "
                                                 "trainer.resume='auto' continues"), errs

    # a run dir without a fingerprint, or a run with model.path: the checkpoint's hf/config.json says
    other = tmp_path / "other"
    save(other, 10, {"num_hidden_layers": 3, "hidden_size": three.model.arch.hidden_size})
    assert validate(cfg_in(other, "trainer.resume=auto")) == []
    errs = validate(cfg_in(other, "trainer.resume=auto", "model.arch.num_layers=5"))
    assert len(errs) == 1 and errs[0].startswith("model.arch.num_layers: 5 but ") and "num_hidden_layers=3" in errs[0]


def test_a_new_run_is_refused_where_an_earlier_run_left_checkpoints(tmp_path):
    run = tmp_path / "run"
    save(run, 50)
    save(run, 100)
    errs = validate(cfg_in(run))
    assert len(errs) == 1 and errs[0].startswith(
        f"trainer.resume: not set (a new run), but the run directory {run} holds checkpoints of an earlier run "
        "(step_000050 .. step_000100"), errs
    assert "trainer.resume=auto" in errs[0] and "hydra.run.dir" in errs[0]
    assert validate(cfg_in(run, "trainer.resume=auto", "trainer.num_rollout=200")) == []
    assert validate(cfg_in(tmp_path / "new")) == []  # nothing saved there: a new run

    # resuming another run's checkpoint into it is refused the same way; into a new run dir it is not
    other = tmp_path / "other"
    save(other, 20)
    errs = validate(cfg_in(run, f"trainer.resume={other}"))
    assert len(errs) == 1 and errs[0].startswith(f"trainer.resume: {str(other)!r}, another run's checkpoint, but"), errs
    assert validate(cfg_in(tmp_path / "new", f"trainer.resume={other}")) == []

    # resuming an older checkpoint of its own, with newer ones beside it
    older = run / "checkpoints" / "step_000050"
    errs = validate(cfg_in(run, f"trainer.resume={older}", "trainer.num_rollout=200"))
    assert len(errs) == 1 and "also holds the newer step_000100" in errs[0], errs


def test_missing_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    save(tmp_path, 10)
    save(tmp_path, 20)
    os.remove(tmp_path / "checkpoints" / "latest")  # deleted by hand
    assert find_checkpoint("auto", str(tmp_path)) == str(tmp_path / "checkpoints" / "step_000020")


def test_a_save_killed_before_it_named_latest_resumes_from_the_newer_checkpoint(tmp_path):
    """A save renames step_N into place, then rewrites ``latest``; killed between the two, ``latest`` names the
    checkpoint before, and the newer one is complete: resume=auto takes it (and validation lets it)."""
    save(tmp_path, 2)
    save(tmp_path, 4)
    (tmp_path / "checkpoints" / "latest").write_text("step_000002")
    assert find_checkpoint("auto", str(tmp_path)) == str(tmp_path / "checkpoints" / "step_000004")
    validate(cfg_in(tmp_path, "trainer.resume=auto", "trainer.num_rollout=10"))
