"""The embedded default over many seeds, as a newcomer runs it (``python run.py seed=K``), several at
once on a many-core host, each run pinned to its own CPU cores (2 by default, as on a laptop).

    python bench/default_seeds.py --seeds 1-10                    # 2 cores per run, as many at once as fit
    python bench/default_seeds.py --seeds 1-10 --cores 2 -- trainer.num_rollout=100

Per run: the held-out greedy reward at every evaluation, the final one, the first evaluation at or
above ``--target`` (0.9) with its wall-clock seconds from the command's start (Ray start-up and
the engine launch included), the start-up time (to the first weight push) and the whole run's
wall time. A run is deterministic in its seed, so rewards do not depend on the host; times do (cores, their speed).
The table goes to stdout and ``bench/results/default_seeds.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import queue
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def seeds_arg(text: str) -> List[int]:
    out: List[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def log_time(line: str) -> Optional[float]:
    """The epoch seconds of a run.log line ("2026-01-31 12:34:56,789 INFO ...")."""
    try:
        return dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def one_run(seed: int, cores: Optional[List[int]], out_dir: Path, target: float, extra: List[str]) -> Dict:
    run_dir = out_dir / f"seed{seed}"
    cmd = [sys.executable, "run.py", f"seed={seed}", f"hydra.run.dir={run_dir}", "logging.progress=false", *extra]
    if cores:
        cmd = ["taskset", "-c", ",".join(map(str, cores)), *cmd]
    env = {**os.environ, "WANDB_MODE": "offline", "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
           "CUDA_VISIBLE_DEVICES": ""}
    start = time.time()
    with open(out_dir / f"seed{seed}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    wall = time.time() - start
    row: Dict = {"seed": seed, "rc": rc, "wall_s": round(wall, 1)}
    metrics = run_dir / "metrics.jsonl"
    if rc != 0 or not metrics.exists():
        return row
    evals = [(r["step"], r["eval/heldout/reward"]) for r in map(json.loads, metrics.read_text().splitlines())
             if "eval/heldout/reward" in r]
    row["evals"] = [round(v, 3) for _, v in evals]
    row["final"] = round(evals[-1][1], 3)
    lines = (run_dir / "run.log").read_text().splitlines()
    # "step N: eval heldout/reward X" lines carry the wall-clock time of each evaluation
    at = {int(ln.split("step ")[1].split(":")[0]): log_time(ln) for ln in lines if ": eval heldout/reward" in ln}
    hit = next((s for s, v in evals if v >= target), None)
    row["first_target_step"] = hit
    row["first_target_s"] = round(at[hit] - start, 1) if hit is not None and at.get(hit) else None
    pushed = next((log_time(ln) for ln in lines if "weights v0 pushed" in ln), None)
    row["first_step_s"] = round(pushed - start, 1) if pushed else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=seeds_arg, default=seeds_arg("1-10"))
    ap.add_argument("--cores", type=int, default=2, help="CPU cores per run (taskset); 0: no pinning")
    ap.add_argument("--parallel", type=int, default=None, help="runs at once (default: host cores // --cores)")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("extra", nargs="*", help="Hydra overrides for every run (after --)")
    args = ap.parse_args()
    ncpu = len(os.sched_getaffinity(0))
    parallel = args.parallel or max(1, ncpu // max(args.cores, 1))
    if args.cores and parallel * args.cores > ncpu:
        ap.error(f"--parallel {parallel} x --cores {args.cores} needs more than the {ncpu} CPUs this process may use")
    out_dir = RESULTS / f"default_seeds_{time.strftime('%Y%m%d_%H%M%S')}"
    out_dir.mkdir(parents=True)
    cpus = sorted(os.sched_getaffinity(0))

    slots: "queue.Queue[int]" = queue.Queue()  # each slot's cores run one run at a time
    for slot in range(parallel):
        slots.put(slot)

    def job(seed: int) -> Dict:
        slot = slots.get()
        try:
            cores = cpus[slot * args.cores:(slot + 1) * args.cores] if args.cores else None
            row = one_run(seed, cores, out_dir, args.target, args.extra)
        finally:
            slots.put(slot)
        print(json.dumps(row), flush=True)
        return row

    with ThreadPoolExecutor(parallel) as pool:
        rows = list(pool.map(job, args.seeds))
    finals = [r["final"] for r in rows if "final" in r]
    hits = [r["first_target_s"] for r in rows if r.get("first_target_s") is not None]
    lines = [f"| seed | final | first eval >= {args.target} (step, s) | start-up to first push (s) | wall (s) | "
             "held-out every eval |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r.get('final', 'FAILED')} | "
                     f"{r.get('first_target_step')}, {r.get('first_target_s')} | "
                     f"{r.get('first_step_s')} | {r['wall_s']} | {' '.join(map(str, r.get('evals', [])))} |")
    summary = (f"{sum(f >= args.target for f in finals)}/{len(rows)} runs end >= {args.target}; final "
               f"{min(finals, default=float('nan')):.3f}-{max(finals, default=float('nan')):.3f}, mean "
               f"{sum(finals) / max(1, len(finals)):.3f}; reached {args.target} in {len(hits)} runs, after "
               f"{min(hits, default=float('nan')):.0f}-{max(hits, default=float('nan')):.0f} s "
               f"({args.cores or 'unpinned'} cores per run, {parallel} at once on {ncpu}; overrides: "
               f"{' '.join(args.extra) or 'none'})")
    text = "\n".join(lines) + "\n\n" + summary + "\n"
    print("\n" + text)
    (RESULTS / "default_seeds.md").write_text(text)
    sys.exit(0 if len(finals) == len(rows) else 1)


if __name__ == "__main__":
    main()
