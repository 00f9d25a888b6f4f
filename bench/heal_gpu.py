"""Self-healing on one H200 with real SGLang (docs/faults.md): three faults, one run each, colocated
(torch backend, CUDA IPC weight push, both offloads on), ``rollout.fault_tolerance=true``:

  push      the SGLang server SIGKILLed inside a weight push (held there by the SLIME_HYDRA_TEST_HOLD test
            hook, utils/testpoint.py: the engines are paused for the push of v3)
  startup   the SGLang server SIGKILLed while it starts (as soon as its process exists)
  trainer   the trainer rank SIGKILLed mid-step (after row 3; the checkpoint of step 2 is loaded)

Each run must finish with every step's row once. Measured per fault: seconds from the kill to the healing
(the fleet's restart, or the driver's rebuild from heal.jsonl) and to the next row; GPU memory (nvidia-smi,
MiB used on the GPU) sampled at every row: the largest before the fault and after the healing must agree
within ``--tolerance-mib`` (no leaked server or trainer holding memory); no process of the killed server
may hold GPU memory afterwards.

    bash bench/heal_gpu.sh                  # on the device (see the .sh), writes $OUT/heal_gpu.json
    python bench/heal_gpu.py --cpu          # a dry run of this script on CPU (embedded engine, no nvidia-smi)

Reuses bench/sglang_gpu.py's checkpoint (a random Qwen3-0.6B-shaped one) and run.py command line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

import sglang_gpu  # noqa: E402 - bench/ is on the path from here

FAULTS = ("push", "startup", "trainer")
STEPS = 6


def gpu_used_mib() -> Optional[int]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def gpu_pids() -> List[int]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
        return [int(x) for x in out.split()]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return []


def rows(run_dir: str) -> List[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def run_token(run_dir: str) -> Optional[str]:
    try:
        return json.load(open(os.path.join(run_dir, "driver.json")))["token"]
    except (OSError, ValueError, KeyError):
        return None


def processes(title: bytes, token: str) -> List[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{p}/cmdline", "rb").read()
            env = open(f"/proc/{p}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if title in cmd and f"SLIME_HYDRA_RUN_TOKEN={token}".encode() in env:
            out.append(int(p))
    return out


def children(pid: int) -> List[int]:
    try:
        kids = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return []
    return [int(k) for k in kids]


def servers(run_dir: str) -> List[int]:
    """The engine servers of this run: the children of its ray::EngineActor workers."""
    token = run_token(run_dir)
    return [c for a in processes(b"ray::EngineActor", token) for c in children(a)] if token else []


def trainers(run_dir: str) -> List[int]:
    token = run_token(run_dir)
    return processes(b"ray::TrainerActor", token) if token else []


def one_fault(fault: str, args, out: Dict[str, Any]) -> None:
    run_dir = os.path.join(sglang_gpu.WORK, f"heal_{fault}")
    hold = run_dir + "_hold"
    subprocess.run(["rm", "-rf", run_dir, hold])
    os.makedirs(hold)
    extra = (f"rollout.fault_tolerance=true trainer.save_interval=2 rollout.health_check_interval_s=5 "
             f"rollout.health_check_timeout_s=120 {args.overrides}")
    phase = "embedded" if args.cpu else "sglang_offload"
    cmd = [sys.executable, os.path.join(ROOT, "run.py"), *sglang_gpu.run_overrides("colocated", phase, STEPS, extra),
           f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "SLIME_HYDRA_TEST_HOLD": "push:3", "SLIME_HYDRA_TEST_HOLD_DIR": hold} if fault == "push" \
        else dict(os.environ)
    res: Dict[str, Any] = {"command": " ".join(cmd[1:]), "memory_at_rows_mib": {}}
    out[fault] = res
    log_file = open(run_dir + ".out", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    t0 = time.monotonic()
    killed_at, seen = None, 0
    try:
        while proc.poll() is None and time.monotonic() - t0 < args.limit:
            got = rows(run_dir)
            if len(got) > seen:  # a row was written: the engines are awake, the step done
                seen = len(got)
                res["memory_at_rows_mib"][got[-1]["step"]] = gpu_used_mib()
                if killed_at is not None and "first_row_after_s" not in res:
                    res["first_row_after_s"] = round(time.monotonic() - killed_at, 1)
            if killed_at is None:
                victims = {"push": servers(run_dir) if os.path.exists(os.path.join(hold, "push_3")) else [],
                           "startup": servers(run_dir),
                           "trainer": trainers(run_dir) if seen >= 4 else []}[fault]  # rows 0..3: step 4 runs
                if victims:
                    res["memory_before_kill_mib"] = gpu_used_mib()
                    res["killed_pid"] = victims[0]
                    res["killed_at_row"] = got[-1]["step"] if got else None
                    os.kill(victims[0], signal.SIGKILL)
                    killed_at = time.monotonic()
                    if fault == "push":
                        time.sleep(0.5)
                        open(os.path.join(hold, "push_3.go"), "w").close()
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
            res["error"] = f"did not finish within {args.limit}s"
    finally:
        proc.wait()
        log_file.close()
    final = rows(run_dir)
    res["returncode"] = proc.returncode
    res["steps"] = [r["step"] for r in final]
    res["rows_once"] = res["steps"] == sorted(set(res["steps"])) and res["steps"][-1:] == [STEPS]
    res["engine_restarts"] = sum(r.get("rollout/engine_restarts", 0) for r in final)
    heal_path = os.path.join(run_dir, "heal.jsonl")
    res["driver_heals"] = [json.loads(line) for line in open(heal_path)] if os.path.exists(heal_path) else []
    manager_log = os.path.join(run_dir, "logs", "rollout_manager.log")
    text = open(manager_log).read() if os.path.exists(manager_log) else ""
    res["engine_restart_s"] = [float(s) for s in re.findall(r"engine \d+ restarted at \S+ in ([\d.]+)s", text)]
    res["heal_s"] = res["driver_heals"][0]["seconds"] if res["driver_heals"] else (
        res["engine_restart_s"][0] if res["engine_restart_s"] else None)
    res["killed_pid_on_gpu"] = res.get("killed_pid") in gpu_pids()
    mem = {int(k): v for k, v in res["memory_at_rows_mib"].items() if v is not None}
    before = [v for k, v in mem.items() if k < (res.get("killed_at_row") or 0)]
    after = [v for k, v in mem.items() if k > (res.get("killed_at_row") or 0) + 1]
    res["memory_before_max_mib"], res["memory_after_max_mib"] = (max(before) if before else None,
                                                                 max(after) if after else None)
    res["memory_back"] = None if not (before and after) else max(after) <= max(before) + args.tolerance_mib
    res["pass"] = (proc.returncode == 0 and res["rows_once"] and "killed_pid" in res and not res["killed_pid_on_gpu"]
                   and res["memory_back"] is not False and (res["engine_restarts"] > 0 or bool(res["driver_heals"])))
    print(json.dumps({fault: {k: v for k, v in res.items() if k != "command"}}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--limit", type=float, default=480.0, help="seconds per fault's run (two SGLang start-ups)")
    ap.add_argument("--tolerance-mib", type=int, default=1024)
    ap.add_argument("--cpu", action="store_true", help="a dry run on CPU: the tiny model, the embedded engine")
    ap.add_argument("--overrides", default="", help="more run.py overrides, space-separated")
    args = ap.parse_args()
    if args.cpu:
        sglang_gpu.dry_run_on_cpu()
    sglang_gpu.build()
    out: Dict[str, Any] = {"device": "cpu" if args.cpu else "cuda"}
    os.makedirs(args.out, exist_ok=True)
    for fault in args.faults.split(","):
        one_fault(fault, args, out)
        for name, obj in ((f"heal_gpu_{fault}.json", {"device": out["device"], fault: out[fault]}),
                          ("heal_gpu.json", out)):  # one file per fault: one device call each fits best
            tmp = os.path.join(args.out, name + ".tmp")
            with open(tmp, "w") as f:
                json.dump(obj, f, indent=1)
            os.replace(tmp, os.path.join(args.out, name))
    return 0 if all(out[f].get("pass") for f in args.faults.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
