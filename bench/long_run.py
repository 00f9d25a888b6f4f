"""A long embedded run, watched for leaks: the memory of the driver, the trainer, the engine, the
router, the rollout manager and Ray's own processes (psutil: RSS, and USS, the memory private to a
process, which is where a leak grows; RSS also moves with shared pages the kernel reclaims under
memory pressure), sampled every few seconds, and the step time from metrics.jsonl. After a warm-up
(the first fifth of the steps) neither may grow: memory by at most 5 % and the median step time by
at most 10 %, between the window just after the warm-up and the last tenth of the run.

    python bench/long_run.py                       # 500 steps of the default (about 11 min on 2 idle cores)
    python bench/long_run.py --steps 100 -- rollout.batch_size=8   # extra Hydra overrides after "--"

It writes ``bench/measured/long_run_<steps>.md`` (the table) and ``long_run_<steps>.json`` (every
sample), and exits non-zero when something grew. Needs ``pip install psutil``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List

import psutil

ROOT = Path(__file__).resolve().parents[1]
TAG_ENV = "SLIME_HYDRA_BENCH_TAG"
GROUPS = ("driver", "trainer", "engine", "router", "manager", "ray")
MEMORY_TOLERANCE = 0.05
STEP_TIME_TOLERANCE = 0.10


def group_of(proc: psutil.Process) -> str:
    cmd = " ".join(proc.cmdline())
    if "run.py" in cmd:
        return "driver"
    if "TrainerActor" in cmd:
        return "trainer"
    if "slime_hydra.rollout.engines.embedded.server" in cmd:
        return "engine"
    if "sglang::router" in cmd or "sglang_router" in cmd:
        return "router"
    if "RolloutManager" in cmd:
        return "manager"
    return "ray"  # gcs, raylet, agents, idle workers, EngineActor (the engine server's owner)


def sample(tag: str) -> Dict[str, float]:
    """RSS and USS in MiB per group (``<group>_rss``, ``<group>_uss``), over this run's processes
    (they carry the tag in their environment)."""
    out = {f"{g}_{kind}": 0.0 for g in GROUPS for kind in ("rss", "uss")}
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TAG_ENV) != tag:
                continue
            mem = proc.memory_full_info()
            group = group_of(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        out[f"{group}_rss"] += mem.rss / 2**20
        out[f"{group}_uss"] += mem.uss / 2**20
    return out


def read_steps(path: Path) -> List[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def window(samples: List[dict], lo: float, hi: float, key: str) -> List[float]:
    return [s[key] for s in samples if lo <= s["step"] < hi]


def analyse(samples: List[dict], rows: List[dict], steps: int) -> dict:
    """Growth of each memory series and of the step time, from the window after the warm-up to the
    end; only growth counts against the tolerance (memory that shrinks is no leak)."""
    # the last step is left out: after its row the run evaluates, saves and shuts down
    warm, tail = steps // 5, steps - max(steps // 10, 1)
    early = (warm, warm + max(steps // 10, 1))
    out = {"warm_up_steps": warm, "early_window": list(early), "late_window": [tail, steps], "groups": {}}
    for g in [f"{g}_{kind}" for g in GROUPS for kind in ("rss", "uss")]:
        a, b = window(samples, *early, g), window(samples, tail, steps, g)
        if not a or not b or statistics.mean(a) == 0:
            continue
        ma, mb = statistics.mean(a), statistics.mean(b)
        out["groups"][g] = {"early_mib": round(ma, 1), "late_mib": round(mb, 1), "growth": round(mb / ma - 1, 4),
                            "ok": mb / ma - 1 <= MEMORY_TOLERANCE}
    times = {r["step"]: r["perf/step_time"] for r in rows if "perf/step_time" in r}
    a = [t for s, t in times.items() if early[0] <= s < early[1]]
    b = [t for s, t in times.items() if tail <= s < steps]
    if a and b:
        ma, mb = statistics.median(a), statistics.median(b)
        out["step_time"] = {"early_s": round(ma, 3), "late_s": round(mb, 3), "growth": round(mb / ma - 1, 4),
                            "ok": mb / ma - 1 <= STEP_TIME_TOLERANCE}
    out["ok"] = all(v["ok"] for v in out["groups"].values()) and out.get("step_time", {}).get("ok", False)
    return out


def report(result: dict, steps: int, overrides: List[str], wall_s: float) -> str:
    lines = [f"# Long run: {steps} steps of the embedded default on CPU", "",
             f"`python bench/long_run.py --steps {steps}" + (f" -- {' '.join(overrides)}" if overrides else "") + "`, "
             f"{wall_s / 60:.1f} min wall on {os.cpu_count()} cores (absolute times depend on what else the machine "
             "runs: the check is growth, not speed). Memory: mean RSS per group of processes over steps "
             f"{result['early_window'][0]}-{result['early_window'][1] - 1} (after {result['warm_up_steps']} warm-up "
             f"steps) and over steps {result['late_window'][0]}-{steps - 1}; step time: medians over the same windows.",
             "", "| what | early | late | growth | within |", "| --- | --- | --- | --- | --- |"]
    for g, v in result["groups"].items():
        name = g.replace("_", " ").replace("rss", "RSS").replace("uss", "USS")
        lines.append(f"| {name} | {v['early_mib']} MiB | {v['late_mib']} MiB | {v['growth']:+.1%} | "
                     f"{'yes' if v['ok'] else 'NO'} (5 %) |")
    if "step_time" in result:
        v = result["step_time"]
        lines.append(f"| step time | {v['early_s']} s | {v['late_s']} s | {v['growth']:+.1%} | "
                     f"{'yes' if v['ok'] else 'NO'} (10 %) |")
    lines += ["", f"Verdict: {'flat' if result['ok'] else 'GREW'}.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between memory samples")
    ap.add_argument("--out", default=str(ROOT / "bench" / "measured"))
    ap.add_argument("--from-json", help="analyse the samples of an earlier run (its long_run_<steps>.json) again")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = ap.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        steps = max(s for s, _ in saved["step_times"])
        rows = [{"step": s, "perf/step_time": t} for s, t in saved["step_times"]]
        result = analyse(saved["samples"], rows, steps)
        print(report(result, steps, saved.get("overrides", []), saved.get("wall_s", 0.0)))
        return 0 if result["ok"] else 1
    tag = uuid.uuid4().hex
    run_dir = ROOT / "bench" / "results" / f"long_run_{time.strftime('%Y%m%d_%H%M%S')}"
    cmd = [sys.executable, "run.py", f"hydra.run.dir={run_dir}", f"trainer.num_rollout={args.steps}",
           "logging.progress=false", "logging.wandb=false", "eval.interval=0", "eval.before_train=false",
           f"trainer.save_interval={max(args.steps // 5, 1)}", *args.overrides]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{run_dir.name}.out", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, TAG_ENV: tag}, stdout=log, stderr=subprocess.STDOUT)
    samples: List[dict] = []
    while proc.poll() is None:
        rows = read_steps(run_dir / "metrics.jsonl")
        if rows:
            samples.append({"step": rows[-1]["step"], "t": round(time.monotonic() - t0, 1), **sample(tag)})
        time.sleep(args.interval)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        print(f"the run failed (exit {proc.returncode}); see {run_dir}", file=sys.stderr)
        return 2
    rows = read_steps(run_dir / "metrics.jsonl")
    result = analyse(samples, rows, args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = report(result, args.steps, args.overrides, wall)
    (out / f"long_run_{args.steps}.md").write_text(text)
    (out / f"long_run_{args.steps}.json").write_text(json.dumps(
        {"result": result, "command": cmd[1:], "overrides": args.overrides, "wall_s": round(wall, 1),
         "samples": samples,
         "step_times": [[r["step"], r["perf/step_time"]] for r in rows if "perf/step_time" in r]}, indent=1))
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
