"""Run checkpoints are published atomically (slime_hydra/checkpoint/ckpt.py): a save that dies half
way leaves the previous checkpoint as ``latest``; resume finds the newest complete one."""

from __future__ import annotations

import os

import pytest

from slime_hydra.checkpoint.ckpt import (
    complete_checkpoints,
    find_checkpoint,
    read_checkpoint,
    remove_partial,
    save_checkpoint,
)


def trainer_files(d: str) -> None:
    os.makedirs(os.path.join(d, "hf"))
    with open(os.path.join(d, "trainer.pt"), "w") as f:
        f.write("weights")


def test_save_publishes_a_complete_checkpoint_and_keeps_the_newest(tmp_path):
    run = str(tmp_path)
    for step in (2, 4, 6):
        save_checkpoint(run, step, trainer_files, {"offset": step * 4}, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000004", "step_000006"]
    assert (root / "latest").read_text() == "step_000006"
    ckpt = find_checkpoint("auto", run)
    assert ckpt == str(root / "step_000006")
    meta = read_checkpoint(ckpt)
    assert meta["step"] == 6 and meta["data_state"] == {"offset": 24}


def test_a_save_that_dies_leaves_the_previous_checkpoint(tmp_path):
    run = str(tmp_path)
    save_checkpoint(run, 2, trainer_files, {"offset": 8}, keep=2)

    def dies(d):
        trainer_files(d)
        raise KeyboardInterrupt  # the process stops in the middle of the trainer's write

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(run, 4, dies, {"offset": 16}, keep=2)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step_000002"
    assert find_checkpoint("auto", run) == str(root / "step_000002")
    assert complete_checkpoints(run) == ["step_000002"]
    assert remove_partial(run) == ["step_000004.tmp"] and not (root / "step_000004.tmp").exists()
    save_checkpoint(run, 4, trainer_files, {"offset": 16}, keep=2)  # the resumed run saves step 4 again
    assert (root / "latest").read_text() == "step_000004"


def test_latest_naming_a_missing_checkpoint_falls_back_to_the_newest_complete_one(tmp_path):
    run = str(tmp_path)
    save_checkpoint(run, 2, trainer_files, {}, keep=3)
    save_checkpoint(run, 4, trainer_files, {}, keep=3)
    os.remove(tmp_path / "checkpoints" / "step_000004" / "meta.json")  # a checkpoint deleted by hand, in part
    assert find_checkpoint("auto", run) == str(tmp_path / "checkpoints" / "step_000002")
    os.remove(tmp_path / "checkpoints" / "step_000002" / "meta.json")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint is left"):
        find_checkpoint("auto", run)
    assert find_checkpoint("auto", str(tmp_path / "empty")) is None
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        find_checkpoint(str(tmp_path / "empty"), run)
