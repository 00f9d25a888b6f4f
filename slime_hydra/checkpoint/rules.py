"""Config rules of the run checkpoints (:mod:`slime_hydra.checkpoint.ckpt`): what ``trainer.resume``
picks exists, is complete and was saved by this run's model and settings."""

from __future__ import annotations

import json
import os
from typing import List

from slime_hydra.config.schema import RunConfig
from slime_hydra.model.hf import fingerprint_diff, read_fingerprint
from slime_hydra.model.rules import compare_arch_with

# an FSDP2 checkpoint's shards (slime_hydra.train.backends.torch.fsdp.DCP_DIR; that module imports torch)
FSDP_DIR = "dcp"


def check(cfg: RunConfig) -> List[str]:
    errs: List[str] = []
    t = cfg.trainer
    if t.keep_checkpoints < 1:
        errs.append(f"trainer.keep_checkpoints: must be >= 1, got {t.keep_checkpoints}")
    if t.resume is not None:
        errs.extend(_check_resume(t.resume, cfg.output_dir, t.num_rollout, cfg))
    errs.extend(_check_run_dir(cfg))
    return errs


def _check_run_dir(cfg: RunConfig) -> List[str]:
    """A run directory's checkpoints are all of one run, with one model (pruning and ``resume=auto`` take them
    all for the run's own): a run that does not continue them is refused, and one that does must have the
    model they were trained from (``initial_model/``'s fingerprint, else the checkpoint's ``hf/config.json``)."""
    from slime_hydra.checkpoint.ckpt import ckpt_root, complete_checkpoints, find_checkpoint, in_run_dir

    run_dir, resume = cfg.output_dir, cfg.trainer.resume
    if not run_dir:
        return []  # Hydra's, known when the run starts (launch/main.py); a sweep's jobs are checked then
    try:
        ckpt = find_checkpoint(resume, run_dir) if resume else None
    except FileNotFoundError:
        return []  # _check_resume says so
    if ckpt is not None and not os.path.isfile(os.path.join(ckpt, "meta.json")):
        return []  # _check_resume says so
    done = complete_checkpoints(run_dir)
    ours = ckpt is not None and in_run_dir(ckpt, run_dir)
    if done and not ours:
        held = f"{done[0]}" if len(done) == 1 else f"{done[0]} .. {done[-1]}"
        what = ("not set (a new run)" if not resume else f"{resume!r}, another run's checkpoint" if ckpt else
                f"{resume!r} with nothing saved")
        return [f"trainer.resume: {what}, but the run directory {run_dir} holds checkpoints of an earlier run "
                f"({held} in {ckpt_root(run_dir)}), which this run would count toward trainer.keep_checkpoints "
                "and could resume from: continue that run with trainer.resume=auto, or start this one in a new "
                "hydra.run.dir (or move that checkpoints/ away)"]
    if ours and done and os.path.basename(os.path.normpath(ckpt)) != done[-1]:
        return [f"trainer.resume: {resume!r} picks {ckpt}, but {ckpt_root(run_dir)} also holds the newer {done[-1]}, "
                "which this run would count toward trainer.keep_checkpoints and could resume from: resume from "
                "the newest (trainer.resume=auto), or resume into a new hydra.run.dir"]
    if ckpt is None:
        return []
    recorded = read_fingerprint(os.path.join(run_dir, "initial_model")) if ours and cfg.model.path is None else None
    if recorded is not None:
        diff = fingerprint_diff(cfg.model, recorded)
    else:
        hf = os.path.join(ckpt, "hf", "config.json")
        diff = compare_arch_with(cfg.model.arch, hf) if os.path.isfile(hf) else []
    return [f"{line}; trainer.resume={resume!r} continues {ckpt}, trained from that model: restore the "
            "setting, or start a new run in a new hydra.run.dir" for line in diff]


def _check_resume(resume: str, run_dir: str | None, num_rollout: int | None,
                  cfg: RunConfig | None = None) -> List[str]:
    """The checkpoint ``find_checkpoint`` will pick for ``trainer.resume`` exists, is complete, is not past
    ``trainer.num_rollout`` and (with ``cfg``) was saved with this run's settings (:func:`_check_saved_with`)."""
    from slime_hydra.checkpoint.ckpt import find_checkpoint

    if resume == "auto" and not run_dir:
        return []  # the run directory is Hydra's, set when the run starts (launch/main.py)
    if resume != "auto" and not os.path.isdir(os.path.expanduser(resume)):
        return [f"trainer.resume: {resume!r} is not a directory (a checkpoint, a run directory, or 'auto')"]
    try:
        ckpt = find_checkpoint(resume, run_dir or "")
    except FileNotFoundError as e:
        return [str(e)]  # "trainer.resume: '<path>' holds no checkpoint (no meta.json, no checkpoints/latest)"
    if ckpt is None:
        return []  # auto, and nothing saved yet: a fresh start
    if not os.path.isfile(os.path.join(ckpt, "meta.json")):
        return [f"trainer.resume: {resume!r} names {ckpt!r} in checkpoints/latest, which has no meta.json "
                "(an incomplete or deleted checkpoint)"]
    with open(os.path.join(ckpt, "meta.json")) as f:
        step = json.load(f).get("step")
    if num_rollout is not None and isinstance(step, int) and step > num_rollout:
        return [f"trainer.num_rollout: {num_rollout} is below step {step} of the checkpoint that "
                f"trainer.resume={resume!r} resumes from ({ckpt}); raise trainer.num_rollout to train on from it"]
    return _check_saved_with(ckpt, cfg) if cfg is not None else []


def _check_saved_with(ckpt: str, cfg: RunConfig) -> List[str]:
    """A torch backend checkpoint resumes only under the settings that shape what it holds: ``trainer.strategy``
    (``dcp/`` or ``hf/`` + ``trainer.pt``), ``trainer.lora.*`` (``adapter/``) and the PPO critic (``critic.pt``);
    checked before Ray starts, since the backend's load would fail late or (LoRA alpha) not at all."""
    from slime_hydra.train import algorithms as A
    from slime_hydra.train.backends.torch.lora import ADAPTER_DIR, target_modules

    t = cfg.trainer
    if t.backend != "torch" or not os.path.isfile(os.path.join(ckpt, "trainer.pt")):
        return []  # megatron's is megatron/ (its load checks the layout); no trainer.pt: nothing saved by a backend
    errs: List[str] = []
    saved_strategy = "fsdp" if os.path.isdir(os.path.join(ckpt, FSDP_DIR)) else "ddp"
    if saved_strategy != t.strategy:
        held = ("its weights and AdamW state are in dcp/, which ddp does not read" if saved_strategy == "fsdp"
                else "it has no dcp/ for fsdp to load")
        errs.append(f"trainer.strategy: {t.strategy!r} but the checkpoint {ckpt} was saved with "
                    f"trainer.strategy={saved_strategy!r} ({held}); resume it with "
                    f"trainer.strategy={saved_strategy}, or start a new run from its weights with model.path")
    lora, adapter = t.lora, os.path.join(ckpt, ADAPTER_DIR)
    config_path = os.path.join(adapter, "adapter_config.json")
    if os.path.isdir(adapter) and not lora.rank:
        errs.append(f"trainer.lora.rank: 0 but the checkpoint {ckpt} was saved with LoRA (it has {ADAPTER_DIR}/"
                    f"{_saved_lora(config_path)}); resume it with the trainer.lora.* it was saved with")
    elif lora.rank and not os.path.isdir(adapter):
        errs.append(f"trainer.lora.rank: {lora.rank} but the checkpoint {ckpt} was saved without LoRA (it has no "
                    f"{ADAPTER_DIR}/); resume it with trainer.lora.rank=0, or start a new run from its weights with "
                    "model.path")
    elif lora.rank and os.path.isfile(config_path):
        with open(config_path) as f:
            saved = json.load(f)
        try:
            ours_targets = sorted(target_modules(lora, cfg.model.arch.type))
        except KeyError:  # an unknown model.arch.type: its own rule says so
            ours_targets = None
        ours = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": ours_targets}
        theirs = {"rank": saved.get("r"), "alpha": saved.get("lora_alpha"),
                  "target_modules": _names(saved.get("target_modules"))}
        names = {"rank": "r", "alpha": "lora_alpha", "target_modules": "target_modules"}
        for key in ours:
            if theirs[key] is not None and ours[key] is not None and ours[key] != theirs[key]:
                errs.append(f"trainer.lora.{key}: {ours[key]!r} but the checkpoint {ckpt} was saved with "
                            f"{names[key]}={theirs[key]!r} ({config_path}); resume it with "
                            f"trainer.lora.{key}={theirs[key]!r}")
    if A.needs_critic(cfg.algo) and not os.path.isfile(os.path.join(ckpt, "critic.pt")):
        errs.append(f"algo.advantage_estimator: 'ppo' trains a critic, but the checkpoint {ckpt} has no critic.pt "
                    "(it was saved by a run without one); resume it with the advantage_estimator it was saved with, "
                    "or start a new run from its weights with model.path")
    return errs


def _names(modules) -> List[str] | None:
    """PEFT's ``target_modules`` (a list, or one name or regex) as a sorted list; None when not written."""
    if modules is None:
        return None
    return sorted([modules] if isinstance(modules, str) else modules)


def _saved_lora(config_path: str) -> str:
    """`` with r=…, lora_alpha=…`` from a checkpoint's adapter_config.json, or nothing when it cannot be read."""
    try:
        with open(config_path) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return ""
    return f" with r={saved.get('r')!r}, lora_alpha={saved.get('lora_alpha')!r}"
