"""Draws the figures of docs/architecture.md into docs/img/ (``make docs``; matplotlib only).

    python docs/diagrams.py [--out DIR]

- ``step_dataflow.png``: what runs once and what runs every step, with the file and function of each part.
- ``weight_sync.png``: the three weight transports, from the trainer to the engines.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("step_dataflow.png", "weight_sync.png")

SETUP, ROLLOUT, TRAIN, SYNC, REST = "#dfe7f2", "#cde8d3", "#f6dcc3", "#e6d5f0", "#eeeeee"


# ------------------------------------------------------------------------------------------ drawing
def box(ax, x: float, y: float, w: float, h: float, title: str, sub: str = "", color: str = SETUP) -> None:
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="#555555",
                                lw=1.0))
    if sub:
        ax.text(x + w / 2, y + h * 0.66, title, ha="center", va="center", fontsize=9.5, weight="bold")
        ax.text(x + w / 2, y + h * 0.3, sub, ha="center", va="center", fontsize=7.5, family="monospace",
                color="#333333")
    else:
        ax.text(x + w / 2, y + h / 2, title, ha="center", va="center", fontsize=9.5, weight="bold")


def arrow(ax, a: Tuple[float, float], b: Tuple[float, float], label: str = "", rad: float = 0.0,
          offset: Tuple[float, float] = (0.0, 0.12)) -> None:
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=12, lw=1.1, color="#333333",
                                 connectionstyle=f"arc3,rad={rad}"))
    if label:
        ax.text((a[0] + b[0]) / 2 + offset[0], (a[1] + b[1]) / 2 + offset[1], label, ha="center", va="bottom",
                fontsize=7.5, style="italic", color="#222222")


def canvas(w: float, h: float, size: Tuple[float, float]):
    fig = plt.figure(figsize=size)
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, w)
    ax.set_ylim(0, h)
    ax.axis("off")
    return fig, ax


# ------------------------------------------------------------------------------------------ figures
def step_dataflow(out: Path) -> None:
    fig, ax = canvas(16, 9.4, (13, 7.6))
    ax.text(0.2, 9.2, "Once per run (launch/main.py run, launch/loop.py train)", fontsize=11, weight="bold", va="top")
    setup = [
        ("config", "conf/ + config/schema.py\nlaunch/validate.py check()"),
        ("plan", "plan/resources.py\nmake_plan() -> ResourcePlan"),
        ("placement group", "launch/cluster.py\ncreate_placement_group()"),
        ("actors", "RolloutManager (no GPU)\nTrainerGroup -> TrainerActor"),
        ("first weight push", "sync/push.py\npush_weights(v0)"),
    ]
    for i, (title, sub) in enumerate(setup):
        x = 0.2 + i * 3.2
        box(ax, x, 7.2, 2.8, 1.4, title, sub)
        if i:
            arrow(ax, (x - 0.4, 7.9), (x, 7.9))

    ax.text(0.2, 6.6, "Every step (launch/loop.py steps)", fontsize=11, weight="bold", va="top")
    top, low, h = 3.9, 0.5, 2.0
    box(ax, 0.2, top, 3.6, h, "RolloutManager.generate", "rollout/manager.py\nrollout_fn.py default_rollout\n"
        "data source, filters", ROLLOUT)
    box(ax, 4.4, top, 3.8, h, "rewards", "rewards/hub.py compute_reward\n(reward.type, reward.custom),\n"
        "called by sampling.py GroupSampler", ROLLOUT)
    box(ax, 8.8, top, 3.4, h, "training data", "rollout/train_data.py\ntrain_data: group-normalised\n"
        "split_by_rank: one ray.put each", ROLLOUT)
    box(ax, 12.8, top, 3.0, h, "trainers", "TrainerGroup.train\nRLTrainer.train\n(train/trainer.py)\n"
        "backend: torch | megatron", TRAIN)
    box(ax, 0.2, low, 3.6, h, "generate", "rollout/generate.py\nrollout/client.py\n(or rollout.generate)", ROLLOUT)
    box(ax, 4.4, low, 3.8, h, "sglang-router", "rollout/router.py\n(rollout.router)", ROLLOUT)
    box(ax, 8.8, low, 3.4, h, "engines", "EngineActor -> server process\nSGLang or embedded\nrollout/engines/actor.py",
        ROLLOUT)
    box(ax, 12.8, low, 3.0, h, "weight sync", "sync/push.py ->\nWeightSender.push\n(sync/sender.py)\n"
        "tensor|distributed|disk", SYNC)

    arrow(ax, (2.0, top), (2.0, low + h), "each sample", offset=(0.6, -0.1))
    ax.add_patch(FancyArrowPatch((3.8, 1.5), (4.4, 1.5), arrowstyle="<|-|>", mutation_scale=12, lw=1.1))
    ax.add_patch(FancyArrowPatch((8.2, 1.5), (8.8, 1.5), arrowstyle="<|-|>", mutation_scale=12, lw=1.1))
    ax.text(6.3, 0.15, "POST /generate: token ids, sampling params -> tokens, log-probs", ha="center", fontsize=7.5,
            style="italic")
    arrow(ax, (3.8, 5.1), (4.4, 5.1), "samples", offset=(0, 0.08))
    arrow(ax, (8.2, 5.1), (8.8, 5.1), "rewards", offset=(0, 0.08))
    arrow(ax, (12.2, 5.1), (12.8, 5.1), "refs", offset=(0, 0.08))
    arrow(ax, (14.3, top), (14.3, low + h), "after train", offset=(0.7, -0.1))
    arrow(ax, (12.8, 1.5), (12.2, 1.5), "")
    ax.text(8.2, 3.05, "colocated: the engines release their memory before train, and take it back in the push\n"
            "async: generate(step + 1) runs while the trainers train on step", fontsize=7.5, ha="center",
            color="#444444")
    fig.savefig(out, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def weight_sync(out: Path) -> None:
    fig = plt.figure(figsize=(12, 5.2))
    ax = fig.add_axes([0.0, 0.0, 1.0, 1.0])
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 10)
    ax.axis("off")
    rows = [
        ("tensor  (colocated: the same GPU)", "CUDA IPC handle", "one flattened bucket on the GPU,\nserialized handle",
         "POST /update_weights_from_tensor\nthe engine maps the trainer's memory"),
        ("distributed  (split: other GPUs)", "NCCL broadcast", "a group of trainer rank 0\n+ every engine GPU",
         "POST /update_weights_from_distributed\n+ one broadcast per bucket"),
        ("disk  (any placement, shared filesystem across nodes)", "safetensors files",
         "<run dir>/weight_sync/\nweights_vN/model.safetensors",
         "POST /update_weights_from_disk\nthe engine reads them"),
    ]
    for i, (name, mid, mid_sub, end) in enumerate(rows):
        y = 7.3 - i * 3.1
        ax.text(0.2, y + 1.75, name, fontsize=10, weight="bold")
        box(ax, 0.2, y, 3.0, 1.4, "trainer", "hf_weights()\nWeightSender.push", TRAIN)
        box(ax, 4.1, y, 3.4, 1.4, mid, mid_sub, SYNC)
        box(ax, 8.4, y, 3.4, 1.4, "engines", end, ROLLOUT)
        arrow(ax, (3.2, y + 0.7), (4.1, y + 0.7))
        arrow(ax, (7.5, y + 0.7), (8.4, y + 0.7))
    ax.text(0.2, 0.3, "every push (slime_hydra/sync/sender.py WeightSender.push): /pause_generation, /flush_cache, "
            "the buckets (sync.bucket_mb),\nthen every engine must report the new version in /model_info, "
            "/continue_generation", fontsize=8, color="#444444")

    fig.savefig(out, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def render(out_dir: Path) -> List[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in FIGURES]
    for draw, path in zip((step_dataflow, weight_sync), paths):
        draw(path)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the PNG files go")
    for path in render(p.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
