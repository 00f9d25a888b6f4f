"""Run a named bench scenario of bench/scenarios.yaml and write what it measured.

A scenario is ``python run.py`` with overrides on a model shape: a ``warm`` part of the steps that the
numbers leave out, a ``measure`` part they are the median of, ``runs`` repeats (the first on cold caches),
``variants`` (more runs, each with more overrides), and an optional ``baseline`` on the same workload
(``trl``: TRL's GRPOTrainer; ``sglang``: the same requests sent to a raw SGLang server), and a ``teacher`` shape
(on-policy distillation from random weights of it). A ``script``
scenario runs a script instead (bench/chaos.py). The numbers come from each run's ``metrics.jsonl``
(``perf/*``, ``startup/*``) and ``summary.json``; they are printed and written to ``OUT/result.json`` and
``OUT/result.md``, the file to copy into bench/measured/ when a doc quotes it.

    python bench/run.py --list
    python bench/run.py default --steps 5                 # the embedded default on CPU, 5 steps
    python bench/run.py anchor --dry-run                  # the run.py command lines, nothing run
    python bench/run.py anchor -- trainer.compile=false   # more overrides for every run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "bench" / "scenarios.yaml"
WORK = Path(os.environ.get("BENCH_WORK", "/tmp/slime_hydra_bench"))  # checkpoints of a shape, prompts
KEYS = {"what", "device", "gpus", "shape", "teacher", "workload", "overrides", "warm", "measure", "runs", "variants",
        "baseline", "script", "timeout_s"}
BASELINES = ("trl", "sglang")
# column -> (metric, how the measured steps combine); the first row's startup/total_s is the start
STEP_METRICS = {"step_s": "perf/step_time", "rollout_s": "perf/rollout_time", "train_s": "perf/train_time",
                "sync_s": "perf/weight_sync_time", "tokens_per_s": "perf/tokens_per_s"}


def load(path: Path = SCENARIOS) -> Dict[str, Dict[str, Any]]:
    """The scenarios by name; a scenario with a key the runner does not know is refused."""
    scenarios = yaml.safe_load(path.read_text())["scenarios"]
    for name, sc in scenarios.items():
        unknown = set(sc) - KEYS
        if unknown:
            raise ValueError(f"{path.name}: scenario {name} has unknown keys {sorted(unknown)}")
        if not set(sc.get("baseline") or []) <= set(BASELINES):
            raise ValueError(f"{path.name}: scenario {name}: a baseline is one of {BASELINES}")
    return scenarios


def workload(sc: Dict[str, Any]):
    """The random-weight checkpoint and prompts of a scenario's shape (bench/gpu/workload.py)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu.workload import Workload

    w = sc.get("workload") or {}
    return Workload(str(WORK), sc["shape"], w.get("prompts", 8), w.get("samples", 8), w.get("new_tokens", 256),
                    prompt_words=w.get("prompt_words", 64), device=sc.get("device", "cpu"))


def teacher_workload(sc: Dict[str, Any]):
    return workload({**sc, "shape": sc["teacher"]})


def overrides(sc: Dict[str, Any], variant: Optional[str] = None, steps: Optional[int] = None,
              extra: List[str] = ()) -> List[str]:
    """run.py's overrides for a scenario (and one of its variants): the workload's (model, checkpoint, prompts,
    batch) where it names a shape, the steps (``warm + measure``), the scenario's, the variant's, ``extra``."""
    out: List[str] = []
    if sc.get("shape"):
        w = workload(sc)
        out += [f"model={w.preset}", f"model.path={w.ckpt}", "model.tokenizer=null", "data=jsonl",
                f"data.path={w.data}", "data.apply_chat_template=false", "eval.datasets=[]",
                f"rollout.batch_size={w.prompts}", f"rollout.n_samples_per_prompt={w.samples}",
                f"rollout.max_response_len={w.new_tokens}"]
    if sc.get("teacher"):  # on-policy distillation from random weights of another shape, built as the student's
        out += [f"+model@teacher={sc['teacher']}", f"teacher.path={teacher_workload(sc).ckpt}"]
    total = steps or ((sc.get("warm") or 0) + sc["measure"] if sc.get("measure") else None)
    if total:
        out.append(f"trainer.num_rollout={total}")
    out += flat(sc.get("overrides"))
    if variant:
        out += flat(sc["variants"][variant])
    return out + list(extra)


def flat(items: Any) -> List[str]:
    """Overrides as a flat list of strings (the scenario file nests its shared lists)."""
    if isinstance(items, (list, tuple)):
        return [o for item in items for o in flat(item)]
    return [] if items is None else [str(items)]


def runs_of(sc: Dict[str, Any]) -> List[tuple]:
    """(label, variant) of every run.py run of a scenario, in order: the repeats, then the variants."""
    n = sc.get("runs", 1)
    out = [("run" if n == 1 else f"run{i + 1}", None) for i in range(n)]
    return out + [(v, v) for v in sc.get("variants") or {}]


def read_rows(path: Path) -> List[Dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def numbers(rows: List[Dict[str, Any]], summary: Dict[str, Any], warm: int = 1) -> Dict[str, Any]:
    """What a run measured: the start (launch to the first step done, ``startup/total_s``; summary.json's
    ``startup`` where the run completed), the median of each
    ``perf/*`` over the steps after ``warm`` (all steps if there are no more), the largest log-prob gap and
    trainer peak, the rewards."""
    steps = [r for r in rows if "perf/step_time" in r]
    measured = [r for r in steps if r["step"] > warm] or steps
    out: Dict[str, Any] = {"steps": len(steps), "measured_steps": len(measured)}
    start = (summary.get("startup") or {}).get("total_s")
    start = start or next((r["startup/total_s"] for r in rows if "startup/total_s" in r), None)
    if start is not None:
        out["start_s"] = start
    for col, key in STEP_METRICS.items():
        vals = [r[key] for r in measured if key in r]
        if vals:
            out[col] = statistics.median(vals)
    for col, key in (("logprob_gap", "train/train_rollout_logprob_abs_diff"), ("peak_gib", "train/gpu_peak_gib")):
        vals = [r[key] for r in rows if key in r]
        if vals:
            out[col] = max(vals)
    for key in ("train_reward_last", "eval_reward_final", "wall_s"):
        if isinstance(summary.get(key), (int, float)) and summary[key] == summary[key]:  # not NaN
            out[key] = summary[key]
    return out


def run_py(args: List[str], run_dir: Path, timeout_s: float) -> Dict[str, Any]:
    """``python run.py args hydra.run.dir=run_dir`` (its console in ``run_dir``.log), stopped with its process
    group after ``timeout_s``; its numbers."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "run.py", *args, f"hydra.run.dir={run_dir}"]
    print("$ python run.py " + " ".join(args), flush=True)
    t0 = time.perf_counter()
    with open(f"{run_dir}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)
            rc = proc.wait()
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {"command": "python run.py " + " ".join(args), "returncode": rc,
            "elapsed_s": round(time.perf_counter() - t0, 1), "run_dir": str(run_dir),
            **numbers(read_rows(run_dir / "metrics.jsonl"), summary)}


def baseline(kind: str, name: str, sc: Dict[str, Any], path: Path) -> None:
    """In a child process (``--baseline``): TRL, or raw SGLang, on the scenario's checkpoint, prompts and batch."""
    sys.path.insert(0, str(ROOT))
    w = workload(sc)
    w.build()
    out: Dict[str, Any] = {"baseline": kind}
    try:
        if kind == "trl":
            from gpu.trl_step import phase_trl

            phase_trl(w, (sc.get("warm") or 1) + 3, 16, out)
        else:
            from gpu.sglang_server import phase_raw

            phase_raw(w, "colocated", out)
    finally:
        path.write_text(json.dumps(out, indent=1, default=str) + "\n")


def table(results: Dict[str, Dict[str, Any]]) -> List[str]:
    cols = ["start_s", *STEP_METRICS, "logprob_gap", "peak_gib", "train_reward_last", "eval_reward_final"]
    cols = [c for c in cols if any(c in r for r in results.values())]
    lines = ["| run | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for label, r in results.items():
        cells = [format(r[c], ".4g") if isinstance(r.get(c), (int, float)) else "-" for c in cols]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def commit() -> str:
    """The code measured: ``BENCH_COMMIT`` where the tree is a copy whose git history is not the session's (the lent
    GPU machine's), else git's HEAD."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except OSError:
        return ""


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", help="a scenario of bench/scenarios.yaml")
    ap.add_argument("--list", action="store_true", help="list the scenarios")
    ap.add_argument("--device", choices=("cpu", "cuda"), help="where it runs (default: the scenario's)")
    ap.add_argument("--steps", type=int, help="steps a run (default: the scenario's warm + measure)")
    ap.add_argument("--out", help="where runs and results go (default bench/results/NAME-TIME)")
    ap.add_argument("--dry-run", action="store_true", help="print the run.py command lines, run nothing")
    ap.add_argument("--baseline", choices=BASELINES, help=argparse.SUPPRESS)  # the child of a baseline
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after "--": more run.py overrides for every run
    args = ap.parse_args(argv[:cut])
    args.overrides = argv[cut + 1:]
    scenarios = load()
    if args.list or not args.name:
        for name, sc in scenarios.items():
            print(f"{name:20} {sc.get('device', 'cpu'):5} {sc.get('what', '')}")
        return 0
    sc = dict(scenarios[args.name])
    sc["device"] = args.device or sc.get("device", "cpu")
    out = Path(args.out or ROOT / "bench" / "results" / f"{args.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.baseline:
        baseline(args.baseline, args.name, sc, Path(args.out))
        return 0
    if sc.get("script"):
        cmd = [sys.executable, *map(str, sc["script"]), *args.overrides]
        print("$ " + " ".join(cmd[1:]), flush=True)
        return 0 if args.dry_run else subprocess.call(cmd, cwd=ROOT)
    if args.dry_run:
        for label, variant in runs_of(sc):
            print(f"{label}: python run.py " + " ".join(overrides(sc, variant, args.steps, args.overrides)))
        return 0
    if sc["device"] == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(f"{args.name} runs on CUDA GPUs (bench/README.md says how); none here", file=sys.stderr)
            return 2
        # the memory plan sizes micro-batches for this card, not the config's default one
        gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        args.overrides = [f"parallelism.gpu_memory_gib={gib:.1f}", *args.overrides]
    if sc.get("shape"):
        workload(sc).build()
    if sc.get("teacher"):
        teacher_workload(sc).build()
    results: Dict[str, Dict[str, Any]] = {}
    for label, variant in runs_of(sc):
        results[label] = run_py(overrides(sc, variant, args.steps, args.overrides), out / label,
                                sc.get("timeout_s", 3600))
    for kind in sc.get("baseline") or []:
        path = out / f"{kind}.json"
        subprocess.call([sys.executable, __file__, args.name, "--baseline", kind, "--out", str(path)], cwd=ROOT,
                        timeout=sc.get("timeout_s", 3600))
        raw = json.loads(path.read_text()) if path.exists() else {}
        got = numbers(raw.get("rows") or [], {}) if kind == "trl" else \
            {"start_s": raw.get("startup_s"), "rollout_s": (raw.get("grpo_step_requests") or {}).get("median_s")}
        results[kind] = {**got, "returncode": raw.get("returncode", 0 if raw.get("startup_s") else 1), "raw": raw}
    record = {"scenario": args.name, "what": sc.get("what"), "date": datetime.date.today().isoformat(),
              "commit": commit(), "device": sc["device"], "results": results}
    if sc["device"] == "cuda":
        record["gpu"] = torch.cuda.get_device_name(0)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    where = f", {record['gpu']}" if record.get("gpu") else ""
    lines = [f"# {args.name}: {sc.get('what', '')}", "", f"{record['date']}, commit {record['commit']}{where}", "",
             *table(results), "", *(f"- {k}: `{r['command']}`" for k, r in results.items() if "command" in r)]
    (out / "result.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[4:]))
    print(f"written: {out / 'result.md'}")
    return 0 if all(r.get("returncode", 0) == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
