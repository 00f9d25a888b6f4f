"""Runs from the shell, read from their directories alone:
``python -m slime_hydra.runs list [DIR...]``: the runs and sweeps under DIR (default outputs/ and multirun/):
date, name, status, steps, final and best held-out reward, the overrides that differ from the defaults;
``python -m slime_hydra.runs compare RUN RUN... [--png PATH]``: where their resolved configs differ, their metrics
side by side, and their curves overlaid in one PNG. Rich tables in a terminal, plain text in a pipe."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import OmegaConf

from slime_hydra.launch.lease import LEASE_FILE, driver_alive
from slime_hydra.sweep.jobs import read_status
from slime_hydra.sweep.report import eval_curve, read_metrics, read_summary

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def run_dirs(root: str) -> List[str]:
    """Every run directory (one with ``.hydra/``) under ``root``, oldest first."""
    found = [dirpath for dirpath, dirnames, _ in os.walk(root) if ".hydra" in dirnames]
    return sorted(found, key=lambda d: os.path.getmtime(os.path.join(d, ".hydra")))


def status(run_dir: str) -> str:
    """A sweep job's own status; else ok (a summary), running (a live driver), or incomplete."""
    if state := read_status(run_dir):
        return state["status"]
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        return "ok"
    try:
        with open(os.path.join(run_dir, LEASE_FILE)) as f:
            lease = json.load(f)
        if lease.get("host") == socket.gethostname() and driver_alive(lease):
            return "running"
    except (OSError, ValueError, KeyError):
        pass
    return "incomplete"


def defaults() -> tuple:
    """(the default config, the default choice of each config group) of ``conf/``."""
    from hydra import compose, initialize_config_dir

    from slime_hydra.config.store import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("config", return_hydra_config=True)
    return cfg, {k: str(v) for k, v in cfg.hydra.runtime.choices.items()}


def differing(run_dir: str, base: Any, choices: Dict[str, str]) -> List[str]:
    """The run's command-line overrides whose value is not the default's (``hydra.*`` left out)."""
    path = os.path.join(run_dir, ".hydra", "overrides.yaml")
    if not os.path.exists(path):
        return []
    out = []
    for o in OmegaConf.to_container(OmegaConf.load(path)):
        key, _, value = str(o).partition("=")
        key = key.lstrip("+~")
        if key.startswith("hydra.") or key in ("dry_run",):
            continue
        if key in choices:
            if choices[key] != value:
                out.append(str(o))
            continue
        default = OmegaConf.select(base, key, default=None, throw_on_missing=False)
        try:
            same = default is not None and OmegaConf.create({"v": default}).v == OmegaConf.create(f"v: {value}").v
        except Exception:  # noqa: BLE001 - a value YAML does not read: shown
            same = False
        if not same:
            out.append(str(o))
    return out


def _fmt(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.3f}"


def run_row(run_dir: str, base: Any, choices: Dict[str, str], name: Optional[str] = None) -> List[str]:
    rows = read_metrics(run_dir)
    curve = eval_curve(rows)
    cfg = resolved_config(run_dir)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(os.path.join(run_dir, ".hydra"))))
    return [when, name or str(OmegaConf.select(cfg, "run_name", default=None) or os.path.basename(run_dir)),
            status(run_dir), str(max((r.get("step", 0) for r in rows), default=0)),
            _fmt(curve[-1][1] if curve else None), _fmt(max(v for _, v in curve) if curve else None),
            " ".join(differing(run_dir, base, choices)), run_dir]


LIST_COLUMNS = ["date", "name", "status", "steps", "final eval", "best eval", "overrides", "dir"]


def list_rows(roots: Sequence[str]) -> List[List[str]]:
    """One row per run; a sweep: a row of its own (its jobs' statuses counted), then one per job."""
    base, choices = defaults()
    out = []
    for root in roots:
        seen = set()
        for d in run_dirs(root):
            sweep = os.path.dirname(d)
            if os.path.exists(os.path.join(sweep, "multirun.yaml")) and sweep not in seen:
                seen.add(sweep)
                jobs = [j for j in run_dirs(sweep) if os.path.dirname(j) == sweep]
                states = [status(j) for j in jobs]
                counts = ", ".join(f"{states.count(s)} {s}" for s in sorted(set(states)))
                finals = [eval_curve(read_metrics(j)) for j in jobs]
                best = [max(v for _, v in c) for c in finals if c]
                when = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(sweep)))
                out.append([when, f"sweep {os.path.basename(sweep)}", f"{len(jobs)} jobs: {counts}", "", "",
                            _fmt(max(best) if best else None), "", sweep])
            inside = os.path.dirname(d) in seen
            out.append(run_row(d, base, choices, name=f"  {os.path.basename(d)}" if inside else None))
    return out


def resolved_config(run_dir: str) -> Any:
    """The run's resolved config (``config.yaml``), else the composed one (``.hydra/config.yaml``)."""
    for path in (os.path.join(run_dir, "config.yaml"), os.path.join(run_dir, ".hydra", "config.yaml")):
        if os.path.exists(path):
            return OmegaConf.load(path)
    return OmegaConf.create()


def flat(cfg: Any) -> Dict[str, Any]:
    from slime_hydra.logging.trackers import flatten

    return flatten(OmegaConf.to_container(cfg, resolve=False))


def config_diff(runs: Sequence[str]) -> List[List[str]]:
    """The keys whose values differ between the runs: ``[key, value in run 1, value in run 2, ...]``."""
    flats = [flat(resolved_config(r)) for r in runs]
    keys = sorted(set().union(*flats))
    return [[k] + [str(f.get(k, "-")) for f in flats] for k in keys if len({repr(f.get(k, "-")) for f in flats}) > 1]


def metrics_table(runs: Sequence[str]) -> List[List[str]]:
    """Per run: status, steps, final and best held-out reward, and summary.json's numbers."""
    summaries = [read_summary(r) for r in runs]
    keys = sorted({k for s in summaries for k, v in s.items() if isinstance(v, (int, float))})
    table = [["status"] + [status(r) for r in runs],
             ["steps"] + [str(max((m.get("step", 0) for m in read_metrics(r)), default=0)) for r in runs]]
    curves = [eval_curve(read_metrics(r)) for r in runs]
    table.append(["final eval"] + [_fmt(c[-1][1] if c else None) for c in curves])
    table.append(["best eval"] + [_fmt(max(v for _, v in c) if c else None) for c in curves])
    table += [[k] + [_fmt(s.get(k)) if isinstance(s.get(k), (int, float)) else "" for s in summaries]
              for k in keys if k != "steps"]
    return table


def plot_curves(runs: Sequence[str], names: Sequence[str], path: str) -> None:
    """Held-out reward (lines and dots) and the sampled train reward (faint) of every run, one axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run, name in zip(runs, names):
        rows = read_metrics(run)
        train = [(r["step"], r["rollout/reward_mean"]) for r in rows if "rollout/reward_mean" in r]
        line = None
        if curve := eval_curve(rows):
            (line,) = ax.plot(*zip(*curve), "o-", markersize=3, label=f"{name} (eval)")
        if train:
            ax.plot(*zip(*train), alpha=0.35, color=line.get_color() if line else None, label=f"{name} (train)")
    ax.set(xlabel="step", ylabel="reward")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0, -0.15))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def show(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], out: Any = None) -> None:
    """A rich table on a terminal; tab-separated lines (a header first) in a pipe."""
    out = out or sys.stdout
    if out.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(*columns, title=title, title_justify="left")
        for row in rows:
            table.add_row(*row)
        Console(file=out).print(table)
        return
    print(f"# {title}", file=out)
    for row in [list(columns), *rows]:
        print("\t".join(row), file=out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slime_hydra.runs", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="the runs and sweeps under DIR (default: outputs and multirun)")
    ls.add_argument("dirs", nargs="*", default=["outputs", "multirun"])
    cmp = sub.add_parser("compare", help="config differences, metrics side by side, overlaid curves")
    cmp.add_argument("runs", nargs="+", help="run directories")
    cmp.add_argument("--png", default="compare.png", help="where the overlaid curves go (default: compare.png)")
    args = parser.parse_args(argv)
    if args.command == "list":
        roots = [d for d in args.dirs if os.path.isdir(d)]
        if not roots and args.dirs != ["outputs", "multirun"]:
            print(f"{' '.join(args.dirs)}: no such directory", file=sys.stderr)
            return 2
        show("runs", LIST_COLUMNS, list_rows(roots))
        return 0
    missing = [r for r in args.runs if not os.path.isdir(os.path.join(r, ".hydra"))]
    if missing or len(args.runs) < 2:
        print("compare needs two or more run directories (each with .hydra/)"
              + (f"; not one: {' '.join(missing)}" if missing else ""), file=sys.stderr)
        return 2
    names = [r.rstrip("/") for r in args.runs]
    show("config: the keys that differ", ["key", *names], config_diff(args.runs))
    show("metrics", ["", *names], metrics_table(args.runs))
    plot_curves(args.runs, names, args.png)
    print(f"curves: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
