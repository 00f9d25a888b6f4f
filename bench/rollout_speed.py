"""Why a rollout on the lent H200 takes 0.7 s in one run and 1.0 s in another: a table from `bench/sglang_gpu.py`'s
result files (their ``rollouts``: each step's rollout with SGLang's batches, the GPU's power, the CPUs) and, where
the run had one, `CpuProbe`'s file (how fast each CPU ran the same Python, moment by moment).

    python bench/rollout_speed.py NAME=RESULT.json[:PROBE.txt] ...

Steps after the first (the first carries the warm-up) of each run: the rollout's median and range; SGLang's decode
rate (tokens a second over its decode log lines after the first, which holds the prefill); the GPU's power while
busy; the CPUs SGLang's scheduler ran on; the correlations over all steps of all runs (with the pairs they rest on).
With a probe: its correlation with the rollout, and the range of its time in the rollouts against its run's median
(a run's own scale: it compares moments of one run, not runs)."""

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


def probe_spread(path: str) -> str:
    times = [x * 1e3 for _, _, x in h.CpuProbe.read(path).rows]
    if len(times) < 10:
        return f"{len(times)} probes: too few"
    deciles = statistics.quantiles(times, n=10)
    return (f"median {statistics.median(times):.2f}, first decile {deciles[0]:.2f}, last {deciles[-1]:.2f} "
            f"({len(times)} probes)")


def decode_rate(step: Dict[str, Any]) -> Optional[float]:
    rates = step["decode_tokens_per_s"][1:]
    return statistics.fmean(rates) if rates else None


def corr(xs: List[Optional[float]], ys: List[Optional[float]]) -> str:
    """Pearson's r over the pairs where both are known, with how many; empty under 3 pairs or for a constant."""
    pairs = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    try:
        return f"{statistics.correlation([p[0] for p in pairs], [p[1] for p in pairs]):+.2f} ({len(pairs)})"
    except statistics.StatisticsError:  # under 2 pairs, or one side constant
        return "" if len(pairs) < 3 else "constant"


def spread(xs: List[Optional[float]], fmt: str) -> Tuple[str, str]:
    """The median and the range of the known values, formatted; '-' where none is known."""
    known = [x for x in xs if x is not None]
    if not known:
        return "-", "-"
    return format(statistics.median(known), fmt), f"{min(known):{fmt}}-{max(known):{fmt}}"


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
        probed = [corr(rollout, probe), spread(probe, ".3f")[1]] if probe_path else ["", ""]
        rows.append([name, phase, h.cell(startup, ".1f"), len(got), *spread(rollout, ".3f"), *spread(rate, ".0f"),
                     spread(power, ".0f")[0], ",".join(map(str, cpus)) or "?", *probed])
        if probe_path:
            print(f"{name}: the probe's time, ms: {probe_spread(probe_path)}")
    print()
    print("\n".join(h.table(["run", "phase", "start s", "steps", "rollout s", "range", "decode tok/s", "range",
                             "GPU W", "scheduler on CPUs", "rollout ~ probe (steps)", "probe / its median"], rows)))
    if not everything:
        return
    rollout, rate, power, probe = (list(x) for x in zip(*everything))
    print(f"\nover all {len(rollout)} steps (pairs): rollout ~ decode rate {corr(rollout, rate)}, rollout ~ GPU power "
          f"{corr(rollout, power)}, decode rate ~ GPU power {corr(rate, power)}")


if __name__ == "__main__":
    main()
