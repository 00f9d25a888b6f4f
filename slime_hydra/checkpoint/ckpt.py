"""Run checkpoints: ``<run dir>/checkpoints/step_000050/{hf/, trainer.pt, data_state.json, meta.json}``.

Crash-safe: written into ``step_N.tmp``, flushed, renamed to ``step_N`` (``meta.json``, written last, marks it
complete), then ``checkpoints/latest`` replaced atomically. ``SLIME_HYDRA_TEST_PAUSE_IN_SAVE=<step>:<seconds>``
pauses a save so a test can kill the run inside it (tests/launch/test_kill_resume.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Any, Callable, Dict, List, Optional

from slime_hydra.logging.metrics import write_json_atomic

log = logging.getLogger(__name__)
PAUSE_ENV = "SLIME_HYDRA_TEST_PAUSE_IN_SAVE"


def ckpt_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def save_checkpoint(run_dir: str, step: int, write: Callable[[str], None], data_state: Dict[str, Any],
                    keep: int) -> str:
    root = ckpt_root(run_dir)
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp)  # trainer: hf/ and trainer.pt
    write_json_atomic(os.path.join(tmp, "data_state.json"), data_state)
    pause_step, _, seconds = os.environ.get(PAUSE_ENV, "").partition(":")
    if pause_step and int(pause_step) == step:
        open(os.path.join(tmp, "PAUSED"), "w").close()
        time.sleep(float(seconds))
        os.remove(os.path.join(tmp, "PAUSED"))
    write_json_atomic(os.path.join(tmp, "meta.json"), {"step": step, "time": time.time()})
    _fsync_tree(tmp)
    if os.path.exists(final):  # saved before by a run that was killed before it named it latest
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    latest = os.path.basename(final)
    _write_atomic(os.path.join(root, "latest"), latest)
    for old in complete_checkpoints(run_dir)[:-keep]:
        if old != latest:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def complete_checkpoints(run_dir: str) -> List[str]:
    """Names of the complete checkpoints (those with meta.json), oldest first."""
    root = ckpt_root(run_dir)
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root)
                  if d.startswith("step_") and not d.endswith(".tmp")
                  and os.path.exists(os.path.join(root, d, "meta.json")))


def remove_partial(run_dir: str) -> List[str]:
    """Delete the half-written checkpoints (``step_N.tmp``) of a run that was killed while saving."""
    root = ckpt_root(run_dir)
    partial = [d for d in os.listdir(root) if d.endswith(".tmp")] if os.path.isdir(root) else []
    for d in partial:
        path = os.path.join(root, d)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    return partial


def find_checkpoint(resume: str, run_dir: str) -> Optional[str]:
    """``resume``: "auto" (this run dir's latest, if any), a checkpoint dir, or a run dir. Where ``latest`` is
    gone or names a checkpoint that is gone, incomplete or older than another complete one, the newest
    complete one is taken."""
    base = run_dir if resume == "auto" else os.path.expanduser(resume)
    if os.path.exists(os.path.join(base, "meta.json")):
        return base
    latest = os.path.join(ckpt_root(base), "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            named = os.path.join(ckpt_root(base), f.read().strip())
        done = complete_checkpoints(base)
        if os.path.exists(os.path.join(named, "meta.json")):
            if done and done[-1] != os.path.basename(named):  # a save killed between its rename and `latest`
                log.warning("checkpoints/latest names %s, but the newer %s is complete; taking it", named, done[-1])
                return os.path.join(ckpt_root(base), done[-1])
            return named
        if done:
            log.warning("checkpoints/latest names %s, which is incomplete; taking the newest complete checkpoint, %s",
                        named, done[-1])
            return os.path.join(ckpt_root(base), done[-1])
        if resume == "auto":
            raise FileNotFoundError(f"trainer.resume=auto: checkpoints/latest names {named}, which has no meta.json "
                                    "(an incomplete or deleted checkpoint), and no complete checkpoint is left")
        return named  # config validation names it
    done = complete_checkpoints(base)
    if done:
        log.warning("%s is missing; taking the newest complete checkpoint, %s", latest, done[-1])
        return os.path.join(ckpt_root(base), done[-1])
    if resume == "auto":
        return None
    raise FileNotFoundError(f"trainer.resume: {resume!r} holds no checkpoint (no meta.json, no checkpoints/latest)")


def in_run_dir(ckpt: str, run_dir: str) -> bool:
    """Whether the checkpoint directory ``ckpt`` is one of ``run_dir``'s own."""
    root = os.path.realpath(ckpt_root(run_dir))
    return os.path.realpath(os.path.expanduser(ckpt)).startswith(root + os.sep)


def resumes_in_run_dir(resume: Optional[str], run_dir: str) -> bool:
    """Whether ``trainer.resume`` picks one of ``run_dir``'s own checkpoints (the run goes on with its model)."""
    if not resume:
        return False
    try:
        ckpt = find_checkpoint(resume, run_dir)
    except FileNotFoundError:
        return False
    return ckpt is not None and in_run_dir(ckpt, run_dir)


def read_checkpoint(path: str) -> Dict[str, Any]:
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(path, "data_state.json")) as f:
        meta["data_state"] = json.load(f)
    return meta


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(os.path.dirname(path))


def _fsync_tree(top: str) -> None:
    """Flush every file and directory under ``top``: the publishing rename never reaches the disk first."""
    for dirpath, _, files in os.walk(top):
        for name in files:
            _fsync(os.path.join(dirpath, name))
        _fsync(dirpath)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
