"""Run checkpoints: ``<run dir>/checkpoints/step_000050/{hf/, trainer.pt, data_state.json, meta.json}``.

A checkpoint is written into ``step_N.tmp`` and renamed when complete, then ``checkpoints/latest``
is replaced atomically; an interrupted save leaves the previous checkpoint as the latest one."""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Callable, Dict, Optional

from slime_hydra.logging.metrics import write_json_atomic


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
    write_json_atomic(os.path.join(tmp, "meta.json"), {"step": step, "time": time.time()})
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    with open(os.path.join(root, "latest.tmp"), "w") as f:
        f.write(os.path.basename(final))
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    done = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def find_checkpoint(resume: str, run_dir: str) -> Optional[str]:
    """``resume``: "auto" (this run dir's latest, if any), a checkpoint dir, or a run dir."""
    base = run_dir if resume == "auto" else os.path.expanduser(resume)
    if os.path.exists(os.path.join(base, "meta.json")):
        return base
    latest = os.path.join(ckpt_root(base), "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            return os.path.join(ckpt_root(base), f.read().strip())
    if resume == "auto":
        return None
    raise FileNotFoundError(f"trainer.resume: {resume!r} holds no checkpoint (no meta.json, no checkpoints/latest)")


def read_checkpoint(path: str) -> Dict[str, Any]:
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(path, "data_state.json")) as f:
        meta["data_state"] = json.load(f)
    return meta
