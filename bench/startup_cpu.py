"""Start-up of the CPU default: seconds from ``python run.py`` to the first finished step, and the run's own
account of them (``startup/*`` of its first row, launch/startup.py), for this checkout and optionally an
older one (``--before DIR``: e.g. ``git archive <commit> | tar -x -C DIR``), runs alternating so that the
machine's load falls on both alike.

    python bench/startup_cpu.py --runs 2 --before /tmp/before -- trainer.num_rollout=1

Writes ``--out``/startup_cpu.json and .md. The launch-to-step time is measured from outside (the moment the
step's row appears in metrics.jsonl), so it needs no instrumentation in the older checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE]

from gpu import harness as h  # noqa: E402 - bench/ is on the path from here

PARTS = ["total", "before_train", "ray_init", "placement_group", "initial_checkpoint", "trainers",
         "wait_for_rollout_side", "first_push", "eval_before_train", "first_step", "rollout_side", "engine_server"]


def one_run(tree: str, run_dir: str, overrides: List[str], limit_s: float) -> Dict[str, Any]:
    """``python <tree>/run.py`` with ``tree`` first on PYTHONPATH; launch -> the first step's row."""
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": tree, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "offline"}
    cmd = [sys.executable, os.path.join(tree, "run.py"), *overrides, "logging.progress=false",
           f"hydra.run.dir={run_dir}"]
    metrics = os.path.join(run_dir, "metrics.jsonl")
    t0 = time.perf_counter()
    with open(run_dir + ".out", "w") as console:
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=console, stderr=subprocess.STDOUT)
    seen = None
    while proc.poll() is None and time.perf_counter() - t0 < limit_s:
        time.sleep(0.2)
        if seen is None and any(r["step"] == 1 for r in h.read_rows(metrics)):
            seen = time.perf_counter() - t0
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    first = next((r for r in h.read_rows(metrics) if r["step"] == 1), {})
    return {"rc": proc.returncode, "first_step_done_s": round(seen, 1) if seen else None,
            "load_1min": round(os.getloadavg()[0], 1),
            "startup": {k.removeprefix("startup/"): v for k, v in first.items() if k.startswith("startup/")}}


def report(results: Dict[str, Any], path: str) -> None:
    h.write_json(path + ".json", results)
    lines = [f"# Start-up of `python run.py {' '.join(results['overrides'])}` on this machine's CPU", "",
             "Seconds from launch to the first step's row (measured from outside), and the run's own parts "
             "(`startup/*`, launch/startup.py; the trainers build while the rollout side starts).", "",
             *h.table(["checkout", "run", "load (1 min)", "launch to step 1 done", *PARTS],
                      [[r["tree"], r["i"], r["load_1min"], h.cell(r["first_step_done_s"], ".1f"),
                        *(h.cell(r["startup"].get(f"{p}_s"), ".1f") for p in PARTS)] for r in results["runs"]])]
    h.write_text(path + ".md", "\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2, help="runs of each checkout")
    ap.add_argument("--before", default=None, help="an older checkout to compare with (run alternately)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--limit", type=float, default=600.0, help="seconds a run may take")
    ap.add_argument("overrides", nargs="*", default=["trainer.num_rollout=1"], help="run.py overrides")
    args = ap.parse_args()
    trees = {"this": ROOT, **({"before": os.path.abspath(args.before)} if args.before else {})}
    results: Dict[str, Any] = {"overrides": args.overrides, "runs": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "startup_cpu")
    for i in range(args.runs):
        for name, tree in trees.items():
            r = {"tree": name, "i": i, **one_run(tree, f"/tmp/startup_cpu_{name}_{i}", args.overrides, args.limit)}
            h.log(json.dumps(r))
            results["runs"].append(r)
            report(results, path)
    print(open(path + ".md").read())


if __name__ == "__main__":
    main()
