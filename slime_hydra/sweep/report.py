"""The sweep report: every job's overrides, status, held-out rewards, steps and speed, side by side, in
``sweep.csv``, ``sweep.md`` and ``sweep_curves.png``, rebuilt from the run directories alone each time a job
changes state (``python -m slime_hydra.sweep report DIR`` by hand)."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import textwrap
from typing import Any, Dict, List, Optional, Tuple

from slime_hydra.logging.metrics import write_atomic
from slime_hydra.sweep.jobs import read_status, sweep_job_dirs

COLUMNS = ["job", "overrides", "status", "objective", "final_reward", "best_reward", "best_step", "steps", "s_per_step",
           "run_dir", "error"]
ERROR_TAIL = 300  # characters of a failed job's error kept in the table


def eval_reward(row: Dict[str, Any]) -> Optional[float]:
    """A metrics row's held-out reward: the mean over eval datasets (as summary.json's)."""
    vals = [v for k, v in row.items() if k.startswith("eval/") and k.endswith("/reward")]
    return sum(vals) / len(vals) if vals else None


def read_metrics(job_dir: str) -> List[Dict[str, Any]]:
    """A job's metrics rows; a staged job's (``stages``: ``<k>_<name>/``) stage after stage, each stage's steps
    counted on from the previous stage's last, and its name under ``stage``."""
    stages = sorted((d for d in os.listdir(job_dir) if re.fullmatch(r"\d+_.+", d)
                     and os.path.isfile(os.path.join(job_dir, d, "metrics.jsonl"))),
                    key=lambda d: int(d.split("_")[0])) if os.path.isdir(job_dir) else []
    if not stages:
        return _read_jsonl(os.path.join(job_dir, "metrics.jsonl"))
    rows: List[Dict[str, Any]] = []
    for stage in stages:
        offset = rows[-1]["step"] if rows else 0
        rows += [{**r, "step": r["step"] + offset, "stage": stage}
                 for r in _read_jsonl(os.path.join(job_dir, stage, "metrics.jsonl"))]
    return rows


def _read_jsonl(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line being written
                break
    return rows


def eval_curve(rows: List[Dict[str, Any]]) -> List[Tuple[int, float]]:
    return [(r["step"], eval_reward(r)) for r in rows if eval_reward(r) is not None]


DEFAULT_METRIC = "eval_reward_final"  # SweepConfig.optimized_metric's default


def objective_of(sweep_dir: str) -> Tuple[str, str]:
    """``(sweep.optimized_metric, direction)`` of the sweep in ``sweep_dir`` (its ``multirun.yaml``): the
    summary.json value its jobs return, and ``maximize`` or (an Optuna search's direction) ``minimize``."""
    metric, direction = DEFAULT_METRIC, "maximize"
    try:
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(os.path.join(sweep_dir, "multirun.yaml"))
        metric = str(OmegaConf.select(cfg, "sweep.optimized_metric", default=None) or metric)
        d = OmegaConf.select(cfg, "hydra.sweeper.optuna.direction", default=None)
        d = d[0] if OmegaConf.is_list(d) and len(d) else d
        direction = str(getattr(d, "name", d) or direction).lower()
    except Exception:  # noqa: BLE001 - no multirun.yaml (an earlier sweep), or one that does not load
        pass
    return metric, "minimize" if direction == "minimize" else "maximize"


def read_summary(job_dir: str) -> Dict[str, Any]:
    try:
        with open(os.path.join(job_dir, "summary.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def job_row(job_dir: str, metric: str = DEFAULT_METRIC) -> Dict[str, Any]:
    """One line of the table for one job directory; ``objective``: its ``metric`` (summary.json)."""
    state = read_status(job_dir) or {}
    rows = read_metrics(job_dir)
    curve = eval_curve(rows)
    objective = read_summary(job_dir).get(metric)
    if objective is None and metric == DEFAULT_METRIC and curve:
        objective = curve[-1][1]  # the final held-out reward, also without a summary
    steps = [r["step"] for r in rows if "perf/step_time" in r]
    step_times = [r["perf/step_time"] for r in rows if "perf/step_time" in r]
    best = max(curve, key=lambda c: c[1]) if curve else None
    return {"job": state.get("num"), "overrides": " ".join(state.get("overrides", [])),
            "status": state.get("status", "unknown"),
            "objective": _round(objective) if isinstance(objective, (int, float)) else None,
            "final_reward": _round(curve[-1][1]) if curve else None, "best_reward": _round(best[1]) if best else None,
            "best_step": best[0] if best else None, "steps": max(steps) if steps else 0,
            "s_per_step": _round(sum(step_times) / len(step_times)) if step_times else None,
            "run_dir": os.path.abspath(job_dir), "error": (state.get("error") or "")[-ERROR_TAIL:].strip()}


def _round(x: float) -> Optional[float]:
    return None if x is None or math.isnan(x) else round(x, 4)


def collect(sweep_dir: str, metric: Optional[str] = None) -> List[Dict[str, Any]]:
    """The table's rows, one per job of the sweep; ``metric``: the objective (default: the sweep's own)."""
    metric = metric or objective_of(sweep_dir)[0]
    return [job_row(d, metric) for d in sweep_job_dirs(sweep_dir)]


def best_job(rows: List[Dict[str, Any]], direction: str = "maximize") -> Optional[Dict[str, Any]]:
    """The job with the best objective among those that ended ok."""
    done = [r for r in rows if r["status"] == "ok" and r["objective"] is not None]
    if not done:
        return None
    return (min if direction == "minimize" else max)(done, key=lambda r: r["objective"])


def to_csv(rows: List[Dict[str, Any]]) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: "" if r[k] is None else r[k] for k in COLUMNS})
    return out.getvalue()


def to_markdown(rows: List[Dict[str, Any]], sweep_dir: str, metric: str = DEFAULT_METRIC,
                direction: str = "maximize") -> str:
    def cell(v: Any) -> str:
        return "" if v is None else str(v).replace("|", "\\|").replace("\n", " ")

    counts = {s: sum(r["status"] == s for r in rows) for s in sorted({r["status"] for r in rows})}
    best = best_job(rows, direction)
    lines = [f"# Sweep {os.path.abspath(sweep_dir)}", "",
             f"{len(rows)} jobs: " + ", ".join(f"{n} {s}" for s, n in counts.items()), "",
             f"objective: {metric} (sweep.optimized_metric), {direction}d", ""]
    if best:
        lines += [f"Best: job {best['job']} ({best['overrides'] or 'no overrides'}), {metric} {best['objective']}", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r[k]) for k in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def short(overrides: str) -> str:
    """Overrides for a legend: long floats (an Optuna trial's values) to 4 significant digits."""
    return re.sub(r"(?<==)(-?\d+\.\d{5,}(?:e-?\d+)?)", lambda m: f"{float(m.group(1)):.4g}", overrides)


def plot(sweep_dir: str, rows: List[Dict[str, Any]], path: str, direction: str = "maximize") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_job(rows, direction)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        curve = eval_curve(read_metrics(r["run_dir"]))
        if not curve:
            continue
        is_best = best is not None and r["job"] == best["job"]
        label = f"{r['job']}: {short(r['overrides']) or '(defaults)'} [{r['status']}]"
        ax.plot([c[0] for c in curve], [c[1] for c in curve], marker="o", markersize=3,
                linewidth=2.5 if is_best else 1.0, alpha=1.0 if is_best else 0.7, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out reward")
    title = f"sweep {os.path.basename(os.path.abspath(sweep_dir))}"
    if best:
        title += "\n" + textwrap.shorten(f"best: job {best['job']} ({best['objective']}) {short(best['overrides'])}",
                                          110)
    ax.set_title(title, fontsize=9)
    if ax.lines:
        ax.legend(fontsize=6, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path + ".tmp", format="png", dpi=110)
    plt.close(fig)
    os.replace(path + ".tmp", path)


def write_report(sweep_dir: str) -> List[Dict[str, Any]]:
    """sweep.csv, sweep.md and sweep_curves.png in ``sweep_dir``; returns the table's rows."""
    metric, direction = objective_of(sweep_dir)
    rows = collect(sweep_dir, metric)
    write_atomic(os.path.join(sweep_dir, "sweep.csv"), to_csv(rows))
    write_atomic(os.path.join(sweep_dir, "sweep.md"), to_markdown(rows, sweep_dir, metric, direction))
    plot(sweep_dir, rows, os.path.join(sweep_dir, "sweep_curves.png"), direction)
    return rows


def status_line(row: Dict[str, Any]) -> str:
    """One console line for one job: what a progress bar per job would show, without N bars interleaving."""
    parts = [f"job {row['job']}", row["status"], f"step {row['steps']}"]
    if row["final_reward"] is not None:
        parts.append(f"eval {row['final_reward']:.3f}")
    if row["s_per_step"] is not None:
        parts.append(f"{row['s_per_step']:.2f} s/step")
    line = "[sweep] " + " | ".join(parts) + f" | {row['overrides'] or '(defaults)'}"
    if row["status"] == "failed" and row["error"]:
        line += f" | {row['error'].splitlines()[-1][:160]}"
    return line
