"""Sweeps on one machine: what running jobs side by side on one Ray cluster buys, what the sweep costs,
and what pruning saves.

    python bench/sweep_bench.py                       # 4 jobs x 30 steps; an 8-trial search; ~30 min on 2 cores
    python bench/sweep_bench.py --steps 10 --trials 4 # quicker
    python bench/sweep_bench.py --parts grid          # grid | standalone | search (comma-separated)

1. grid: ``python run.py -m seed=1,2,3,4 trainer.num_rollout=N`` with ``sweep.max_concurrent=1`` and
   ``=2``: wall time of each, their ratio (the goal: <= 0.75), and how many Ray clusters each started
   (the sweep's log line, and the jobs' ``driver.json`` naming no cluster of their own).
2. standalone: the same 4 runs as plain ``python run.py`` one after another: the sum of their wall
   times against the concurrency-1 sweep's wall time is the sweep's overhead (or saving: one cluster).
3. search: ``-m hparams_search=grpo_digits`` with ``--trials`` trials (2 at once) and the median pruner:
   trials pruned, and the CPU-seconds that saved: for each pruned trial, the steps it did not run x its
   measured seconds per step x the CPU slots its placement group held.

Writes bench/measured/sweeps.md (and .json) with the date, the command, and the machine's load.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "measured"


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def sh(cmd: List[str], log: Path, timeout: float) -> Dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "offline"}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env)
    return {"cmd": " ".join(cmd[1:]), "rc": p.returncode, "wall_s": round(time.perf_counter() - t0, 1),
            "log": str(log)}


def rows(sweep_dir: Path) -> List[Dict[str, str]]:
    with open(sweep_dir / "sweep.csv") as f:
        return list(csv.DictReader(f))


def train_s(run_dir: Path) -> float:
    """Seconds a run spent in its steps (the sum of perf/step_time): the rest of its wall time is start-up
    and shutdown (the sweep's, or a standalone run's own cluster)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sum(r.get("perf/step_time", 0.0) for r in rows)


def grid(base: Path, steps: int, concurrency: int, timeout: float) -> Dict[str, Any]:
    d = base / f"grid_c{concurrency}"
    r = sh([sys.executable, "run.py", "-m", "seed=1,2,3,4", f"trainer.num_rollout={steps}",
            f"sweep.max_concurrent={concurrency}", f"hydra.sweep.dir={d}"], base / f"grid_c{concurrency}.log", timeout)
    text = Path(r["log"]).read_text()
    r["clusters_started"] = text.count("one Ray cluster for every job")
    r["jobs"] = [{k: x[k] for k in ("job", "status", "final_reward", "steps", "s_per_step")} for x in rows(d)]
    r["train_s"] = round(sum(train_s(Path(x["run_dir"])) for x in rows(d)), 1)
    return r


def standalone(base: Path, steps: int, timeout: float) -> Dict[str, Any]:
    runs = [sh([sys.executable, "run.py", f"seed={s}", f"trainer.num_rollout={steps}", "logging.progress=false",
                f"hydra.run.dir={base / f'standalone_{s}'}"], base / f"standalone_{s}.log", timeout)
            for s in (1, 2, 3, 4)]
    return {"runs": runs, "sum_wall_s": round(sum(r["wall_s"] for r in runs), 1), "rc": max(r["rc"] for r in runs),
            "train_s": round(sum(train_s(base / f"standalone_{s}") for s in (1, 2, 3, 4)), 1)}


def search(base: Path, steps: int, trials: int, timeout: float) -> Dict[str, Any]:
    d = base / "search"
    r = sh([sys.executable, "run.py", "-m", "hparams_search=grpo_digits", f"hydra.sweeper.optuna.n_trials={trials}",
            f"trainer.num_rollout={steps}", "eval.interval=5", "sweep.max_concurrent=2", f"hydra.sweep.dir={d}"],
           base / "search.log", timeout)
    jobs = rows(d)
    pruned = [j for j in jobs if j["status"] == "pruned"]
    # CPU slots a trial's placement group holds: the default plan's bundles ({CPU: 1} each)
    slots = 2
    saved = sum((steps - int(j["steps"])) * float(j["s_per_step"]) * slots for j in pruned)
    ran = sum(int(j["steps"]) * float(j["s_per_step"] or 0) * slots for j in jobs)
    r.update({"trials": len(jobs), "pruned": len(pruned), "pruned_at_steps": [int(j["steps"]) for j in pruned],
              "cpu_slot_s_saved": round(saved, 1), "cpu_slot_s_used_training": round(ran, 1),
              "jobs": [{k: x[k] for k in ("job", "overrides", "status", "final_reward", "best_reward", "steps",
                                          "s_per_step")} for x in jobs]})
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--parts", default="grid,standalone,search")
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H-%M-%SZ")
    base = ROOT / "bench" / "results" / f"sweep_{stamp}"
    base.mkdir(parents=True)
    parts = args.parts.split(",")
    old = json.loads((OUT / "sweeps.json").read_text()) if (OUT / "sweeps.json").exists() else {}
    res: Dict[str, Any] = {"date": stamp, "command": "python bench/sweep_bench.py " + " ".join(sys.argv[1:]),
                           "cpus": os.cpu_count(), "load_before": load(), "steps": args.steps}
    if "grid" in parts:
        res["grid_c1"] = grid(base, args.steps, 1, args.timeout)
        res["grid_c2"] = grid(base, args.steps, 2, args.timeout)
        res["c2_over_c1"] = round(res["grid_c2"]["wall_s"] / res["grid_c1"]["wall_s"], 3)
    if "standalone" in parts:
        res["standalone"] = standalone(base, args.steps, args.timeout)
        if "grid_c1" in res:
            res["sweep_overhead_s"] = round(res["grid_c1"]["wall_s"] - res["standalone"]["sum_wall_s"], 1)
    if "search" in parts:
        res["search"] = search(base, args.steps, args.trials, args.timeout)
    res["load_after"] = load()
    for key in ("grid_c1", "grid_c2", "c2_over_c1", "standalone", "sweep_overhead_s", "search"):
        if key not in res and key in old:  # a part not run this time: the earlier measurement, with its date
            res[key] = old[key]
            res.setdefault("earlier", {})[key] = old.get("date")
    OUT.mkdir(exist_ok=True)
    (OUT / "sweeps.json").write_text(json.dumps(res, indent=2) + "\n")
    (OUT / "sweeps.md").write_text(markdown(res))
    print(markdown(res))
    return 0 if all(res[k]["rc"] == 0 for k in ("grid_c1", "grid_c2", "standalone", "search") if k in res) else 1


def markdown(r: Dict[str, Any]) -> str:
    earlier = "".join(f" `{k}` is from the run of {v}." for k, v in r.get("earlier", {}).items())
    lines = [f"# Sweeps, measured {r['date']}", "", f"Command: `{r['command']}` ({r['steps']} steps per job; "
             f"{r['cpus']} CPU cores; load average before {r['load_before']}, after {r.get('load_after')}: other "
             "sessions shared the machine, so the times are noisy)." + earlier, ""]
    if "grid_c1" in r:
        c1, c2 = r["grid_c1"], r["grid_c2"]
        lines += ["## 4 jobs of the default, concurrency 1 vs 2 (one Ray cluster per sweep)", "",
                  "| concurrency | wall s | Ray clusters started | jobs ok | mean s/step |", "|---|---|---|---|---|"]
        for c, g in ((1, c1), (2, c2)):
            ok = sum(j["status"] == "ok" for j in g["jobs"])
            sps = [float(j["s_per_step"]) for j in g["jobs"] if j["s_per_step"]]
            lines.append(f"| {c} | {g['wall_s']} | {g['clusters_started']} | {ok}/{len(g['jobs'])} | "
                         f"{sum(sps) / max(len(sps), 1):.2f} |")
        lines += ["", f"Concurrency 2 / concurrency 1 wall time: **{r['c2_over_c1']}** (goal <= 0.75).", ""]
    if "standalone" in r:
        lines += ["## Sweep overhead", "", f"4 standalone `python run.py` runs, one after another: "
                  f"{r['standalone']['sum_wall_s']} s in all."]
        if "sweep_overhead_s" in r:
            lines.append(f"The concurrency-1 sweep of the same 4 jobs: {r['grid_c1']['wall_s']} s, "
                         f"so the sweep costs {r['sweep_overhead_s']:+} s against them (negative: it saves).")
        if "train_s" in r["standalone"] and "train_s" in r.get("grid_c1", {}):
            c1, st = r["grid_c1"], r["standalone"]
            lines.append(f"Time outside the training steps (start-up, cluster, shutdown), all 4 jobs: sweep "
                         f"{c1['wall_s'] - c1['train_s']:.1f} s (steps {c1['train_s']} s), standalone "
                         f"{st['sum_wall_s'] - st['train_s']:.1f} s (steps {st['train_s']} s).")
        lines.append("")
    if "search" in r:
        s = r["search"]
        lines += [f"## Optuna search with pruning ({s['trials']} trials, 2 at once, median pruner, eval every 5 steps)",
                  "", f"Wall {s['wall_s']} s; {s['pruned']} of {s['trials']} trials pruned (at steps "
                  f"{s['pruned_at_steps']}); pruning saved ~{s['cpu_slot_s_saved']} CPU-slot-seconds (steps not run "
                  f"x measured s/step x 2 slots) against {s['cpu_slot_s_used_training']} CPU-slot-seconds spent "
                  "training.", "", "| trial | overrides | status | final | best | steps | s/step |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {j['job']} | {j['overrides']} | {j['status']} | {j['final_reward']} | {j['best_reward']} | "
                  f"{j['steps']} | {j['s_per_step']} |" for j in s["jobs"]]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
