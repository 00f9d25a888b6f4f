"""Stages in one experiment (``stages: [{name, overrides}, ...]``, e.g. SFT then GRPO): each stage is a whole
run, composed by Hydra from this job's own overrides plus its stage's (a stage's ``algo=sft`` picks a preset;
the command line's keys win, so a sweep or a quick ``trainer.num_rollout=4`` applies to every stage), written to
``<run dir>/<k>_<name>/``. Every stage's resolved config is printed and validated before the first starts; a
stage after the first starts from the previous stage's final checkpoint (``model.path``). With
``trainer.resume=auto`` a finished stage (its ``summary.json``) is skipped and the one that stopped resumes; a
finished stage given more steps goes on while no later stage has started, else the change is refused.
The run directory's ``summary.json`` is the last stage's, with every stage's under ``stages``."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from slime_hydra.checkpoint.ckpt import ckpt_root, complete_checkpoints
from slime_hydra.config import ConfigError
from slime_hydra.launch.main import run
from slime_hydra.launch.validate import check

log = logging.getLogger("slime_hydra")


def stage_configs(dcfg: DictConfig, output_dir: str, job_overrides: List[str]) -> List[Tuple[str, DictConfig]]:
    """(stage directory, composed config) per stage, in order; a later stage's ``model.path`` stays the
    composed one here (the previous stage's checkpoint does not exist yet)."""
    from hydra import compose

    out = []
    for k, stage in enumerate(dcfg.stages):
        overrides = list(stage.overrides) + [o for o in job_overrides if not o.startswith("stages")] + ["stages=[]"]
        cfg = compose(config_name="config", overrides=overrides)
        out.append((os.path.join(output_dir, f"{k}_{stage.name}"), cfg))
    return out


def run_stages(dcfg: DictConfig, output_dir: str, job_overrides: List[str]) -> Optional[Dict[str, Any]]:
    """Every stage in turn; the last stage's summary (a sweep's objective)."""
    stages = stage_configs(dcfg, output_dir, job_overrides)
    problems = []
    for k, (stage_dir, cfg) in enumerate(stages):
        print(f"# stage {k}: {os.path.basename(stage_dir)}"
              f"{'' if k == 0 else ' (model.path: the previous stage final checkpoint)'}\n{OmegaConf.to_yaml(cfg)}")
        cfg.output_dir = stage_dir
        try:
            check(cfg.copy())
        except ConfigError as e:
            problems += [f"stage {k} ({os.path.basename(stage_dir)}): {p}" for p in e.violations]
        problems += changed_since_done(k, stages)
    if problems:
        log.error("%s", ConfigError(problems))
        raise SystemExit(2)
    if dcfg.dry_run:
        print(f"every stage's config is valid ({len(stages)} stages; dry_run=true: nothing started)")
        return None
    for k, (stage_dir, cfg) in enumerate(stages):
        if k:
            cfg.model.path = final_checkpoint(stages[k - 1][0])
        done = steps_done(stage_dir) if cfg.trainer.resume == "auto" else None
        if done is not None and done == (cfg.trainer.num_rollout or done):
            log.info("stage %d (%s) is done; next", k, os.path.basename(stage_dir))
            continue
        if done is not None:  # more steps asked of the last stage that ran: it goes on from its last checkpoint
            log.info("stage %d (%s) finished %d steps; trainer.num_rollout=%d: going on", k,
                     os.path.basename(stage_dir), done, cfg.trainer.num_rollout)
        log.info("stage %d of %d: %s", k + 1, len(stages), os.path.basename(stage_dir))
        run(cfg, stage_dir)
    # the run directory's summary.json (what a sweep reads): the last stage's, and every stage's under "stages"
    each = {os.path.basename(d): json.loads(Path(d, "summary.json").read_text()) for d, _ in stages}
    summary = {**each[os.path.basename(stages[-1][0])], "stages": each}
    with open(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def steps_done(stage_dir: str) -> Optional[int]:
    """A finished stage's step count (its ``summary.json``), or None."""
    summary = Path(stage_dir, "summary.json")
    return json.loads(summary.read_text())["steps"] if summary.exists() else None


def changed_since_done(k: int, stages: List[Tuple[str, DictConfig]]) -> List[str]:
    """``trainer.resume=auto`` and a finished stage asked for another step count: more steps with no later
    stage started go on from its last checkpoint; else refused (the later stages started from its result, or
    fewer steps than it trained), never skipped silently."""
    stage_dir, cfg = stages[k]
    done, want = steps_done(stage_dir), cfg.trainer.num_rollout
    if cfg.trainer.resume != "auto" or done is None or want is None or done == want:
        return []
    later = [os.path.basename(d) for d, _ in stages[k + 1:] if os.path.isdir(d)]
    if want > done and not later:
        return []
    why = f"the stages after it ({', '.join(later)}) started from that result" if later else \
        "a finished stage cannot be shortened"
    return [f"stage {k} ({os.path.basename(stage_dir)}): trainer.num_rollout={want}, but this stage finished {done} "
            f"steps in {stage_dir} and {why}; resume with trainer.num_rollout={done} for this stage, or run the "
            "changed experiment in a new run directory (hydra.run.dir)"]


def final_checkpoint(stage_dir: str) -> str:
    """The Hugging Face weights of a finished stage's last checkpoint."""
    ckpts = complete_checkpoints(stage_dir)
    hf = os.path.join(ckpt_root(stage_dir), ckpts[-1], "hf") if ckpts else None
    if hf is None or not os.path.isdir(hf):
        raise RuntimeError(f"{stage_dir}: no checkpoint with hf/ weights for the next stage to start from "
                           "(keep trainer.save_last=true; with LoRA set trainer.lora.save_merged=true)")
    return hf
