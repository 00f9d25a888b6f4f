"""Distillation and SFT side by side on the embedded default (tiny model, built-in digits task, CPU), one seed and
one student initialisation: GRPO alone (the default run), on-policy distillation from that run's final
checkpoint, SFT on the labels, and SFT then GRPO (experiment=sft_then_grpo). For each: the steps and seconds
(the steps' own time, start-up left out) until the held-out reward first reaches 0.9, and the final one.

    python bench/distill.py                   # writes OUT/result.md and result.json (bench/results/distill-TIME)
    python bench/distill.py --out DIR -- seed=1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from run import ROOT, commit, run_py
from slime_hydra.sweep.report import eval_reward, read_metrics

COMMON = ["eval.interval=5", "trainer.save_interval=0", "logging.progress=false", "logging.backends=[]"]
TARGET = 0.9


def reached(run_dir: Path) -> Dict[str, Any]:
    """Steps and step seconds to the first held-out reward >= TARGET (a staged run's stages in order), the last one."""
    steps, seconds, first, final = 0, 0.0, None, None
    for r in read_metrics(str(run_dir)):
        steps, seconds = (steps + 1, seconds + r["perf/step_time"]) if "perf/step_time" in r else (steps, seconds)
        if (reward := eval_reward(r)) is not None:
            final = reward
            if first is None and final >= TARGET:
                first = {"steps_to_target": steps, "seconds_to_target": round(seconds, 1)}
    return {**(first or {"steps_to_target": None, "seconds_to_target": None}), "steps": steps,
            "final_reward": final}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="default bench/results/distill-TIME")
    args = ap.parse_args(argv[:cut])
    extra = argv[cut + 1:]
    out = Path(args.out or ROOT / "bench" / "results" / f"distill-{time.strftime('%Y%m%d-%H%M%S')}")
    grpo = out / "grpo"
    runs = {  # label -> overrides
        "grpo": [],  # the default run; its final checkpoint is the teacher
        "opd": ["algo=opd", f"teacher.path={grpo}/checkpoints/step_000150/hf", "trainer.num_rollout=60"],
        "sft": ["algo=sft", "trainer.num_rollout=60"],
        "sft_then_grpo": ["experiment=sft_then_grpo"],
    }
    results: Dict[str, Dict[str, Any]] = {}
    for label, overrides in runs.items():
        result = run_py([*COMMON, *overrides, *extra], out / label, 3600)
        results[label] = {"command": result["command"], "returncode": result["returncode"],
                          **reached(out / label)}
    record = {"scenario": "distill", "date": time.strftime("%Y-%m-%d"), "commit": commit(), "device": "cpu",
              "target": TARGET, "results": results}
    (out / "result.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# distill: GRPO, OPD, SFT, SFT then GRPO on the embedded default (held-out {TARGET})", "",
             f"{record['date']}, commit {record['commit']}", "",
             "| run | steps | steps to 0.9 | step seconds to 0.9 | final held-out reward |", "|---|---|---|---|---|"]
    for label, r in results.items():
        lines.append(f"| {label} | {r['steps']} | {r['steps_to_target']} | {r['seconds_to_target']} | "
                     f"{r['final_reward']} |")
    lines += ["", *(f"- {k}: `{r['command']}`" for k, r in results.items())]
    (out / "result.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[4:]))
    print(f"written: {out / 'result.md'}")
    return 0 if all(r["returncode"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
