"""bench/gpu/harness.py, the part of every GPU bench that needs no GPU: the time budget shared by the
phases of a device call, phases as child processes (one that fails or hangs leaves what it measured),
result files written whole, tables, log tails, nvidia-smi's CSV (``--query-gpu=timestamp,index,
memory.used,utilization.gpu --format=csv,noheader,nounits``) and the metrics rows of a run as they appear.
The benches only run on the lent machine, so these run here, on what those would see."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, running

sys.path.insert(0, str(ROOT / "bench"))
from gpu.harness import Budget, CpuSampler, GpuSampler, copy_logs, read_rows, run_child, steps_table, table, write_json  # noqa: E402

# bench/sglang_gpu.py's phases: (the least each finishes in, the most it may take)
PLAN = {"build": (20, 90), "raw": (150, 180), "sglang": (150, 230), "trl": (50, 120)}


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_phase_gets_what_is_left_less_what_later_phases_need():
    clock = Clock()
    plan = Budget(540, clock=clock).plan(list(PLAN), PLAN)
    assert next(plan) == ("build", 90, None)  # 540 - (150 + 150 + 50) = 190 left for it, capped at 90
    clock.t = 43
    assert next(plan) == ("raw", 180, None)  # 497 - 200
    clock.t = 223
    assert next(plan) == ("sglang", 230, None)  # 317 - 50
    clock.t = 453
    assert next(plan) == ("trl", 87, None)  # the last phase: all that is left, over its cap if need be
    assert next(plan, None) is None


def test_a_phase_that_cannot_get_its_need_is_skipped_and_the_next_still_runs():
    clock = Clock()
    plan = Budget(540, clock=clock).plan(list(PLAN), PLAN)
    next(plan), next(plan)
    clock.t = 400  # raw overran: 140 s left, 50 of them trl's
    assert next(plan) == ("sglang", 90, "90s left, needs 150s")
    assert next(plan) == ("trl", 140, None)


def test_without_needs_a_phase_may_take_the_rest_down_to_the_floor():
    clock = Clock()
    plan = Budget(100, floor=30, clock=clock).plan(["a", "b"])
    assert next(plan) == ("a", 100, None)
    clock.t = 80
    assert next(plan) == ("b", 20, "20s left, needs 30s")


CHILD = """import sys, time
sys.path.insert(0, {bench!r})
from gpu.harness import phase_output
phase = sys.argv[sys.argv.index("--phase") + 1]
with phase_output(sys.argv[1], every_s=0.1) as out:
    out["limit"] = float(sys.argv[sys.argv.index("--limit") + 1])
    if phase == "hang":
        time.sleep(60)
    if phase == "fail":
        raise RuntimeError("boom")
    out["done"] = True
"""


@pytest.mark.parametrize("phase, want", [
    ("ok", {"limit": 5.0, "done": True, "phase_rc": 0}),
    ("fail", {"limit": 5.0, "error": "RuntimeError('boom')", "phase_rc": 1}),
    ("hang", {"limit": 0.5, "phase_rc": "timeout"}),  # killed; what it saved before is there
])
def test_a_phase_child_leaves_what_it_measured_however_it_ends(tmp_path, phase, want):
    script = tmp_path / "bench.py"
    script.write_text(CHILD.format(bench=str(ROOT / "bench")))
    result = tmp_path / f"{phase}.json"
    result.write_text('{"stale": true}')  # a earlier call's result is not taken for this one's
    got = run_child(phase, want["limit"], str(result), argv=[str(script), str(result)], grace_s=1.0)
    assert got == want


def test_result_json_is_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "out" / "result.json"
    write_json(str(path), {"step_s": 1.41, "gpu": "H200"})
    assert json.loads(path.read_text()) == {"step_s": 1.41, "gpu": "H200"}
    circular = {}
    circular["self"] = circular
    with pytest.raises(ValueError):
        write_json(str(path), circular)
    assert json.loads(path.read_text()) == {"step_s": 1.41, "gpu": "H200"}  # the last good one stays
    assert [p.name for p in path.parent.iterdir()] == ["result.json"]  # no temp file left behind


def test_table_pads_short_rows():
    assert table(["", "step s", "steps"], [["run.py", "1.41", 6], ["TRL", "no steps: rc 1"]]) == [
        "|  | step s | steps |", "|---|---|---|", "| run.py | 1.41 | 6 |", "| TRL | no steps: rc 1 |  |"]


def test_steps_table_from_the_command_line(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0, "perf/step_time": 2.651}\n{"step": 1, "perf/step_time": 1.4123, "x": 1}\n')
    assert steps_table(str(metrics), ["perf/step_time", "train/kl_loss"])[2:] == [
        "| 0 | 2.651 | - |", "| 1 | 1.412 | - |"]
    out = subprocess.run([sys.executable, str(ROOT / "bench/gpu/harness.py"), str(metrics), "perf/step_time"],
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["| step | perf/step_time |", "|---|---|", "| 0 | 2.651 |", "| 1 | 1.412 |"]


def test_copy_logs_keeps_the_tails_and_the_metrics(tmp_path):
    work, dest = tmp_path / "work", tmp_path / "out" / "logs"
    (work / "run_colocated_sglang" / "logs").mkdir(parents=True)
    (work / "raw_colocated_server.log").write_text("".join(f"line {i}\n" for i in range(200)))
    (work / "run_colocated_sglang" / "run.log").write_text("started\n")
    (work / "run_colocated_sglang" / "logs" / "engine_0.log").write_text("up\n")
    (work / "run_colocated_sglang" / "metrics.jsonl").write_text('{"step": 0}\n')
    copy_logs(str(dest), [str(work / "raw_colocated_server.log"), str(work / "missing.out")],
              [str(work / "run_colocated_sglang") + "/"])
    assert sorted(p.name for p in dest.iterdir()) == [
        "raw_colocated_server.log", "run_colocated_sglang_engine_0.log", "run_colocated_sglang_metrics.jsonl",
        "run_colocated_sglang_run.log"]
    lines = (dest / "raw_colocated_server.log").read_text().splitlines()
    assert len(lines) == 80 and lines[-1] == "line 199"
    assert (dest / "run_colocated_sglang_metrics.jsonl").read_text() == '{"step": 0}\n'


NVIDIA_SMI = """2026/12/01 03:00:00.123, 0, 1024, 0
2026/12/01 03:00:01.120, 1, 2048, 90
2026/12/01 03:00:02.118, 0, 30720, 100
2026/12/01 03:00:02.118, 1, 4096, 2
[Unknown Error]
2026/12/01 03:00:03.101, 0, 20480, 3
"""


def test_peaks_and_idle_share_from_nvidia_smi_lines(tmp_path):
    path = tmp_path / "gpu.csv"
    path.write_text(NVIDIA_SMI)
    sampler = GpuSampler(str(path), start=False)
    assert sampler.peaks() == {"gpu0": {"peak_gib": 30.0, "mean_util": 34.3},
                               "gpu1": {"peak_gib": 4.0, "mean_util": 46.0}}
    since = time.mktime(time.strptime("2026/12/01 03:00:02", "%Y/%m/%d %H:%M:%S"))
    assert sampler.idle_share(since) == {"gpu0": {"samples": 2, "idle_share": 0.5, "mean_util": 51.5},
                                         "gpu1": {"samples": 1, "idle_share": 1.0, "mean_util": 2.0}}


def test_busy_clocks_and_power_from_the_query(tmp_path):
    path = tmp_path / "gpu.csv"
    path.write_text("2026/12/01 03:00:01.000, 0, 1000, 90, 1980, 400.5, 3201\n"
                    "2026/12/01 03:00:02.000, 0, 1000, 10, 1200, 120.0, 3201\n"   # idle: not counted
                    "2026/12/01 03:00:03.000, 0, 1000, 60, 1500, 300.5, 2601\n"
                    "2026/12/01 03:00:04.000, 0, 1000, 95, [N/A], [N/A], 3201\n"  # the clock unread: the rest counts
                    "2026/12/01 03:00:05.000, 0, [N/A], 95, 1980, 1, 3201\n")  # no memory reading: skipped
    sampler = GpuSampler(str(path), start=False)
    assert sampler.busy(0) == {"gpu0": {"samples": 3, "sm_mhz_mean": 1740, "sm_mhz_min": 1500.0,
                                        "power_w_mean": 350.5, "mem_mhz_mean": 3001}}
    assert sampler.peaks()["gpu0"] == {"peak_gib": round(1000 / 1024, 1), "mean_util": 63.8}
    third = time.mktime(time.strptime("2026/12/01 03:00:03", "%Y/%m/%d %H:%M:%S"))
    assert sampler.busy(third, third + 0.5)["gpu0"]["samples"] == 1  # one step's window, to the millisecond
    assert sampler.busy(third + 0.001, third + 0.5) == {}
    assert list(sampler.samples())[1] == (time.mktime(time.strptime("2026/12/01 03:00:02", "%Y/%m/%d %H:%M:%S")),
                                          "gpu0", 1000.0, 10.0)
    path.write_text("2026/12/01 03:00:01.000, 0, 1000, 90, 1980, 400.5\n")  # the six-field query of before
    assert "mem_mhz_mean" not in sampler.busy(0)["gpu0"]


def test_read_rows_waits_for_whole_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_rows(str(path)) == []
    path.write_text('{"step": 0}\n{"step": 1}\n')
    assert read_rows(str(path)) == [{"step": 0}, {"step": 1}]
    path.write_text('{"step": 0}\n{"ste')
    assert read_rows(str(path)) == []


def test_cpu_sampler_sees_a_busy_process_in_its_window():
    import subprocess
    import sys

    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    sampler = CpuSampler(interval_s=0.2)
    t0 = time.time()
    busy.wait()
    sampler.stop()
    top = sampler.window(t0, time.time(), top=3)
    mine = [p for p in top if p["pid"] == busy.pid]
    assert mine and mine[0]["cpu"] > 0.5 and "time.time()" in mine[0]["cmd"], top
    assert mine[0]["on_cpus"] and set(mine[0]["on_cpus"]) <= set(range(os.cpu_count())), mine
    assert mine[0]["involuntary_per_s"] >= 0 and 0 <= mine[0]["cpu_steal"] <= 1, mine
    host = sampler.host(t0, time.time())
    assert host["busy_cpus"] > 0.5 and 0 <= host["steal_max"] <= 1, host  # the busy loop holds one CPU
    assert sampler.window(0, 1) == [] and sampler.host(0, 1) == {}


def test_cpu_siblings_and_shares(tmp_path):
    from collections import namedtuple

    from gpu.harness import cpu_shares, cpu_siblings

    for cpu, text in ((0, "0,2"), (2, "0,2"), (1, "1"), (3, "3-4")):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text + "\n")
    assert cpu_siblings(str(tmp_path)) == {0: [2], 2: [0], 1: [], 3: [4]}
    Times = namedtuple("Times", "user system idle iowait steal")
    # of 10 ticks: 5 busy, 3 idle, 2 stolen by the hypervisor
    assert cpu_shares(Times(0, 0, 0, 0, 0), Times(4, 1, 3, 0, 2)) == (0.5, 0.2)
    assert cpu_shares(Times(1, 1, 1, 1, 1), Times(1, 1, 1, 1, 1)) == (0.0, 0.0)


def test_sglang_batch_lines_are_read_with_their_time(tmp_path):
    from gpu.sglang_server import sglang_batches

    log = tmp_path / "engine_0.log"
    log.write_text(
        "[2026-12-03 06:36:41.230] Prefill batch, #new-seq: 8, #new-token: 512, #cached-token: 0, token usage: 0.00, "
        "#running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: False, input throughput (token/s): 0.08\n"
        "[2026-12-03 06:36:41] INFO:     127.0.0.1:5 - \"POST /generate HTTP/1.1\" 200 OK\n"
        "[2026-12-03 06:36:41.530] Decode batch, #running-req: 64, #token: 20000, token usage: 0.03, cuda graph: True, "
        "gen throughput (token/s): 21000.55, #queue-req: 0\n")
    got = sglang_batches(str(log))
    t0 = time.mktime(time.strptime("2026-12-03 06:36:41", "%Y-%m-%d %H:%M:%S"))
    assert got == [{"t": pytest.approx(t0 + 0.23), "prefill_seqs": 8},
                   {"t": pytest.approx(t0 + 0.53), "decode_running": 64, "tokens_per_s": 21000.55}]


def test_cpu_probe_times_python_on_every_cpu(tmp_path):
    from gpu.harness import CpuProbe

    probe = CpuProbe(str(tmp_path / "probe.txt"), every_s=0.1, n=2000)
    t0, deadline = time.time(), time.monotonic() + 20
    while time.monotonic() < deadline:  # every CPU probed twice (the child's start takes a while on a busy machine)
        rows = CpuProbe.read(probe.path).rows
        if all(sum(cpu == c for _, cpu, _ in rows) >= 2 for c in os.sched_getaffinity(0)):
            break
        time.sleep(0.1)
    probe.stop()
    assert probe.proc.returncode is not None
    assert {cpu for _, cpu, _ in probe.rows} == set(os.sched_getaffinity(0)), probe.rows
    assert all(x > 0 for _, _, x in probe.rows)
    got = probe.window(t0, time.time(), cpus=[min(os.sched_getaffinity(0))])
    assert got["probes"] >= 2 and got["all_cpus"] > 0 and got["these_cpus"] > 0, got
    assert got["all_cpus_us"] > 0 and got["run_us"] > 0, got  # absolute: runs compare
    assert probe.window(0, 1) == {"probes": 0}


def test_rollout_speed_reads_the_committed_results():
    """bench/rollout_speed.py's table from two of the committed runs (one with its probe), as
    bench/measured/h200_rollout_cpu.md quotes it."""
    m = ROOT / "bench" / "measured" / "h200_rollout_cpu"
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "rollout_speed.py"), f"d3={m}_d3.json",
                          f"e1={m}_e1.json:{m}_e1_probe.txt"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "| d3 | sglang_warm | 44.3 | 7 | 0.996 | 0.893-1.034 | 19657 |" in out.stdout, out.stdout
    assert "| e1 | sglang | 68.3 | 9 | 0.897 |" in out.stdout, out.stdout
    assert "| +0.73 (9) | 1.016-1.176 |" in out.stdout, out.stdout
    assert "e1: the probe's time, ms: median 2.40, first decile 1.36, last 2.92" in out.stdout, out.stdout


def test_stack_profile_finds_where_a_busy_process_spends_its_time(tmp_path):
    """py-spy on a child that spends its time in one function, started once ``ready`` names it; the summary gives
    that function the most samples, self and inclusive."""
    from gpu.harness import StackProfile, stack_frame

    code = "import time\ndef spin():\n    x = 0\n    while True:\n        x += 1\nspin()\n"
    busy = subprocess.Popen([sys.executable, "-c", code])
    asked = []

    def ready():
        asked.append(time.time())
        return busy.pid if len(asked) >= 2 else None  # not at once: the thread asks again

    try:
        profile = StackProfile(str(tmp_path / "stacks.txt"), ready, seconds=2, rate=200)
        deadline = time.monotonic() + 20
        while profile.pid is None and time.monotonic() < deadline:  # the second ask names it
            time.sleep(0.05)
        profile.stop()  # waits for the recording
    finally:
        busy.kill()
        busy.wait()
    got = profile.summary()
    assert "error" not in got and got["pid"] == busy.pid and got["samples"] > 100, got
    assert "def spin" in got["cmd"], got["cmd"]
    assert got["self"][0][0].startswith("spin (") and got["self"][0][1] > 0.9, got["self"]
    assert any(f.startswith("<module> (") for f, _ in got["inclusive"]), got["inclusive"]
    assert stack_frame("process_batch (managers/scheduler.py:123)") == "process_batch (managers/scheduler.py)"
    assert stack_frame("run (/a/b/sglang/srt/x.py:7)") == "run (srt/x.py)"


def test_stack_summary_counts_self_inclusive_and_native_samples():
    from gpu.harness import stack_summary

    text = ("172\n"  # samples in native code only
            "<module> (/x/a/b.py:1);loop (/x/a/b.py:9);step (/x/a/c.py:3) 20\n"
            "<module> (/x/a/b.py:1);loop (/x/a/b.py:10) 8\n")
    got = stack_summary(text)
    assert got["samples"] == 200
    assert got["self"] == [["(no Python frame)", 0.86], ["step (a/c.py)", 0.1], ["loop (a/b.py)", 0.04]]
    assert dict(got["inclusive"])["loop (a/b.py)"] == 0.14 and dict(got["inclusive"])["<module> (a/b.py)"] == 0.14
    assert stack_summary("") == {"samples": 0, "self": [], "inclusive": []}


def test_stack_profile_says_why_it_recorded_nothing(tmp_path):
    from gpu.harness import StackProfile

    never = StackProfile(str(tmp_path / "a.txt"), lambda: None, seconds=1)
    time.sleep(0.7)
    never.stop()
    assert never.summary()["error"].startswith("never recorded") and never.summary()["samples"] == 0

    def broken():
        raise RuntimeError("no such file")

    raised = StackProfile(str(tmp_path / "b.txt"), broken, seconds=1)
    time.sleep(0.7)
    raised.stop()
    assert "RuntimeError('no such file')" in raised.summary()["error"]


def test_cpu_probe_ends_with_its_parent(tmp_path):
    """A probe whose bench died (killed past its limit) stops probing instead of visiting every CPU for ever."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r})\n"
            "from gpu.harness import CpuProbe\n"
            f"p = CpuProbe({str(tmp_path / 'probe.txt')!r}, every_s=0.1, n=100)\n"
            "print(p.proc.pid, flush=True)\n"
            "import time; time.sleep(60)\n")
    bench = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(bench.stdout.readline())
    bench.kill()
    bench.wait()
    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(child), "the probe outlived its bench"
