"""Every algorithm preset on the embedded default (tiny model, built-in digits task, CPU), one after
the other, for the same number of rollouts; then a table:

    preset | held-out eval reward initial -> final | train reward (mean of the last 10 rollouts)
           | seconds per step (mean of perf/step_time) | wall seconds (the whole run, start-up included)

    python bench/algorithms.py                         # all presets of conf/algo/, 150 rollouts each
    python bench/algorithms.py --steps 60 --presets grpo,ppo
    python bench/algorithms.py -- seed=7               # extra Hydra overrides after "--" go to every run

Each run is ``python run.py algo=<preset> ...`` in its own run directory under
``bench/results/<timestamp>/<preset>``, with the knobs of the tiny task as every user gets them
(``conf/recipe/tiny_digits.yaml`` and ``conf/recipe_algo/tiny_digits_<preset>.yaml``). Evaluation (greedy,
held-out prompts) runs before training and after the last rollout. The table is printed and written to
``bench/results/algorithms_<timestamp>.{md,json}`` and ``bench/results/algorithms.{md,json}`` (latest).
A failed run is reported in the table and the script exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def presets() -> List[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "algo").glob("*.yaml") if not p.stem.startswith("_"))


def run_preset(preset: str, steps: int, run_dir: Path, extra: List[str], timeout: float) -> Dict[str, Any]:
    cmd = [sys.executable, "run.py", f"hydra.run.dir={run_dir}", f"algo={preset}", f"trainer.num_rollout={steps}",
           "eval.interval=0", "trainer.save_interval=0", "logging.progress=false", "logging.wandb=false", *extra]
    env = {**os.environ, "WANDB_MODE": "offline", "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # Ctrl-C: run.py stops Ray, the engines and the router cleanly
        timed_out = True
        proc.send_signal(signal.SIGINT)
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    row: Dict[str, Any] = {"preset": preset, "steps": steps, "wall_s": round(wall, 1), "run_dir": str(run_dir)}
    summary_path = run_dir / "summary.json"
    if timed_out or proc.returncode != 0 or not summary_path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "bench_stderr.log").write_text(stdout + "\n" + stderr)
        row["error"] = (f"timed out after {timeout:.0f}s" if timed_out
                        else (stderr.strip().splitlines() or ["(no output)"])[-1][:200])
        return row
    summary = json.loads(summary_path.read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    step_times = [r["perf/step_time"] for r in rows if "perf/step_time" in r]
    row.update(eval_initial=summary["eval_reward_initial"], eval_final=summary["eval_reward_final"],
               train_reward_last10=sum(train[-10:]) / max(len(train[-10:]), 1),
               train_reward_first10=sum(train[:10]) / max(len(train[:10]), 1),
               s_per_step=sum(step_times) / max(len(step_times), 1))
    return row


def fmt(x: Any, spec: str = ".3f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(rows: List[Dict[str, Any]]) -> str:
    head = ("| preset | eval reward (held-out, greedy) initial -> final | train reward, last 10 rollouts "
            "| s/step | wall s |\n|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['preset']} | FAILED: {r['error']} | | | {r['wall_s']:.0f} |")
            continue
        lines.append(f"| {r['preset']} | {fmt(r['eval_initial'])} -> {fmt(r['eval_final'])} | "
                     f"{fmt(r['train_reward_last10'])} | {fmt(r['s_per_step'], '.2f')} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="rollouts (training steps) per preset (default 150)")
    p.add_argument("--presets", default=",".join(presets()), help="comma-separated algo presets (default: all)")
    p.add_argument("--out", default=str(RESULTS), help="results folder (default bench/results, git-ignored)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is stopped (default 1800)")
    args = p.parse_args(argv)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out)
    runs = out / stamp
    names = [s for s in args.presets.split(",") if s]
    unknown = sorted(set(names) - set(presets()))
    if unknown:
        p.error(f"unknown presets {unknown}; choose from {presets()}")
    rows = []
    t0 = time.perf_counter()
    for k, name in enumerate(names, 1):
        print(f"[{k}/{len(names)}] {name}: {args.steps} rollouts ...", flush=True)
        row = run_preset(name, args.steps, runs / name, extra, args.timeout)
        rows.append(row)
        if "error" in row:
            print(f"    FAILED after {row['wall_s']:.0f}s: {row['error']} (log: {runs / name / 'bench_stderr.log'})",
                  flush=True)
        else:
            print(f"    eval {fmt(row['eval_initial'])} -> {fmt(row['eval_final'])}, train reward (last 10) "
                  f"{fmt(row['train_reward_last10'])}, {row['s_per_step']:.2f} s/step, {row['wall_s']:.0f}s",
                  flush=True)
    md = (f"# Algorithm presets on the embedded default ({args.steps} rollouts each)\n\n"
          f"{time.strftime('%Y-%m-%d %H:%M')}; overrides: {' '.join(extra) or '(none)'}; "
          f"total {time.perf_counter() - t0:.0f}s\n\n{table(rows)}\n")
    print("\n" + md)
    out.mkdir(parents=True, exist_ok=True)
    payload = json.dumps({"steps": args.steps, "overrides": extra, "rows": rows}, indent=2)
    for base in (f"algorithms_{stamp}", "algorithms"):
        (out / f"{base}.md").write_text(md)
        (out / f"{base}.json").write_text(payload)
    print(f"written: {out / f'algorithms_{stamp}.md'} (and .json); run dirs under {runs}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
