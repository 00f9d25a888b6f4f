"""Where metrics go: ``metrics.jsonl`` (a JSON object per step), wandb, a tqdm progress bar, and at the end
``summary.json`` and ``reward_curve.png``."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import uuid
from typing import Any, Dict, List, Optional

from tqdm import tqdm

log = logging.getLogger(__name__)


def write_atomic(path: str, text: str) -> None:
    """``path`` holds ``text``, written whole or not at all."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write_json_atomic(path: str, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2))


def wandb_run_id(run_dir: str, resuming: bool) -> "tuple[str, Optional[str]]":
    """(run id, wandb's resume mode): a resumed run continues the wandb run whose id the run directory keeps."""
    path = os.path.join(run_dir, "wandb_run_id")
    if resuming and os.path.exists(path):
        with open(path) as f:
            return f.read().strip(), "allow"
    run_id = uuid.uuid4().hex[:8]  # wandb's own ids are 8 characters of [a-z0-9]
    write_atomic(path, run_id)
    return run_id, None


class RunLogger:
    """``keep_until``: resuming from the checkpoint of that step, the rows of metrics.jsonl after it are
    dropped (they will be written again); None: a new run, all old rows are dropped."""

    def __init__(self, cfg, total_steps: int, start_step: int = 0, keep_until: Optional[int] = None):
        self.cfg, self.dir = cfg, cfg.output_dir
        self.path = os.path.join(self.dir, "metrics.jsonl")
        self.history: List[Dict[str, Any]] = []
        if os.path.exists(self.path):  # resuming in the same run directory
            with open(self.path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            self.history = [r for r in rows if keep_until is not None and r.get("step", -1) <= keep_until]
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.history))
        self.file, self.wandb = open(self.path, "a"), None
        mode = cfg.logging.wandb_mode if cfg.logging.wandb else "disabled"
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if mode != "disabled":
            import wandb

            from slime_hydra.logging.secrets import redacted_config

            os.environ.setdefault("WANDB_SILENT", "true")
            run_id, resume = wandb_run_id(self.dir, resuming=cfg.trainer.resume is not None)
            self.wandb = wandb.init(project=cfg.logging.wandb_project, entity=cfg.logging.wandb_entity,
                                    name=cfg.run_name, group=cfg.logging.wandb_group, dir=self.dir, mode=mode,
                                    tags=list(cfg.logging.wandb_tags), config=redacted_config(cfg), id=run_id,
                                    resume=resume)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        disable=not cfg.logging.progress)

    def log(self, step: int, metrics: Dict[str, Any]) -> None:
        row = {"step": step,
               **{k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}}
        self.history.append(row)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(row, step=step)

    def rewind(self, step: int) -> None:
        """The run goes back to the checkpoint of ``step`` (healing): the rows after it are dropped and will be
        written again (wandb keeps its own: it takes no step twice)."""
        self.history = [r for r in self.history if r.get("step", -1) <= step]
        self.file.close()
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.history))
        self.file = open(self.path, "a")
        self.bar.n = step
        self.bar.refresh()

    def progress(self, metrics: Dict[str, Any]) -> None:
        post = {"reward": metrics.get("rollout/reward_mean"), "step_s": metrics.get("perf/step_time"),
                "eval": next((v for k, v in metrics.items() if k.startswith("eval/") and k.endswith("/reward")), None)}
        self.bar.set_postfix({k: f"{v:.3f}" for k, v in post.items() if v is not None}, refresh=False)
        self.bar.update(1)

    def write(self, msg: str) -> None:
        """A log line that does not break the progress bar."""
        if self.bar.disable:
            log.info(msg)
        else:
            self.bar.write(msg)
            logging.getLogger("slime_hydra.run").debug(msg)

    def finish(self, summary: Dict[str, Any]) -> None:
        """The end of a completed run: summary.json, the reward curve, the wandb summary."""
        write_json_atomic(os.path.join(self.dir, "summary.json"), summary)
        if self.cfg.logging.plot and self.history:
            plot_rewards(self.history, os.path.join(self.dir, "reward_curve.png"), self.cfg.run_name)
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
        self.close()

    def close(self) -> None:
        """Release the file, the bar and the wandb run (also after an error or Ctrl-C)."""
        if self.file.closed:
            return
        self.bar.close()
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=0 if sys.exc_info()[0] is None else 1)


def plot_rewards(history: List[Dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["rollout/reward_mean"]) for r in history if "rollout/reward_mean" in r]
    if train:
        ax.plot(*zip(*train), label="train reward (sampled)", color="tab:blue", alpha=0.8)
    for key in sorted({k for r in history for k in r if k.startswith("eval/") and k.endswith("/reward")}):
        pts = [(r["step"], r[key]) for r in history if key in r and not math.isnan(r[key])]
        ax.plot(*zip(*pts), "o-", label=key.removeprefix("eval/").removesuffix("/reward") + " (eval)")
    ax.set(xlabel="step", ylabel="reward", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=120)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
