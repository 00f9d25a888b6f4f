"""What every GPU bench needs, written once (bench/README.md says how a GPU run is set up): a time budget
shared by the phases of one device call (``Budget``); phases as child processes whose results survive them
(``run_child``, ``phase_output``); result files written whole, pass/fail checks, markdown tables;
``python run.py`` launched and watched (``run_py``); nvidia-smi samples (``GpuSampler``); the CPUs and their
busiest processes (``CpuSampler``, psutil), how fast each CPU runs Python (``CpuProbe``), a process's Python stacks
(``StackProfile``, py-spy); log tails under ``$OUT`` (``copy_logs``). The standard library only at import (psutil and
py-spy are asked for when used): a bench imports it before torch, its tests run anywhere.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------- budget
class Budget:
    """The seconds one device call gives its phases (a call ends at 10 minutes, whatever runs then).

    ``plan`` hands out one phase at a time, when it starts: its limit is the least of its cap and what
    is left after the needs of the phases behind it; one whose room is under its need (or under ``floor``)
    is skipped, so that a slow phase costs the ones behind it nothing they need."""

    def __init__(self, seconds: float, floor: float = 30.0, clock: Callable[[], float] = time.perf_counter):
        self.seconds, self.floor, self.clock = seconds, floor, clock
        self.end = clock() + seconds

    def left(self) -> float:
        return self.end - self.clock()

    def plan(self, names: Sequence[str], needs: Optional[Dict[str, Tuple[float, float]]] = None
             ) -> Iterator[Tuple[str, float, Optional[str]]]:
        """(phase, limit seconds, why it is skipped or None) per phase, each computed when that phase is
        due; ``needs``: phase -> (the least it finishes in, the most it may take); the last phase may take
        all that is left."""
        needs = needs or {}
        for i, name in enumerate(names):
            need, cap = needs.get(name, (0.0, math.inf))
            room = self.left() - sum(needs.get(n, (0.0, 0.0))[0] for n in names[i + 1:])
            limit = room if i == len(names) - 1 else min(cap, room)
            if room < max(need, self.floor):
                yield name, limit, f"{room:.0f}s left, needs {need or self.floor:.0f}s"
            else:
                yield name, limit, None


# ------------------------------------------------------------------------------ phases as children
def run_child(phase: str, limit_s: float, result_path: str, argv: Optional[List[str]] = None,
              grace_s: float = 30.0) -> Dict[str, Any]:
    """This script again (its own arguments, ``--phase`` and ``--limit`` added) for one phase, killed
    ``limit_s + grace_s`` on; returns what the phase saved (``phase_output``) with ``phase_rc`` (its exit
    status, or "timeout")."""
    if os.path.exists(result_path):
        os.remove(result_path)
    argv = sys.argv if argv is None else argv
    cmd = [sys.executable, os.path.abspath(argv[0]), *argv[1:], "--phase", phase, "--limit", str(limit_s)]
    log(f"phase {phase} (at most {limit_s:.0f}s)")
    try:
        rc: Any = subprocess.run(cmd, timeout=limit_s + grace_s).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    try:
        with open(result_path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {}
    return {**res, "phase_rc": rc}


@contextmanager
def phase_output(path: str, every_s: float = 5.0) -> Iterator[Dict[str, Any]]:
    """The dict a phase fills, written to ``path`` every ``every_s`` seconds and at the end (with
    ``error`` when the phase raised): what it measured survives its being killed at its limit."""
    out: Dict[str, Any] = {}
    stop = threading.Event()

    def autosave() -> None:
        while not stop.wait(every_s):
            try:
                write_json(path, out)
            except RuntimeError:  # the phase changed ``out`` while it was written: the next save has it
                pass

    threading.Thread(target=autosave, daemon=True).start()
    try:
        yield out
    except BaseException as e:
        out["error"] = repr(e)
        raise
    finally:
        stop.set()
        write_json(path, out)


# ------------------------------------------------------------------------------------- results
def write_text(path: str, text: str) -> None:
    """Written whole or not at all (a temp file renamed): a reader never sees half a file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: str, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=1, default=str) + "\n")


def check(results: Dict[str, Any], name: str, ok: bool, detail: str) -> bool:
    """A pass/fail check, kept under ``results["checks"]`` and logged."""
    results.setdefault("checks", {})[name] = {"pass": bool(ok), "detail": detail}
    log(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    return bool(ok)


def failed(results: Dict[str, Any]) -> List[str]:
    return [k for k, c in results.get("checks", {}).items() if not c["pass"]]


def check_lines(results: Dict[str, Any]) -> List[str]:
    return [f"- {'PASS' if c['pass'] else 'FAIL'} {k}: {c['detail']}" for k, c in results.get("checks", {}).items()]


def cell(v: Any, fmt: str = ".2f") -> str:
    """A number in a table cell, "-" for none."""
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> List[str]:
    """A markdown table's lines; a row shorter than the header is padded with empty cells."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        row = [str(c) for c in row] + [""] * (len(header) - len(row))
        out.append("| " + " | ".join(row) + " |")
    return out


def median(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def steady(rows: List[Dict[str, Any]], key: str) -> Optional[float]:
    """Median of ``key`` over the steps after the first (warm-up); the first alone if it is all there is."""
    return median([r[key] for r in rows[1:] if key in r] or [r[key] for r in rows if key in r])


def gpu_names() -> List[str]:
    """The GPUs' names from nvidia-smi (not torch: the calling process keeps no CUDA context)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout
    return [n.strip() for n in out.split("\n") if n.strip()]


def gpu_apps() -> Optional[List[Dict[str, Any]]]:
    """The processes nvidia-smi sees on the GPU (pid, MiB); None without nvidia-smi. (In a container the
    pids may be the host's: then they name no process here, which the report says.)"""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode:
        return None
    apps = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            pid = int(parts[0])
            cmd = command_line(pid)
            apps.append({"pid": pid, "mib": float(parts[1]) if parts[1].replace(".", "").isdigit() else None,
                         "here": os.path.exists(f"/proc/{pid}"), "cmd": cmd})
    return apps


def read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def read_text(path: str) -> str:
    """``read_bytes`` decoded ("" where it cannot be read)."""
    return read_bytes(path).decode(errors="replace")


def command_line(pid: int, limit: int = 120) -> str:
    """Process ``pid``'s command line, its arguments joined by spaces ("" once it is gone)."""
    return read_text(f"/proc/{pid}/cmdline").replace("\0", " ")[:limit]


# ------------------------------------------------------------------------------------- run.py
def read_rows(path: str) -> List[Dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` written so far ([] before it exists or while a line is half-written)."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


@dataclass
class Run:
    """One ``python run.py``: how it ended and what its metrics said."""

    command: str
    returncode: Optional[int]
    wall_s: float
    rows: List[Dict[str, Any]]
    seen: Dict[int, float] = field(default_factory=dict)  # step -> seconds from launch to its row
    started: float = 0.0  # wall clock (time.time) at launch

    def startup_s(self) -> Optional[float]:
        """Launch to the first step's start: its row's arrival less its own step time."""
        steps = [r for r in self.rows if "perf/step_time" in r]
        return self.seen[steps[0]["step"]] - steps[0]["perf/step_time"] if steps else None


def run_py(overrides: List[str], run_dir: str, console: str, limit_s: float,
           env: Optional[Dict[str, str]] = None, before_stop: Optional[Callable[[], None]] = None) -> Run:
    """``python run.py overrides hydra.run.dir=run_dir``, output to ``console``, stopped (with its Ray
    processes: its own process group) at ``limit_s``, ``before_stop`` called just before; each step's row is timed
    as it appears."""
    from slime_hydra.utils.proc import kill_tree, spawn

    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, os.path.join(ROOT, "run.py"), *overrides, f"hydra.run.dir={run_dir}"]
    command = "python run.py " + " ".join(cmd[2:])
    log(command)
    open(console, "w").close()
    metrics = os.path.join(run_dir, "metrics.jsonl")
    seen: Dict[int, float] = {}
    t0, wall0 = time.perf_counter(), time.time()
    proc = spawn(cmd, console, env)
    while proc.poll() is None and time.perf_counter() - t0 < limit_s:
        time.sleep(0.2)
        for row in read_rows(metrics):
            seen.setdefault(row["step"], time.perf_counter() - t0)
    if proc.poll() is None:
        log(f"run over its {limit_s:.0f}s: stopped")
        if before_stop is not None:
            before_stop()
        kill_tree(proc, timeout=20)
    rows = read_rows(metrics)
    for row in rows:
        seen.setdefault(row["step"], time.perf_counter() - t0)
    return Run(command, proc.returncode, time.perf_counter() - t0, rows, seen, wall0)


# ---------------------------------------------------------------------------------- nvidia-smi
class GpuSampler:
    """nvidia-smi every ``interval_ms`` into ``path``: each GPU's memory, utilisation, SM clock, power and memory
    clock over time."""

    QUERY = "timestamp,index,memory.used,utilization.gpu,clocks.sm,power.draw,clocks.mem"

    def __init__(self, path: str, interval_ms: int = 200, start: bool = True):
        self.path = path
        self.proc = None
        self.stopped: Optional[List[Tuple[float, str, List[Optional[float]]]]] = None  # the rows, once stopped
        if start:
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                          "-lms", str(interval_ms)], stdout=open(path, "w"), stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.stopped = list(self._parse())  # the file is whole: read it once, for every question after

    def rows(self) -> Iterator[Tuple[float, str, List[Optional[float]]]]:
        """(wall time with its milliseconds, "gpu<i>", [MiB used, utilisation %, SM MHz, W, memory MHz]) per line;
        lines of older, shorter queries give the first two or four. A field nvidia-smi cannot read ("[N/A]") is
        None; a line without its time, GPU, memory or utilisation is skipped."""
        return iter(self.stopped) if self.stopped is not None else self._parse()

    def _parse(self) -> Iterator[Tuple[float, str, List[Optional[float]]]]:
        with open(self.path) as f:
            for line in f:
                parts = [p.strip() for p in line.split(",")]
                if len(parts) not in (4, 6, 7):
                    continue
                try:
                    whole, _, frac = parts[0].partition(".")
                    stamp = time.mktime(time.strptime(whole, "%Y/%m/%d %H:%M:%S")) + float(f"0.{frac or 0}")
                    gpu = f"gpu{int(parts[1])}"
                except ValueError:
                    continue
                values = [_number(p) for p in parts[2:]]
                if values[0] is not None and values[1] is not None:
                    yield stamp, gpu, values

    def samples(self) -> Iterator[Tuple[float, str, float, float]]:
        """(wall time, "gpu<i>", MiB used, utilisation %) per line."""
        for stamp, gpu, values in self.rows():
            yield stamp, gpu, values[0], values[1]

    def peaks(self) -> Dict[str, Dict[str, float]]:
        """Each GPU's peak memory (GiB) and mean utilisation over the whole run."""
        per: Dict[str, List[Tuple[float, float]]] = {}
        for _, gpu, mib, util in self.samples():
            per.setdefault(gpu, []).append((mib, util))
        return {g: {"peak_gib": round(max(m for m, _ in v) / 1024, 1),
                    "mean_util": round(statistics.mean(u for _, u in v), 1)} for g, v in per.items()}

    def idle_share(self, since_wall: float) -> Dict[str, Dict[str, float]]:
        """From ``since_wall`` on: each GPU's share of samples under 5 % utilisation, and its mean."""
        per: Dict[str, List[float]] = {}
        for stamp, gpu, _, util in self.samples():
            if stamp >= since_wall:
                per.setdefault(gpu, []).append(util)
        return {g: {"samples": len(u), "idle_share": sum(x < 5 for x in u) / len(u), "mean_util": statistics.mean(u)}
                for g, u in per.items() if u}

    def busy(self, since_wall: float, until_wall: float = math.inf) -> Dict[str, Dict[str, float]]:
        """Between ``since_wall`` and ``until_wall``, over the samples where the GPU was busy (utilisation of 50 % or
        more): each GPU's mean SM clock (MHz), its lowest, mean power (W) and mean memory clock, each over the samples
        that read it; whether the GPU ran slower in one run, or one step, than in another."""
        per: Dict[str, List[List[Optional[float]]]] = {}
        for stamp, gpu, values in self.rows():
            if since_wall <= stamp <= until_wall and values[1] >= 50:
                per.setdefault(gpu, []).append(values + [None] * (5 - len(values)))
        out: Dict[str, Dict[str, float]] = {}
        for g, v in per.items():
            sm, watts, mem = ([x[i] for x in v if x[i] is not None] for i in (2, 3, 4))
            out[g] = {"samples": len(v)}
            if sm:
                out[g].update(sm_mhz_mean=round(statistics.mean(sm)), sm_mhz_min=min(sm))
            if watts:
                out[g]["power_w_mean"] = round(statistics.mean(watts), 1)
            if mem:
                out[g]["mem_mhz_mean"] = round(statistics.mean(mem))
        return out


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


class CpuSampler:
    """Every ``interval_s``, in a thread: each process's share of one CPU since the sample before (psutil), the
    busiest ``top`` kept, each with the CPU it was on and its involuntary context switches (the kernel took the CPU
    from it); and each CPU's busy share and steal share (the hypervisor ran something else on it). A KVM guest sees
    neither its host's clocks nor its hyperthread siblings (the lent H200's reported a fixed 2100 MHz and no
    siblings), so neither is sampled. Whether something competes with SGLang's scheduler for the CPU while it
    decodes: with CUDA graphs a decode step of a small model is a few milliseconds of GPU work, and the scheduler's
    Python between them counts."""

    def __init__(self, interval_s: float = 0.5, top: int = 6):
        self.interval_s, self.top = interval_s, top
        # (wall time, [(share, pid, command, cpu, involuntary switches a second)], {cpu: (busy, steal)})
        self.samples: List[Tuple[float, List[Tuple[float, int, str, Optional[int], Optional[float]]],
                                 Dict[int, Tuple[float, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        last: Dict[int, float] = {}
        last_switches: Dict[int, Tuple[int, float]] = {}  # pid -> (involuntary switches, when read)
        last_cpus = psutil.cpu_times(percpu=True)
        last_t = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now, cpu, names, procs = time.monotonic(), {}, {}, {}
            for proc in psutil.process_iter(["cmdline"]):
                try:
                    t = proc.cpu_times()
                except psutil.Error:
                    continue
                cpu[proc.pid] = t.user + t.system
                names[proc.pid] = " ".join(proc.info["cmdline"] or [])[:100]
                procs[proc.pid] = proc
            cpus = psutil.cpu_times(percpu=True)
            if last:
                dt = max(now - last_t, 1e-3)
                shares = sorted(((cpu[p] - last[p]) / dt, p, names[p]) for p in cpu if p in last)
                busiest = [x for x in reversed(shares[-self.top:]) if x[0] > 0.02]
                top = []
                for share, pid, name in busiest:
                    where, switches = None, None
                    try:
                        where = procs[pid].cpu_num()
                        n = procs[pid].num_ctx_switches().involuntary
                        if pid in last_switches:  # over the time since it was last read (it may have left the top)
                            before, then = last_switches[pid]
                            switches = (n - before) / max(now - then, 1e-3)
                        last_switches[pid] = (n, now)
                    except (psutil.Error, AttributeError):
                        pass
                    top.append((share, pid, name, where, switches))
                per_cpu = {i: cpu_shares(a, b) for i, (a, b) in enumerate(zip(last_cpus, cpus))}
                self.samples.append((time.time(), top, per_cpu))
            last, last_t, last_cpus = cpu, now, cpus

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def window(self, since_wall: float, until_wall: float, top: int = 3) -> List[Dict[str, Any]]:
        """The ``top`` processes by their mean share of a CPU over the samples between the two times; for each, the
        CPUs it was seen on, its involuntary context switches a second, and the mean steal share of the CPU it was
        on."""
        got = [(s, c) for t, s, c in self.samples if since_wall <= t <= until_wall]
        seen: Dict[Tuple[int, str], List[Tuple[float, Optional[int], Optional[float], Dict[int, Any]]]] = {}
        for sample, per_cpu in got:
            for share, pid, cmd, where, switches in sample:
                seen.setdefault((pid, cmd), []).append((share, where, switches, per_cpu))
        best = sorted(seen.items(), key=lambda kv: -sum(x[0] for x in kv[1]))[:top]
        out = []
        for (pid, cmd), xs in best:
            row: Dict[str, Any] = {"pid": pid, "cmd": cmd, "cpu": round(sum(x[0] for x in xs) / len(got), 2)}
            on = [(where, per_cpu) for _, where, _, per_cpu in xs if where is not None and where in per_cpu]
            if on:
                row["on_cpus"] = sorted({w for w, _ in on})
                row["cpu_steal"] = round(statistics.fmean(c[w][1] for w, c in on), 3)
            switches = [x[2] for x in xs if x[2] is not None]
            if switches:
                row["involuntary_per_s"] = round(statistics.fmean(switches), 1)
            out.append(row)
        return out

    def busiest(self, min_share: float = 0.9) -> Optional[int]:
        """The pid of the busiest process in the last sample, if it took at least ``min_share`` of a CPU."""
        if not self.samples or not self.samples[-1][1]:
            return None
        share, pid = self.samples[-1][1][0][:2]
        return pid if share >= min_share else None

    def host(self, since_wall: float, until_wall: float) -> Dict[str, Any]:
        """Over the samples between the two times, every CPU's mean busy share and the largest steal share of any
        one CPU."""
        got = [c for t, _, c in self.samples if since_wall <= t <= until_wall and c]
        if not got:
            return {}
        return {"busy_cpus": round(statistics.fmean(sum(b for b, _ in c.values()) for c in got), 2),
                "steal_max": max(s for c in got for _, s in c.values())}


def host_cpus() -> Dict[str, Any]:
    """This machine's CPUs as a process sees them: how many, how many it may run on, how many have a hyperthread
    sibling, its cgroup's CPU quota and the model name (None where the machine does not say)."""
    model = re.search(r"^model name\s*:\s*(.+)$", read_text("/proc/cpuinfo"), re.M)
    return {"count": os.cpu_count(), "allowed": len(os.sched_getaffinity(0)),
            "with_siblings": sum(bool(s) for s in cpu_siblings().values()),
            "cgroup_cpu_max": read_text("/sys/fs/cgroup/cpu.max").strip() or None,
            "model": model.group(1).strip() if model else None}


_PROBE = """
import os, sys, time
cpus, every, n = sorted(os.sched_getaffinity(0)), float(sys.argv[1]), int(sys.argv[2])
parent = int(sys.argv[4])  # the bench, named by itself: it may be gone before this line runs
with open(sys.argv[3], "a", buffering=1) as out:
    while os.getppid() == parent:  # the bench that started it is gone: so is the probe
        for cpu in cpus:
            os.sched_setaffinity(0, {cpu})
            for i in range(n // 10):  # untimed: the caches warm on the CPU just moved to
                pass
            t, c, x = time.time(), time.thread_time(), 0
            for i in range(n):
                x += i
            out.write(f"{t:.3f} {cpu} {time.thread_time() - c:.7f}\\n")
            time.sleep(every / len(cpus))
"""


class CpuProbe:
    """How fast each CPU runs Python, moment by moment: a child process times the same ``n`` additions on each CPU in
    turn, every CPU once in ``every_s``, in CPU time (what the work took on the CPU, not the wait for a busy one). A
    virtual machine's CPU can run slower at some times than at others (its host's other load, the host's clocks), and
    SGLang's scheduler, a Python loop, with it. ``window`` compares a moment's times with the run's median (so one
    run's probe says nothing about another's). It may disturb what it watches (a busy process whose CPU it visits
    may be moved), so a bench runs it only when asked. It ends with the process that started it."""

    def __init__(self, path: str, every_s: float = 0.5, n: int = 20000, start: bool = True):
        """``start=False``: a probe's file, read (``read``), no process started."""
        self.path, self.proc = path, None
        self.rows: Optional[List[Tuple[float, int, float]]] = None  # (wall time, CPU, seconds), once stopped
        if start:
            with open(path, "w"):
                pass
            self.proc = subprocess.Popen([sys.executable, "-c", _PROBE, str(every_s), str(n), path, str(os.getpid())],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            self.rows = self._parse()

    @classmethod
    def read(cls, path: str) -> "CpuProbe":
        return cls(path, start=False)

    def _parse(self) -> List[Tuple[float, int, float]]:
        rows = []
        for line in read_text(self.path).splitlines():
            parts = line.split()
            if len(parts) == 3:  # the last line may be cut short by the stop
                rows.append((float(parts[0]), int(parts[1]), float(parts[2])))
        return rows

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(5)
        self.rows = self._parse()

    def window(self, since_wall: float, until_wall: float, cpus: Iterable[int] = ()) -> Dict[str, Any]:
        """Between the two times (after ``stop``): the probe's median time on every CPU and on ``cpus``, each over
        its median of the whole run (above 1: slower than usual); ``all_cpus_us`` and ``run_us``: the window's median
        and the run's, in microseconds, to compare runs (machines and moments alike)."""
        if not self.rows:
            return {}
        usual = statistics.median(x for _, _, x in self.rows)
        inside = [(cpu, x) for t, cpu, x in self.rows if since_wall <= t <= until_wall]
        out: Dict[str, Any] = {"probes": len(inside)}
        if inside:
            mid = statistics.median(x for _, x in inside)
            out.update(all_cpus=round(mid / usual, 3), all_cpus_us=round(mid * 1e6, 1), run_us=round(usual * 1e6, 1))
        wanted = set(cpus)
        mine = [x for cpu, x in inside if cpu in wanted]
        if mine:
            out["these_cpus"] = round(statistics.median(mine) / usual, 3)
        return out


class StackProfile:
    """py-spy (the dev extra; on the GPU machine carried in ``.whl/``, installed into /tmp/pyspy: bench/README.md)
    sampling one process's Python stacks without pausing it (``--nonblocking``), ``seconds`` long, from the moment
    ``ready()`` first returns a pid (asked every 0.5 s, in a thread). ``summary`` says where the samples were: by
    function, as the innermost frame (self) and anywhere in the stack (inclusive), over every thread's samples, idle
    ones left out (py-spy's default). Where SGLang's scheduler spends a decode step, for one."""

    def __init__(self, path: str, ready: Callable[[], Optional[int]], seconds: float = 10.0, rate: int = 500):
        self.path, self.ready, self.seconds, self.rate = path, ready, seconds, rate
        self.pid: Optional[int] = None
        self.cmd: Optional[str] = None
        self.error: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-profile", daemon=True)
        self._thread.start()

    @staticmethod
    def binary() -> Optional[str]:
        """py-spy beside this Python (a virtual environment's bin/, not always on PATH), on PATH, or in /tmp/pyspy
        (bench/README.md installs it there on the GPU machine: the device bundle's install replaces /tmp/site/bin)."""
        here = os.path.join(os.path.dirname(sys.executable), "py-spy")
        return here if os.access(here, os.X_OK) else \
            shutil.which("py-spy") or next(iter(glob.glob("/tmp/pyspy/bin/py-spy")), None)

    def _run(self) -> None:
        spy = self.binary()
        if spy is None:
            self.error = "no py-spy (carry its wheel in .whl/ and install it into /tmp/pyspy: bench/README.md)"
            return
        try:
            while self.pid is None and not self._stop.wait(0.5):
                self.pid = self.ready()
        except Exception as e:  # noqa: BLE001 - said in the summary, not lost with the thread
            self.error = f"ready() raised {e!r}"
            return
        if self.pid is None or self._stop.is_set():
            self.error = "never recorded: the run ended before a process was named"
            return
        self.cmd = command_line(self.pid)
        try:
            out = subprocess.run([spy, "record", "--pid", str(self.pid), "--duration", str(max(1, round(self.seconds))),
                                  "--rate", str(self.rate), "--nonblocking", "--format", "raw", "--output", self.path],
                                 capture_output=True, text=True, timeout=self.seconds + 30)
        except subprocess.TimeoutExpired:
            self.error = "py-spy did not finish"
            return
        if out.returncode != 0:
            self.error = f"py-spy rc {out.returncode}: {(out.stderr or out.stdout).strip()[-300:]}"

    def stop(self) -> None:
        """No recording starts after this; one under way is waited for."""
        self._stop.set()
        self._thread.join(self.seconds + 30)

    def summary(self, top: int = 25) -> Dict[str, Any]:
        """Where the samples were (``stack_summary``), with the pid, the seconds and the rate, or why none."""
        out: Dict[str, Any] = {"pid": self.pid, "cmd": self.cmd, "seconds": self.seconds, "rate": self.rate}
        if self.error:
            out["error"] = self.error
        out.update(stack_summary(read_text(self.path), top))
        return out


def stack_summary(text: str, top: int = 25) -> Dict[str, Any]:
    """The ``top`` functions by their share of the samples, self and inclusive, from py-spy's collapsed stacks (one
    ``frame;frame;...;frame count`` a line, innermost last; a frame ``function (file:line)``, counted here by function
    and file)."""
    own: Dict[str, int] = {}
    anywhere: Dict[str, int] = {}
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        # a sample without a Python frame (the thread in native code only) is a line of its count alone
        frames = [stack_frame(f) for f in stack.split(";")] if stack else ["(no Python frame)"]
        total += int(count)
        own[frames[-1]] = own.get(frames[-1], 0) + int(count)
        for f in set(frames):
            anywhere[f] = anywhere.get(f, 0) + int(count)
    out: Dict[str, Any] = {"samples": total}
    for key, counts in (("self", own), ("inclusive", anywhere)):
        best = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
        out[key] = [[f, round(n / total, 4)] for f, n in best] if total else []
    return out


def stack_frame(frame: str) -> str:
    """``function (path/to/file.py:123)`` as ``function (to/file.py)``: one name for a function wherever it was."""
    m = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame.strip())
    if not m:
        return frame.strip()
    path = "/".join(m.group(2).split("/")[-2:])
    return f"{m.group(1)} ({path})"


def cpu_shares(before: Any, after: Any) -> Tuple[float, float]:
    """One CPU's busy and steal shares between two ``psutil.cpu_times(percpu=True)`` entries (idle, iowait and steal
    are not busy; guest time is already in user and nice, so not counted twice), each within [0, 1] (a kernel's idle
    and iowait counters can step back)."""
    def delta(field: str) -> float:
        return getattr(after, field, 0.0) - getattr(before, field, 0.0)

    total = sum(after) - sum(before) - delta("guest") - delta("guest_nice")
    if total <= 0:
        return 0.0, 0.0
    idle, iowait, steal = delta("idle"), delta("iowait"), delta("steal")
    return (round(min(max(1 - (idle + iowait + steal) / total, 0.0), 1.0), 3),
            round(min(max(steal / total, 0.0), 1.0), 3))


def cpu_siblings(root: str = "/sys/devices/system/cpu") -> Dict[int, List[int]]:
    """Each CPU's hyperthread siblings (other than itself), from sysfs; empty where sysfs does not say."""
    out: Dict[int, List[int]] = {}
    for path in glob.glob(os.path.join(root, "cpu[0-9]*", "topology", "thread_siblings_list")):
        cpu = int(re.search(r"cpu(\d+)/topology", path).group(1))
        text = read_text(path).strip()
        if not text:
            continue
        ids = []
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            ids += range(int(lo), int(hi or lo) + 1)
        out[cpu] = [i for i in ids if i != cpu]
    return out


# ------------------------------------------------------------------------------------- logs
def plan_of(args: List[str], env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """The memory plan of a command line: ``run.py ... dry_run=true``'s estimate lines, parsed."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), *args, "dry_run=true"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=env)
    text = out.stdout + out.stderr
    plan: Dict[str, Any] = {"returncode": out.returncode}
    for key, pattern in (("trainer_gib", r"^\s*trainer: ([\d.]+) ="), ("engine_gib", r"engine: ([\d.]+) ="),
                         ("training_peak_gib", r"colocated GPU, training: ([\d.]+)"),
                         ("rollout_peak_gib", r"colocated GPU, rollout: ([\d.]+)"),
                         ("push_peak_gib", r"colocated GPU, push: ([\d.]+)")):
        m = re.search(pattern, text, re.M)
        plan[key] = float(m.group(1)) if m else None
    m = re.search(r"^\s*trainer: [\d.]+ = (.*)$", text, re.M)
    plan["trainer_parts"] = m.group(1) if m else None
    m = re.search(r"offload: train=(\w+) rollout=(\w+)", text)
    plan["offload"] = m.groups() if m else None
    if out.returncode:
        plan["error"] = text[-1500:]
    return plan


def copy_logs(dest: str, files: Iterable[str] = (), run_dirs: Iterable[str] = (), lines: int = 80) -> None:
    """The last ``lines`` of each file, and of each run dir's run.log and logs/*.log (named
    ``<run dir>_<log>``), with each run dir's metrics.jsonl whole, into ``dest``. (A device call brings
    back at most 8 files of $OUT: bench/README.md.)"""
    from slime_hydra.utils.proc import tail

    named = [(os.path.basename(f), f) for f in files]
    for d in (d.rstrip("/") for d in run_dirs):
        logs = [os.path.join(d, "run.log"), *sorted(glob.glob(os.path.join(d, "logs", "*.log"))),
                os.path.join(d, "metrics.jsonl")]
        named += [(f"{os.path.basename(d)}_{os.path.basename(f)}", f) for f in logs]
    os.makedirs(dest, exist_ok=True)
    for name, f in named:
        if os.path.isfile(f) and name.endswith(".jsonl"):
            shutil.copy(f, os.path.join(dest, name))
        elif os.path.isfile(f):
            write_text(os.path.join(dest, name), tail(f, lines) + "\n")


def steps_table(metrics: str, keys: Sequence[str]) -> List[str]:
    """A markdown table of ``keys`` per step of a ``metrics.jsonl``."""
    return table(["step", *keys], [[r.get("step"), *(cell(r.get(k), ".4g") for k in keys)] for r in read_rows(metrics)])


if __name__ == "__main__":  # python3 bench/gpu/harness.py RUN_DIR/metrics.jsonl KEY ...: the shell benches' step table
    if len(sys.argv) < 3:
        sys.exit("usage: python3 bench/gpu/harness.py METRICS_JSONL KEY [KEY ...]")
    print("\n".join(steps_table(sys.argv[1], sys.argv[2:])))
