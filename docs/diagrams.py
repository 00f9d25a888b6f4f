"""Draws the figures of docs/architecture.md into docs/img/ (``make docs``; matplotlib only).

    python docs/diagrams.py [--out DIR]

- ``step_dataflow.png``: what runs once and what runs every step, with the file and function of each part.
- ``placement_timeline.png``: one H200 shared by the trainer and the engine (colocated, sync loop) against
  two H200s (split, async loop), drawn to scale from the step times measured on 2026-11-30 and 12-01
  (``bench/measured/h200_sglang_colocated_groups.json``, ``bench/measured/h200x2_sglang_split_async.json``).
- ``weight_sync.png``: the three weight transports and their measured cost per push, from the same files,
  the raw pushes of ``bench/measured/h200_sglang_colocated.json`` and ``bench/measured/h200_gpu_components.json``.

Every number drawn is read from those files here, so a new measurement redraws the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Dict, List, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "bench" / "measured"
COLOCATED = MEASURED / "h200_sglang_colocated_groups.json"  # the newest colocated runs, with and without offload
RAW_PUSHES = MEASURED / "h200_sglang_colocated.json"  # the pushes to a bare SGLang server (its raw phase)
SPLIT_ASYNC = MEASURED / "h200x2_sglang_split_async.json"
COMPONENTS = MEASURED / "h200_gpu_components.json"
FIGURES = ("step_dataflow.png", "placement_timeline.png", "weight_sync.png")

SETUP, ROLLOUT, TRAIN, SYNC, REST = "#dfe7f2", "#cde8d3", "#f6dcc3", "#e6d5f0", "#eeeeee"


def step_medians(path: Path, phase: str = "sglang") -> Dict[str, float]:
    """The medians of the ``perf/*`` metrics of one run phase over the steps after the first (as the .md
    tables report them)."""
    rows = json.loads(path.read_text())[phase]["rows"][1:]
    keys = ("step_time", "rollout_wait_time", "rollout_time", "train_time", "weight_sync_time", "weight_sync_bytes")
    return {k: statistics.median(r[f"perf/{k}"] for r in rows) for k in keys}


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
    box(ax, 8.8, low, 3.4, h, "engines", "EngineActor -> server process\nSGLang or embedded\nrollout/engine.py",
        ROLLOUT)
    box(ax, 12.8, low, 3.0, h, "weight sync", "push_weights ->\nWeightSender.push\n(sync/sender.py)\n"
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
    ax.text(8.2, 3.05, "colocated: the engines release their memory before train, and take it back in push_weights\n"
            "async: generate(step + 1) runs while the trainers train on step", fontsize=7.5, ha="center",
            color="#444444")
    fig.savefig(out, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def placement_timeline(out: Path) -> None:
    co, sp = step_medians(COLOCATED, "sglang_offload"), step_medians(SPLIT_ASYNC)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(12, 5.4), gridspec_kw={"height_ratios": [1, 1.6]})

    def bar(ax, lane: int, start: float, width: float, color: str, label: str) -> None:
        ax.barh(lane, width, left=start, height=0.6, color=color, edgecolor="#555555", lw=0.8)
        if width > 0.12:
            ax.text(start + width / 2, lane, label, ha="center", va="center", fontsize=7.5)

    # colocated, sync: one GPU; two steps as the driver runs them
    rest = co["step_time"] - co["rollout_wait_time"] - co["train_time"] - co["weight_sync_time"]
    t = 0.0
    for _ in range(2):
        parts = [(co["rollout_wait_time"], ROLLOUT, "engines generate\n(weights + KV cache)"),
                 (rest, REST, "release /\nonload, log"),
                 (co["train_time"], TRAIN, "trainer trains\n(engines released)"),
                 (co["weight_sync_time"], SYNC, "offload,\nIPC push")]
        for width, color, label in parts:
            bar(a1, 0, t, width, color, label)
            t += width
    a1.set_yticks([0], ["GPU 0:\ntrainer + engine"])
    a1.set_title(f"colocated with both offloads, sync loop, one H200: {co['step_time']:.2f} s a step "
                 f"({COLOCATED.relative_to(ROOT)}, sglang_offload)", fontsize=9.5, loc="left")

    # split, async: trainer GPU and engine GPU; the engine generates step + 1 while the trainer trains
    t = 0.0
    for i in range(2):
        gen_start = t
        step = "s" if i == 0 else f"s + {i}"
        bar(a2, 1, t, sp["train_time"], TRAIN, f"train step {step}")
        bar(a2, 0, gen_start, sp["rollout_time"], ROLLOUT, f"generate for\nstep s + {i + 1}")
        t += sp["train_time"]
        bar(a2, 1, t, sp["weight_sync_time"], SYNC, "")
        bar(a2, 0, t, sp["weight_sync_time"], SYNC, "")
        a2.annotate("NCCL push", (t + sp["weight_sync_time"] / 2, 0.5), ha="center", fontsize=7.5)
        t += sp["weight_sync_time"] + max(0.0, sp["step_time"] - sp["train_time"] - sp["weight_sync_time"])
    a2.set_yticks([0, 1], ["GPU 1: engine", "GPU 0: trainer"])
    a2.set_title(f"split, async loop, two H200s: {sp['step_time']:.2f} s a step, the driver waited "
                 f"{sp['rollout_wait_time']:.2f} s for rollouts ({SPLIT_ASYNC.relative_to(ROOT)})",
                 fontsize=9.5, loc="left")
    for ax in (a1, a2):
        ax.set_xlim(0, max(t, 2 * co["step_time"]) * 1.02)
        ax.set_xlabel("seconds (medians of the steps after the first; Qwen3-0.6B shape, 64 samples x 256 tokens)",
                      fontsize=8)
        ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)


def sync_costs() -> List[Tuple[str, float, float, str]]:
    """(label, seconds per push, GiB pushed, source file) of every measured weight push."""
    co, sp = step_medians(COLOCATED, "sglang_offload"), step_medians(SPLIT_ASYNC)
    nooff = step_medians(COLOCATED)
    raw = json.loads(RAW_PUSHES.read_text())["raw"]["push_s"]
    comp = json.loads(COMPONENTS.read_text())["sync"]
    gib = co["weight_sync_bytes"] / 2**30
    return [
        ("tensor (CUDA IPC), SGLang, push only", raw["tensor_v2"], gib, RAW_PUSHES.name),
        ("tensor, SGLang, in run.py (no offload)", nooff["weight_sync_time"], nooff["weight_sync_bytes"] / 2**30,
         COLOCATED.name),
        ("tensor, SGLang, in run.py (with trainer offload, engine resume)", co["weight_sync_time"], gib,
         COLOCATED.name),
        ("tensor, embedded engine", comp["tensor"]["seconds"], comp["tensor"]["GiB"], COMPONENTS.name),
        ("distributed (NCCL), SGLang on another GPU, in run.py", sp["weight_sync_time"],
         sp["weight_sync_bytes"] / 2**30, SPLIT_ASYNC.name),
        ("disk (safetensors), SGLang", raw["disk_v1"], gib, RAW_PUSHES.name),
        ("disk, embedded engine", comp["disk"]["seconds"], comp["disk"]["GiB"], COMPONENTS.name),
    ]


def weight_sync(out: Path) -> None:
    fig = plt.figure(figsize=(12, 8.6))
    ax = fig.add_axes([0.0, 0.42, 1.0, 0.58])
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

    bx = fig.add_axes([0.36, 0.06, 0.6, 0.34])
    costs = sync_costs()
    labels = [f"{lab} [{src}]".replace("\n", " ") for lab, _, _, src in costs]
    seconds = [s for _, s, _, _ in costs]
    colors = [SYNC if lab.startswith("tensor") else "#c9d9f0" if lab.startswith("distributed") else "#f0c9c9"
              for lab, *_ in costs]
    bx.barh(range(len(costs)), seconds, color=colors, edgecolor="#555555")
    for i, (_, sec, gib, _) in enumerate(costs):
        bx.text(sec, i, f"  {sec:.3f} s for {gib:.2f} GiB", va="center", fontsize=7.5)
    bx.set_yticks(range(len(costs)), labels, fontsize=7.5)
    bx.invert_yaxis()
    bx.set_xlim(0, max(seconds) * 1.35)
    bx.set_xlabel("seconds per push on H200s, Qwen3-0.6B shape (files in bench/measured/)", fontsize=8)
    bx.spines[["top", "right"]].set_visible(False)
    fig.savefig(out, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def render(out_dir: Path) -> List[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in FIGURES]
    for draw, path in zip((step_dataflow, placement_timeline, weight_sync), paths):
        draw(path)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the PNG files go")
    for path in render(p.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
