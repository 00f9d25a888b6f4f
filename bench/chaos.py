"""Chaos: kill a random part of a run at a random moment, several times per run, and check that the
healed run computes what an uninterrupted run of the same seed computes (docs/faults.md).

Parts: an engine server, the router, the rollout manager actor, a trainer rank (their processes
SIGKILLed), and the driver itself (SIGKILL, then ``trainer.resume=auto`` in the same run directory).
Moments: ``push`` (inside a weight push: the run is held there by the ``SLIME_HYDRA_TEST_HOLD`` test hook,
utils/testpoint.py, since a push lasts milliseconds on CPU), ``busy`` (an engine has requests: mid-rollout
or mid-eval), ``row`` (just after a metrics row appeared: the checkpoint save and the next rollout's
start), ``startup`` (as soon as the part's process exists) and ``random`` (0-3 s after the last event).
For trainer and manager deaths the driver records the moment it was in (``heal.jsonl``).

The check: every step has exactly one row, and the rows' reward and data-position columns (and every other
column but timings, the log-prob gap's float noise and the fault counters) equal the reference run's.

    python bench/chaos.py --runs 10 --kills 6            # writes bench/measured/chaos.md
    python bench/chaos.py --runs 1 --kills 3 --no-write  # one short run (tests/launch/test_heal.py)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("engine", "router", "manager", "trainer", "driver")
MOMENTS = ("push", "busy", "row", "startup", "random")
ARGS = ["trainer.num_rollout=8", "trainer.save_interval=2", "rollout.batch_size=8", "rollout.n_samples_per_prompt=8",
        "eval.interval=4", "logging.progress=false", "logging.backends=[]",
        "rollout.fault_tolerance=true", "rollout.health_check_interval_s=2", "rollout.health_check_timeout_s=20",
        "rollout.max_engine_restarts_per_hour=100", "trainer.max_restarts_per_hour=100"]
IGNORED = ("perf/", "heal/", "startup/", "rollout/engine_restarts", "rollout/requeued_requests",
           "rollout/generate_requests", "train/train_rollout_logprob_abs_diff")


def metrics(run_dir: Path) -> List[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def comparable(rows: List[dict]) -> List[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(IGNORED)} for r in rows]


def start(run_dir: Path, overrides: List[str], env: Dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "run.py", f"hydra.run.dir={run_dir}", *overrides]
    log = open(run_dir.parent / f"{run_dir.name}.driver.log", "a")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)


def _environ(pid: str) -> List[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def pids_of(part: str, run_dir: Path) -> List[int]:
    """The part's live processes in this run: engine servers by their model path (in the run directory),
    the others by the run's lease token (launch/lease.py) and their process title."""
    if part == "engine":
        needle = f"--model-path\0{run_dir}/".encode()
        return [int(p) for p in filter(str.isdigit, os.listdir("/proc"))
                if b"slime_hydra.rollout.engines.embedded.server" in _cmdline(p) and needle in _cmdline(p)]
    try:
        token = json.loads((run_dir / "driver.json").read_text())["token"]
    except (OSError, ValueError, KeyError):
        return []
    mark = f"SLIME_HYDRA_RUN_TOKEN={token}".encode()
    titles = {"router": (b"sglang_router.launch_router", b"sglang::router"), "manager": (b"ray::RolloutManager",),
              "trainer": (b"ray::TrainerActor",)}[part]
    return [int(p) for p in filter(str.isdigit, os.listdir("/proc"))
            if any(t in _cmdline(p) for t in titles) and mark in _environ(p)]


def engine_busy(run_dir: Path) -> bool:
    import httpx

    for pid in pids_of("engine", run_dir):
        cmd = _cmdline(str(pid)).split(b"\0")
        try:
            port = int(cmd[cmd.index(b"--port") + 1])
            load = httpx.get(f"http://127.0.0.1:{port}/v1/loads", timeout=1).json()["loads"][0]
        except Exception:  # noqa: BLE001 - not up, or gone
            continue
        if load["num_reqs"] > 0:
            return True
    return False


class Chaos:
    def __init__(self, run_dir: Path, kills: int, rng: random.Random, steps: int, hold_dir: Path):
        self.run_dir, self.left, self.rng, self.steps, self.hold_dir = run_dir, kills, rng, steps, hold_dir
        self.record: List[dict] = []
        self.released: set = set()  # push moments passed before their kill's turn (let go at once)

    def plan(self) -> List[tuple]:
        """(part, moment, step) per kill: push moments at distinct steps (held there by the test hook)."""
        out = []
        push_steps = sorted(self.rng.sample(range(2, self.steps), k=min(self.steps - 2, self.left)))
        for i in range(self.left):
            part = self.rng.choice(PARTS)
            moment = self.rng.choice(MOMENTS if i else MOMENTS + ("startup",) * 2)
            if (moment == "startup" and i) or (moment == "push" and not push_steps):
                moment = "random"
            out.append((part, moment, push_steps.pop(0) if moment == "push" else None))
        return out

    def run(self, args: List[str]) -> dict:
        plan = self.plan()
        holds = ",".join(f"push:{s}" for _, m, s in plan if m == "push")
        env = {**os.environ, "SLIME_HYDRA_TEST_HOLD": holds, "SLIME_HYDRA_TEST_HOLD_DIR": str(self.hold_dir)}
        self.hold_dir.mkdir(parents=True, exist_ok=True)
        proc = start(self.run_dir, args, env)
        t0 = time.monotonic()
        error = None
        try:
            for part, moment, step in plan:
                proc = self.kill(proc, part, moment, step, args, env)
                if proc is None:
                    break
            if proc is not None and proc.wait(timeout=1200) != 0:
                raise RuntimeError(f"the run failed (exit {proc.returncode}); see {self.run_dir}.driver.log")
        except RuntimeError as e:  # a failed run is a result too (its steps count as lost)
            error = str(e)
            if proc is not None and proc.poll() is None:  # a run that hangs: killed, with what it started
                proc.kill()
                proc.wait()
                subprocess.run([sys.executable, "-c", "import sys; from slime_hydra.launch.lease import RunLease; "
                                "RunLease(sys.argv[1]).__enter__()", str(self.run_dir)], cwd=ROOT, check=False)
        return {"seconds": round(time.monotonic() - t0, 1), "kills": self.record, "error": error}

    def kill(self, proc: subprocess.Popen, part: str, moment: str, step: Optional[int], args, env):
        """Wait for the moment, SIGKILL the part; returns the driver process (a new one after a driver kill),
        None if the run ended before the moment came."""
        deadline = time.monotonic() + 600
        rows_before = len(metrics(self.run_dir))
        if step in self.released:  # the run went through that push while an earlier kill was waited for
            moment, step = "random", None
        marker = self.hold_dir / f"push_{step}" if step is not None else None
        wait_from = time.monotonic()
        delay = self.rng.uniform(0.0, 3.0)
        while True:
            if proc.poll() is not None:
                if marker is not None and marker.exists():
                    (self.hold_dir / f"push_{step}.go").touch()
                return None if proc.returncode == 0 else self._failed(proc)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{moment} never came for a kill of the {part}")
            self._release_others(step)
            pids = [proc.pid] if part == "driver" else pids_of(part, self.run_dir)
            ready = {"push": marker is not None and marker.exists(),
                     "busy": engine_busy(self.run_dir),
                     "row": len(metrics(self.run_dir)) > rows_before,
                     "startup": True,
                     "random": time.monotonic() - wait_from > delay}[moment]
            if ready and pids:
                break
            time.sleep(0.02)
        victim = self.rng.choice(pids)
        os.kill(victim, signal.SIGKILL)
        rows = metrics(self.run_dir)
        self.record.append({"part": part, "moment": moment, "pid": victim, "rows": len(rows),
                            "last_step": rows[-1]["step"] if rows else None, "push_step": step})
        if marker is not None:
            time.sleep(0.3)
            (self.hold_dir / f"push_{step}.go").touch()
        if part == "driver":
            proc.wait()
            return start(self.run_dir, [*args, "trainer.resume=auto"], env)
        time.sleep(self.rng.uniform(1.0, 3.0))  # let the healing begin before the next kill
        return proc

    def _release_others(self, step: Optional[int]) -> None:
        for m in self.hold_dir.glob("push_*"):
            if m.suffix != ".go" and m.name != f"push_{step}" and not m.with_suffix(".go").exists():
                m.with_suffix(".go").touch()
                self.released.add(int(m.name.split("_")[1]))

    def _failed(self, proc):
        raise RuntimeError(f"the run failed (exit {proc.returncode}); see {self.run_dir}.driver.log")


def check(run_dir: Path, reference: List[dict], steps: int) -> dict:
    rows = metrics(run_dir)
    got = [r["step"] for r in rows]
    want = [r["step"] for r in reference]
    lost, duplicated = sorted(set(want) - set(got)), sorted(s for s, n in Counter(got).items() if n > 1)
    same = comparable(rows) == comparable(reference)
    diff = next(({k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
                 for a, b in zip(comparable(rows), comparable(reference)) if a != b), None)
    rewards_same = [r.get("rollout/reward_mean") for r in rows] == [r.get("rollout/reward_mean") for r in reference]
    heals = [json.loads(line) for line in (run_dir / "heal.jsonl").read_text().splitlines()] \
        if (run_dir / "heal.jsonl").exists() else []
    return {"steps": len(set(got)), "lost": lost, "duplicated": duplicated, "rows_equal": same,
            "rewards_equal": rewards_same, "first_difference": diff, "heals": heals}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--kills", type=int, default=6, help="kills per run")
    ap.add_argument("--seed", type=int, default=0, help="the chaos' seed (the runs keep the default seed)")
    ap.add_argument("--dir", default="/tmp/slime_hydra_chaos")
    ap.add_argument("--no-write", action="store_true", help="print the result, do not write bench/measured/chaos.md")
    ap.add_argument("--results", default=None, help="a JSON-lines file the results are appended to (several "
                    "harnesses may share it; the table covers all of its runs); default: <dir>/results.jsonl")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    a = ap.parse_args()
    base = Path(a.dir)
    base.mkdir(parents=True, exist_ok=True)
    args = [*ARGS, *a.overrides]
    steps = int(next(x for x in args[::-1] if x.startswith("trainer.num_rollout=")).split("=")[1])
    ref_dir = base / "reference"
    if not (ref_dir / "summary.json").exists():
        ref = start(ref_dir, args, dict(os.environ))
        if ref.wait() != 0:
            raise SystemExit(f"the reference run failed; see {ref_dir}.driver.log")
    reference = metrics(ref_dir)
    results = []
    for i in range(a.runs):
        run_dir = base / f"run_{a.seed}_{i}"
        rng = random.Random(f"{a.seed}-{i}")
        chaos = Chaos(run_dir, a.kills, rng, steps, base / f"hold_{a.seed}_{i}")
        out = chaos.run(args)
        out.update(check(run_dir, reference, steps))
        out["run"] = run_dir.name
        results.append(out)
        print(json.dumps({k: v for k, v in out.items() if k != "heals"}), flush=True)
        shared = Path(a.results or base / "results.jsonl")
        with open(shared, "a") as f:
            f.write(json.dumps(out) + "\n")
        if not a.no_write:  # after every run: a long harness cut short keeps what it measured
            every = [json.loads(line) for line in shared.read_text().splitlines() if line.strip()]
            write(summarize(every), every, a, args)
    ok = all(r["rows_equal"] and not r["lost"] and not r["duplicated"] and not r["error"] for r in results)
    print(json.dumps(summarize(results), indent=1))
    return 0 if ok else 1


def summarize(results: List[dict]) -> dict:
    kills = [k for r in results for k in r["kills"]]
    return {"runs": len(results), "kills": len(kills),
            "kills_per_part": dict(Counter(k["part"] for k in kills)),
            "kills_per_moment": dict(Counter(f"{k['part']}@{k['moment']}" for k in kills)),
            "driver_moments": dict(Counter(f"{h['part']}@{h['moment']}" for r in results for h in r["heals"])),
            "runs_failed": sum(bool(r.get("error")) for r in results),
            "steps_lost": sum(len(r["lost"]) for r in results),
            "steps_duplicated": sum(len(r["duplicated"]) for r in results),
            "runs_with_equal_rows": sum(r["rows_equal"] for r in results),
            "runs_with_equal_rewards": sum(r["rewards_equal"] for r in results),
            "heal_seconds": [h["seconds"] for r in results for h in r["heals"]],
            "steps_redone": sum(h["steps_redone"] for r in results for h in r["heals"]),
            "run_seconds": [r["seconds"] for r in results]}


def write(summary: dict, results: List[dict], a, args: List[str]) -> None:
    out = ROOT / "bench" / "measured" / "chaos.md"
    cmd = "python bench/chaos.py " + " ".join(sys.argv[1:])
    heal_s = sorted(summary["heal_seconds"])
    heal_txt = f"median {heal_s[len(heal_s) // 2]:.1f}, max {heal_s[-1]:.1f}" if heal_s else "none"
    lines = [f"# Chaos: random kills, same seed, same rows ({datetime.date.today()})", "",
             f"`{cmd}` (2 shared CPU cores, other agents' jobs beside it). Each run: `{' '.join(args)}`.", "",
             f"- runs: {summary['runs']}, kills: {summary['kills']}, runs that failed: {summary['runs_failed']}",
             f"- steps lost: {summary['steps_lost']}, duplicated: {summary['steps_duplicated']}",
             f"- runs whose rows equal the uninterrupted run's: {summary['runs_with_equal_rows']} of {summary['runs']} "
             f"(rewards: {summary['runs_with_equal_rewards']})",
             f"- kills per part: {summary['kills_per_part']}",
             f"- kills per part and moment: {summary['kills_per_moment']}",
             f"- rebuilds by the driver per part and the moment the driver was in: {summary['driver_moments']}",
             f"- seconds per rebuild by the driver (trainer group, rollout manager): "
             f"{heal_txt}; "
             f"steps redone in all: {summary['steps_redone']}",
             f"- run wall times (s): {summary['run_seconds']}", "",
             "| run | kills (part@moment) | rows equal | lost | dup |",
             "|---|---|---|---|---|"]
    for i, r in enumerate(results):
        ks = ", ".join(f"{k['part']}@{k['moment']}" for k in r["kills"])
        lines.append(f"| {r.get('run', i)} | {ks} | {r['rows_equal']} | {r['lost']} | {r['duplicated']} |"
                     + (f" failed: {r['error']}" if r.get("error") else ""))
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out)


if __name__ == "__main__":
    sys.exit(main())
