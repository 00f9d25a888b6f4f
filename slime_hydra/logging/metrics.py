"""Where metrics go: ``metrics.jsonl`` (a JSON object per step), the trackers of ``logging.backends``
(trackers.py), a tqdm progress bar, and at the end ``summary.json`` and ``reward_curve.png``."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
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
        from slime_hydra.logging.trackers import open_trackers

        self.file = open(self.path, "a")
        self.trackers = open_trackers(cfg)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        disable=not cfg.logging.progress)

    def log(self, step: int, metrics: Dict[str, Any]) -> None:
        row = {"step": step,
               **{k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}}
        self.history.append(row)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        for tracker in self.trackers:
            tracker.log(step, row)

    def rewind(self, step: int) -> None:
        """The run goes back to the checkpoint of ``step`` (healing): the rows after it are dropped and will be
        written again (the trackers keep theirs: wandb takes no step twice)."""
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
        """The end of a completed run: summary.json, the reward curve, the trackers' summaries."""
        write_json_atomic(os.path.join(self.dir, "summary.json"), summary)
        if self.cfg.logging.plot and self.history:
            plot_rewards(self.history, os.path.join(self.dir, "reward_curve.png"), self.cfg.run_name)
        for tracker in self.trackers:
            tracker.finish(summary, self.dir)
        self.close()

    def close(self) -> None:
        """Release the file, the bar and the trackers (also after an error or Ctrl-C)."""
        if self.file.closed:
            return
        self.bar.close()
        self.file.close()
        for tracker in self.trackers:
            tracker.close(failed=sys.exc_info()[0] is not None)


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
