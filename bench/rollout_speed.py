"""Why a rollout on the lent H200 takes 0.7 s in one run and 1.0 s in another: a table from `bench/sglang_gpu.py`'s
result files (their ``rollouts``: each step's rollout with SGLang's batches, the GPU's power, the CPUs) and, where
the run had one, `CpuProbe`'s file (how fast each CPU ran the same Python, moment by moment).

    python bench/rollout_speed.py NAME=RESULT.json[:PROBE.txt] ...

Steps after the first (the first carries the warm-up) of each run: the rollout's median and range; SGLang's decode
rate (tokens a second over its decode log lines after the first, which holds the prefill); the GPU's power while
busy; the CPUs SGLang's scheduler ran on; the correlations over all steps of all runs. With a probe: the probe's
time in each rollout against its run's median, and its correlation with the rollout."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu import harness as h  # noqa: E402

RUN_PHASES = ("sglang", "sglang_warm", "sglang_variant")


def steps(result: Dict[str, Any]) -> Tuple[str, List[Dict[str, Any]], Optional[float]]:
    """The run phase of one result file with rollouts, its steps after the first, its start-up seconds."""
    for phase in RUN_PHASES:
        run = result.get(phase) or {}
        if run.get("rollouts"):
            return phase, run["rollouts"][1:], run.get("startup_s")
    raise SystemExit(f"no run phase with rollouts ({', '.join(RUN_PHASES)}) in the result file")


def decode_rate(step: Dict[str, Any]) -> Optional[float]:
    rates = step["decode_tokens_per_s"][1:]
    return statistics.fmean(rates) if rates else None


def corr(xs: List[Optional[float]], ys: List[Optional[float]]) -> str:
    pairs = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    if len(pairs) < 3:
        return ""
    return f"{statistics.correlation([p[0] for p in pairs], [p[1] for p in pairs]):+.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="NAME=RESULT.json[:PROBE.txt]")
    args = p.parse_args()
    rows, everything = [], []
    for spec in args.runs:
        name, _, paths = spec.partition("=")
        result_path, _, probe_path = paths.partition(":")
        with open(result_path) as f:
            phase, got, startup = steps(json.load(f))
        rollout = [s["rollout_s"] for s in got]
        rate = [decode_rate(s) for s in got]
        power = [(s.get("gpu") or {}).get("gpu0", {}).get("power_w_mean") for s in got]
        cpus = sorted({c for s in got for c in ((s.get("cpu") or [{}])[0].get("on_cpus") or [])})
        probe = [(s.get("probe") or {}).get("all_cpus") for s in got]
        everything += zip(rollout, rate, power, probe)
        rows.append([name, phase, h.cell(startup, ".1f"), len(got), h.cell(statistics.median(rollout), ".3f"),
                     f"{min(rollout):.3f}-{max(rollout):.3f}", h.cell(statistics.median(r for r in rate if r), ".0f"),
                     f"{min(r for r in rate if r):.0f}-{max(r for r in rate if r):.0f}",
                     h.cell(statistics.median(w for w in power if w), ".0f"), ",".join(map(str, cpus)) or "?",
                     corr(rollout, probe) if probe_path else ""])
        if probe_path:
            times = [x * 1e3 for _, _, x in h.CpuProbe.read(probe_path).rows]
            deciles = statistics.quantiles(times, n=10)
            print(f"{name}: the probe's time, ms: median {statistics.median(times):.2f}, first decile "
                  f"{deciles[0]:.2f}, last {deciles[-1]:.2f} ({len(times)} probes)")
    print()
    print("\n".join(h.table(["run", "phase", "start s", "steps", "rollout s", "range", "decode tok/s", "range",
                             "GPU W", "scheduler on CPUs", "rollout ~ probe"], rows)))
    rollout, rate, power, probe = (list(x) for x in zip(*everything))
    print(f"\nover all {len(rollout)} steps: rollout ~ decode rate {corr(rollout, rate)}, rollout ~ GPU power "
          f"{corr(rollout, power)}, decode rate ~ GPU power {corr(rate, power)}")


if __name__ == "__main__":
    main()
