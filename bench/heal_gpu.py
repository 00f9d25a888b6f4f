"""Self-healing on one H200 with real SGLang (docs/faults.md), in one device call: three faults in one
``python run.py`` run (colocated, torch backend, weights over CUDA IPC, both offloads on,
``rollout.fault_tolerance=true``; the Qwen3-0.6B-shaped random checkpoint and prompts of bench/sglang_gpu.py),
one after the other, each once the one before has healed:

  startup   the SGLang server SIGKILLed while it starts (as soon as its process exists)
  push      the SGLang server SIGKILLed inside the weight push of v3, over CUDA IPC (the run is held there by
            the SLIME_HYDRA_TEST_HOLD test hook, utils/testpoint.py: the engine paused, the tensor handles
            about to go; a push lasts a fraction of a second)
  trainer   the trainer rank SIGKILLed mid-step 5, in its training (row 4 is there and so is step 4's checkpoint,
            which is saved after the row is written; the steps' rollout and
            train times so far say when), so the checkpoint of step 4 is loaded and step 5 is done again

The run must end with every step's row once. Measured per fault: seconds from the kill to the healing (the
engine serving again, from the manager's log; the driver's rebuild, from heal.jsonl) and to the next row;
GPU memory (nvidia-smi, sampled every 200 ms): the peak over the last whole step before the fault against
the peak over the first whole step after the healing (a leaked server or trainer would hold its memory on
top); the GPU's processes after the healing (the killed one must be gone); and after the run the GPU's
memory back at its level before the run. The start-up fault has no step before it: its checks are the killed
server gone from the GPU, the run's steps peaking alike (step_peaks_mib) and the GPU empty after the run.

    bash bench/heal_gpu.sh                  # on the device (bench/README.md: set-up), $OUT/heal_gpu.{json,md}
    python bench/heal_gpu.py --cpu          # this script's own code on CPU (tiny model, embedded engine)

Writes ``$OUT/heal_gpu.json`` and ``.md`` at every event (a call cut short keeps what it measured) and the
logs' tails in ``$OUT/heal_gpu_logs.tar.gz`` (a device call brings back at most 8 files).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from gpu import harness as h  # noqa: E402 - bench/ is on the path from here
from gpu.workload import Workload  # noqa: E402
from sglang_gpu import run_overrides  # noqa: E402

FAULTS = ("startup", "push", "trainer")
PUSH_VERSION, TRAINER_AFTER_ROW, SAVE_INTERVAL = 3, 4, 2
# phase -> (the least it finishes in, the most it may take), seconds on one H200: the build 20-90 s
# (bench/sglang_gpu.py); the run: SGLang starts three times (about 45-60 s each with the prefill CUDA graph
# off), the trainer twice, 7 steps of a few seconds, three checkpoints
PLAN = {"build": (20, 90), "run": (300, 600)}
# the fast start's server, not its kernel prebuild (``fast_start prebuild ...``): its flags follow the module
SERVER_MARKS = (b"slime_hydra.rollout.engines.sglang.fast_start\0--", b"sglang.launch_server",
                b"slime_hydra.rollout.engines.embedded.server")


# ---------------------------------------------------------------------------------- processes
def run_pids(run_dir: str, marks) -> List[int]:
    """Live processes of the run (its lease token in their environment, launch/lease.py) whose command
    line holds one of ``marks``, but not those whose parent is one of them (SGLang's forked children)."""
    try:
        token = json.load(open(os.path.join(run_dir, "driver.json")))["token"]
    except (OSError, ValueError, KeyError):
        return []
    needle = f"SLIME_HYDRA_RUN_TOKEN={token}".encode()
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        cmd = h.read_bytes(f"/proc/{p}/cmdline")
        if any(m in cmd for m in marks) and needle in h.read_bytes(f"/proc/{p}/environ").split(b"\0") \
                and b" Z " not in h.read_bytes(f"/proc/{p}/stat")[:64]:
            out.append(int(p))
    return [p for p in out if _parent(p) not in out]  # the server, not its forked children


def _parent(pid: int) -> Optional[int]:
    stat = h.read_bytes(f"/proc/{pid}/stat")
    return int(stat[stat.rindex(b")") + 2:].split()[1]) if stat else None


def gpu_used_mib() -> Optional[float]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout
        return float(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def log_time(line: str, near: float) -> Optional[float]:
    """The wall time of a log line ``HH:MM:SS ...`` (the run's log format), on the day of ``near``."""
    m = re.match(r"(\d\d):(\d\d):(\d\d) ", line)
    if not m:
        return None
    day = datetime.datetime.fromtimestamp(near)
    t = day.replace(hour=int(m[1]), minute=int(m[2]), second=int(m[3]), microsecond=0).timestamp()
    return t - 86400 if t - near > 43200 else t


def first_line_after(path: str, pattern: str, since: float) -> Optional[float]:
    """The wall time of the first line of ``path`` matching ``pattern`` logged at or after ``since`` (the
    log has whole seconds: a line of the kill's second counts)."""
    try:
        lines = open(path, errors="replace").read().splitlines()
    except OSError:
        return None
    for line in lines:
        t = log_time(line, since)
        if t is not None and t >= int(since) and re.search(pattern, line):
            return t
    return None


# --------------------------------------------------------------------------------------- run
class Faults:
    """The run and its three kills, watched from here; ``res`` is what goes to heal_gpu.json."""

    def __init__(self, w: Workload, args, res: Dict[str, Any], save):
        self.w, self.args, self.res, self.save = w, args, res, save
        self.run_dir = os.path.join(w.work, "heal_run")
        self.hold = self.run_dir + "_hold"
        self.console = self.run_dir + ".out"
        self.faults = [f for f in args.faults.split(",") if f]
        self.arrived: Dict[int, float] = {}  # step -> wall time its (latest) row appeared
        self.windows: List[tuple] = []  # (step, start, end) wall times of each step seen, in order
        self.rows: List[Dict[str, Any]] = []
        self.sampler: Optional[h.GpuSampler] = None
        self.trainer_clock: Optional[float] = None  # when row and checkpoint of TRAINER_AFTER_ROW were both there

    def _saved(self, step: int) -> bool:
        """Whether the run's checkpoint of ``step`` is complete (or none is due at ``step``)."""
        from slime_hydra.checkpoint.ckpt import find_checkpoint, read_checkpoint

        if step % SAVE_INTERVAL:
            return True
        ckpt = find_checkpoint("auto", self.run_dir)
        return ckpt is not None and read_checkpoint(ckpt)["step"] >= step

    def command(self) -> List[str]:
        extra = (f"rollout.fault_tolerance=true trainer.save_interval={SAVE_INTERVAL} "
                 "rollout.health_check_interval_s=5 rollout.health_check_timeout_s=120 "
                 "rollout.max_engine_restarts_per_hour=10 trainer.max_restarts_per_hour=10 "
                 "sync.push_timeout_s=180 " + self.args.overrides)
        return run_overrides(self.w, "colocated", "sglang_offload", self.args.steps, extra)

    def run(self, limit_s: float) -> None:
        from slime_hydra.utils.proc import kill_tree, spawn

        subprocess.run(["rm", "-rf", self.run_dir, self.hold])
        os.makedirs(self.hold)
        overrides = self.command()
        cmd = [sys.executable, os.path.join(ROOT, "run.py"), *overrides, f"hydra.run.dir={self.run_dir}"]
        self.res.update(command="python run.py " + " ".join(cmd[2:]), faults={f: {} for f in self.faults},
                        memory_idle_before_mib=gpu_used_mib())
        env = {"SLIME_HYDRA_TEST_HOLD": f"push:{PUSH_VERSION}" if "push" in self.faults else "",
               "SLIME_HYDRA_TEST_HOLD_DIR": self.hold}
        if self.w.device == "cuda":
            self.sampler = h.GpuSampler(os.path.join(self.w.work, "heal_gpu.csv"))
        h.log(self.res["command"])
        open(self.console, "w").close()
        t0 = time.time()
        proc = spawn(cmd, self.console, env)
        todo = list(self.faults)
        try:
            while proc.poll() is None and time.time() - t0 < limit_s:
                self._rows()
                healed = self._healed_last()
                if todo and healed and self._fire(todo[0]):
                    todo.pop(0)
                    self.save()
                time.sleep(0.05)
            if proc.poll() is None:
                h.log(f"the run is over its {limit_s:.0f}s: stopped")
                self.res["error"] = f"the run did not finish within {limit_s:.0f}s"
                for marker in glob.glob(os.path.join(self.hold, "push_*")):  # never leave it held
                    open(marker + ".go", "w").close()
                kill_tree(proc, timeout=20)
        finally:
            if proc.poll() is None:
                kill_tree(proc, timeout=5)
            if self.sampler is not None:
                self.sampler.stop()
        self._rows()
        self._healed_last()
        self.res.update(returncode=proc.returncode, wall_s=round(time.time() - t0, 1),
                        steps=[r["step"] for r in self.rows])
        self.res["memory_idle_after_mib"] = self._settled_memory(self.res["memory_idle_before_mib"])
        self.res["gpu_apps_after_run"] = h.gpu_apps()
        self._measure()

    # ------------------------------------------------------------------------------ watching
    def _rows(self) -> None:
        """Note the rows that appeared (a rewound run writes its rows after the checkpoint again): each makes a
        step window, from the row before it in the file to it."""
        rows = h.read_rows(os.path.join(self.run_dir, "metrics.jsonl"))
        same = 0
        while same < min(len(rows), len(self.rows)) and rows[same] == self.rows[same]:
            same += 1
        if same == len(rows):
            self.rows = rows
            return
        now = time.time()
        for i in range(same, len(rows)):
            start = self.arrived.get(rows[i - 1]["step"]) if i else None
            self.arrived[rows[i]["step"]] = now
            if start is not None:
                self.windows.append((rows[i]["step"], start, now))
        self.rows = rows
        h.log(f"rows: {[r['step'] for r in rows]}")

    def _healed_last(self) -> bool:
        """Whether the last fault fired has healed: a row came after its kill (the next one waits for that)."""
        fired = [f for f in self.faults if self.res["faults"][f].get("killed_at")]
        if not fired:
            return True
        last = self.res["faults"][fired[-1]]
        later = [t for t in self.arrived.values() if t > last["killed_at"]]
        if later and "first_row_after_s" not in last:
            last["first_row_after_s"] = round(min(later) - last["killed_at"], 1)
            last["gpu_apps_after_heal"] = h.gpu_apps()
            self.save()
        return bool(later)

    def _fire(self, fault: str) -> bool:
        """Kill for ``fault`` if its moment has come; whether it did."""
        rec = self.res["faults"][fault]
        if fault == "startup":
            victims = run_pids(self.run_dir, SERVER_MARKS)
        elif fault == "push":
            victims = run_pids(self.run_dir, SERVER_MARKS) \
                if os.path.exists(os.path.join(self.hold, f"push_{PUSH_VERSION}")) else []
        else:  # mid-training of the step after row TRAINER_AFTER_ROW, as the steps so far timed it (the least
            # of each part: a step that waited for a healing is no guide). A step's checkpoint is saved after its
            # row is written, so the clock starts once both are there: a kill inside the save is another moment
            row = next((r for r in self.rows if r["step"] == TRAINER_AFTER_ROW), None)
            if row is not None and self.trainer_clock is None and self._saved(TRAINER_AFTER_ROW):
                self.trainer_clock = time.time()
            least = {k: min((r.get(f"perf/{k}", 0.0) for r in self.rows), default=0.0)
                     for k in ("rollout_wait_time", "offload_time", "train_time")}
            due = self.trainer_clock is not None and time.time() - self.trainer_clock >= \
                least["rollout_wait_time"] + least["offload_time"] + 0.5 * least["train_time"]
            victims = run_pids(self.run_dir, (b"ray::TrainerActor",)) if due else []
        if not victims:
            return False
        rec["memory_at_kill_mib"] = gpu_used_mib()
        victim = victims[0]
        os.kill(victim, signal.SIGKILL)
        rec.update(killed_at=time.time(), killed_pid=victim, rows_before=[r["step"] for r in self.rows])
        h.log(f"{fault}: SIGKILLed pid {victim} ({h.read_bytes(f'/proc/{victim}/cmdline')[:60]!r}); rows so far "
              f"{rec['rows_before']}")
        if fault == "push":
            time.sleep(0.5)
            open(os.path.join(self.hold, f"push_{PUSH_VERSION}.go"), "w").close()
        return True

    def _settled_memory(self, idle: Optional[float]) -> Optional[float]:
        """The GPU's memory after the run, once it has come down (SGLang's processes take seconds to exit)."""
        used = gpu_used_mib()
        deadline = time.time() + 30
        while used is not None and idle is not None and used > idle + self.args.tolerance_mib \
                and time.time() < deadline:
            time.sleep(1)
            used = gpu_used_mib()
        return used

    # ----------------------------------------------------------------------------- measuring
    def _peak(self, start: float, end: float) -> Optional[float]:
        if self.sampler is None:
            return None
        got = [mib for t, _, mib, _ in self.sampler.samples() if start <= t <= end]
        return max(got) if got else None

    def _measure(self) -> None:
        logs = os.path.join(self.run_dir, "logs")
        manager_log = os.path.join(logs, "rollout_manager.log")
        heals = [json.loads(line) for line in open(os.path.join(self.run_dir, "heal.jsonl"))] \
            if os.path.exists(os.path.join(self.run_dir, "heal.jsonl")) else []
        self.res["driver_heals"] = heals
        windows = self.windows
        for fault in self.faults:
            rec = self.res["faults"][fault]
            killed = rec.get("killed_at")
            if not killed:
                rec["pass"] = False
                rec["why"] = "its moment never came"
                continue
            if fault == "startup":
                healed = first_line_after(manager_log, r"engine\(s\) up in", killed)
            elif fault == "push":
                healed = first_line_after(manager_log, r"run weights v\d+ and take requests again", killed)
            else:
                healed = next((x["time"] for x in heals if x["part"] == "trainer" and x["time"] >= killed), None)
                rec["driver_heal"] = next((x for x in heals if x["part"] == "trainer" and x["time"] >= killed), None)
            rec["heal_s"] = round(healed - killed, 1) if healed else None
            restarts = re.findall(r"(\d\d:\d\d:\d\d) .*engine \d+ restarted at \S+ in ([\d.]+)s",
                                  open(manager_log, errors="replace").read() if os.path.exists(manager_log) else "")
            rec["engine_restart_s"] = [float(s) for stamp, s in restarts
                                       if (log_time(stamp + " ", killed) or 0) >= int(killed)][:1]
            before = [w for w in windows if w[2] < killed]
            after = [w for w in windows if healed and w[1] >= healed]
            rec["step_before"] = before[-1][0] if before else None
            rec["step_after"] = after[0][0] if after else None
            rec["memory_before_mib"] = self._peak(before[-1][1], before[-1][2]) if before else None
            rec["memory_after_mib"] = self._peak(after[0][1], after[0][2]) if after else None
            apps = rec.get("gpu_apps_after_heal")
            rec["killed_pid_on_gpu"] = None if apps is None else any(a["pid"] == rec["killed_pid"] for a in apps)
            ok_mem = None if rec["memory_before_mib"] is None or rec["memory_after_mib"] is None else \
                rec["memory_after_mib"] <= rec["memory_before_mib"] + self.args.tolerance_mib
            rec["memory_back"] = ok_mem
            rec["pass"] = bool(rec["heal_s"] is not None and rec.get("first_row_after_s") is not None
                               and ok_mem is not False and not rec["killed_pid_on_gpu"])
        peaks = [self._peak(a, b) for _, a, b in windows]
        self.res["step_peaks_mib"] = [[s, p] for (s, _, _), p in zip(windows, peaks)]


# ------------------------------------------------------------------------------------- report
def report(res: Dict[str, Any], path: str) -> None:
    h.write_json(path + ".json", res)
    faults = res.get("run", {}).get("faults", {})
    rows = []
    for name, r in faults.items():
        rows.append([name, h.cell(r.get("heal_s"), ".1f"), h.cell(r.get("first_row_after_s"), ".1f"),
                     h.cell((r.get("engine_restart_s") or [None])[0], ".1f"),
                     f"{h.cell(r.get('memory_before_mib'), '.0f')} (step {r.get('step_before')})",
                     f"{h.cell(r.get('memory_after_mib'), '.0f')} (step {r.get('step_after')})",
                     r.get("killed_pid_on_gpu"), r.get("pass")])
    run = res.get("run", {})
    lines = [f"# Self-healing on the GPU ({res.get('gpu', '?')})", "",
             "One run.py run, colocated (torch trainer, SGLang, both offloads, weights over CUDA IPC), "
             "`rollout.fault_tolerance=true`, three SIGKILLs one after the other (bench/heal_gpu.py). heal s: "
             "the kill to the engine serving again (start-up: the engines up; push: the restarted engine has the "
             "weights and takes requests) or to the driver's rebuild done (trainer: heal.jsonl); kill to next row: "
             "the run going on (a push to a dead engine goes to the live ones, and the restarted one gets the "
             "weights before it serves; a rebuilt trainer group redoes the steps after its checkpoint); GPU MiB: "
             "nvidia-smi's peak over the last whole step before the kill and the first whole step after the "
             "healing.", "", f"`{run.get('command', '')}`", ""]
    lines += h.table(["fault", "heal s", "kill to next row s", "engine restart s", "GPU MiB before",
                      "GPU MiB after", "killed pid on the GPU", "pass"], rows)
    lines += ["", f"- steps written (last time each): {run.get('steps')}, rc {run.get('returncode')}, "
              f"wall {run.get('wall_s')} s", f"- GPU MiB before the run {run.get('memory_idle_before_mib')}, "
              f"after it {run.get('memory_idle_after_mib')}; each step's peak: {run.get('step_peaks_mib')}",
              "- driver rebuilds (part, moment, seconds, steps redone): "
              f"{[(x['part'], x['moment'], x['seconds'], x['steps_redone']) for x in run.get('driver_heals', [])]}"]
    h.write_text(path + ".md", "\n".join(lines + ["", "Checks:"] + h.check_lines(res)) + "\n")


def pack_logs(out: str, w: Workload) -> None:
    """The logs' tails, the run's metrics and heal records, and the nvidia-smi samples, in one file."""
    staging = os.path.join(w.work, "heal_logs")
    subprocess.run(["rm", "-rf", staging])
    run_dir = os.path.join(w.work, "heal_run")
    h.copy_logs(staging, [run_dir + ".out", os.path.join(run_dir, "heal.jsonl"), os.path.join(w.work, "heal_gpu.csv")],
                [run_dir], lines=150)
    tmp = os.path.join(out, "heal_gpu_logs.tar.gz.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(staging, arcname="heal_gpu_logs")
    os.replace(tmp, os.path.join(out, "heal_gpu_logs.tar.gz"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", default=os.environ.get("FAULTS", ",".join(FAULTS)),
                    help="comma-separated, fired in this order (env FAULTS)")
    ap.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 6)), help="steps of the run (env STEPS)")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BENCH_BUDGET_S", 510)),
                    help="seconds for the build and the run (env BENCH_BUDGET_S; with the set-up, within 9 minutes)")
    ap.add_argument("--tolerance-mib", type=float, default=1024.0,
                    help="how much more a step after a healing may peak at than the step before the fault")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--cpu", action="store_true", help="a dry run on CPU: the tiny model, the embedded engine")
    ap.add_argument("--overrides", default=os.environ.get("HEAL_OVERRIDES", ""),
                    help="more run.py overrides, space-separated (env HEAL_OVERRIDES)")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    unknown = [f for f in args.faults.split(",") if f and f not in FAULTS]
    if unknown:
        ap.error(f"--faults: unknown {unknown} (known: {', '.join(FAULTS)})")
    if "trainer" in args.faults and args.steps <= TRAINER_AFTER_ROW:
        ap.error(f"--steps must be over {TRAINER_AFTER_ROW} for the trainer fault (mid-step {TRAINER_AFTER_ROW + 1})")
    w = Workload("/tmp/healbench_cpu", "tiny", 8, 8, 16, prompt_words=8, words=20, device="cpu") if args.cpu \
        else Workload("/tmp/sglbench", "qwen3_0_6b", 8, 8, 256)
    os.makedirs(w.work, exist_ok=True)
    if args.phase == "build":  # a child process: the parent keeps no torch and no CUDA context
        with h.phase_output(os.path.join(w.work, "heal_phase_build.json")) as out:
            t0 = time.perf_counter()
            w.build()
            out["build_s"] = round(time.perf_counter() - t0, 1)
        return 0
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "heal_gpu")
    names = ["cpu (dry run)"] if args.cpu else h.gpu_names()
    res: Dict[str, Any] = {"gpu": (names or [""])[0], "cmdline": " ".join(sys.argv), "run": {}}
    needs = {"build": (0, args.budget), "run": (0, args.budget)} if args.cpu else PLAN
    try:
        for phase, limit, skipped in h.Budget(args.budget).plan(["build", "run"], needs):
            if skipped:
                h.check(res, f"phase_{phase}", False, f"no time left ({skipped})")
                break
            if phase == "build":
                res["build"] = h.run_child("build", limit, os.path.join(w.work, "heal_phase_build.json"))
                if not h.check(res, "build", res["build"].get("phase_rc") == 0, f"{res['build']}"):
                    break
                continue
            faults = Faults(w, args, res["run"], lambda: report(res, path))
            faults.run(limit - 15)
            run = res["run"]
            steps = run.get("steps") or []
            h.check(res, "run", run.get("returncode") == 0 and steps == list(range(1, args.steps + 1)),
                    f"rc {run.get('returncode')}, rows {steps} (each step once, 1..{args.steps})"
                    + (f"; {run['error']}" if run.get("error") else ""))
            for name, r in run["faults"].items():
                h.check(res, f"heal_{name}", r.get("pass"),
                        f"heal {r.get('heal_s')} s, next row {r.get('first_row_after_s')} s after the kill, GPU "
                        f"MiB {r.get('memory_before_mib')} -> {r.get('memory_after_mib')}, killed pid on the GPU "
                        f"after: {r.get('killed_pid_on_gpu')}" + (f"; {r['why']}" if r.get("why") else ""))
            idle, after = run.get("memory_idle_before_mib"), run.get("memory_idle_after_mib")
            if idle is not None:
                h.check(res, "gpu_empty_after_run", after is not None and after <= idle + args.tolerance_mib,
                        f"GPU MiB {idle} before the run, {after} after it; processes left: "
                        f"{run.get('gpu_apps_after_run')}")
            report(res, path)
    finally:
        report(res, path)
        pack_logs(args.out, w)
    print(open(path + ".md").read())
    if h.failed(res):
        h.log(f"FAILED: {h.failed(res)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
