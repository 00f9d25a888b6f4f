"""The real loop: ``python run.py`` through Hydra, a local Ray cluster, the embedded engine behind
sglang-router over HTTP, the torch trainer, and weight sync. Each test is one (short) run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from runs import ENV, FAST, leftover_processes, metrics, run

pytestmark = pytest.mark.integration


def test_colocated_cpu_with_tensor_transport(tmp_path):
    """Trainer and engine share one slot: the engine releases its memory while the trainer trains,
    weights go through shared memory (update_weights_from_tensor). The start-up's parts (launch/startup.py)
    go to the first step's row, summary.json and the console. With trainer.save_last=false (and save_interval
    beyond the run) it saves nothing."""
    d = tmp_path / "run"
    summary = run(d, "parallelism=cpu_colocate", "trainer.num_rollout=4", "trainer.save_last=false", *FAST)
    assert not (d / "checkpoints").exists()
    assert summary["max_logprob_abs_diff"] < 1e-3
    assert "tensor" in (d / "config.yaml").read_text()
    rows = metrics(d)
    assert all(r["perf/offload_time"] > 0 for r in rows[1:])  # the engine released and resumed every step
    start = summary["startup"]
    for part in ("before_train", "initial_checkpoint", "ray_init", "placement_group", "trainers",
                 "wait_for_rollout_side", "first_push", "eval_before_train", "first_step", "manager_actor", "data",
                 "engine_actor", "engine_server", "rollout_side"):
        assert start[f"{part}_s"] >= 0, part
    assert start["first_step_s"] == pytest.approx(rows[1]["perf/step_time"], abs=0.01)
    # the parts on the driver's path fit in the whole (the rollout side overlaps the trainers)
    path = sum(start[f"{p}_s"] for p in ("before_train", "initial_checkpoint", "ray_init", "placement_group",
                                         "trainers", "wait_for_rollout_side", "first_push", "eval_before_train",
                                         "first_step"))
    assert path <= start["total_s"] <= path + 5, start
    assert rows[1]["startup/total_s"] == start["total_s"] and not any("startup/total_s" in r for r in rows[2:])
    assert "start-up: " in (d / "run.log").read_text()


@pytest.mark.slow  # 34 s; test_colocated_cpu_with_tensor_transport is the fast colocated run
def test_colocated_cpu_without_offload(tmp_path):
    """``offload_train=false offload_rollout=false``: the engine keeps its memory and the trainer its
    state; nothing moves, and the weights still reach the engine after every step (a stale engine
    would fail the run at the log-prob gap guard, 1e-3 here). With the trainers' warm-up pass (on by default on
    GPUs only), timed as a start-up part."""
    d = tmp_path / "run"
    summary = run(d, "parallelism=cpu_colocate", "parallelism.offload_train=false",
                  "parallelism.offload_rollout=false", "trainer.num_rollout=3", "trainer.warm_up=true", *FAST)
    rows = metrics(d)[1:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["startup/trainer_warm_up_s"] > 0
    assert all(r["perf/offload_time"] == 0 and r["perf/weight_sync_bytes"] > 0 for r in rows)
    assert summary["max_logprob_abs_diff"] < 1e-3 and summary["train_reward_last"] is not None
    assert "offload_rollout: false" in (d / "config.yaml").read_text()


def test_async_on_colocated_slots_trains_beside_the_next_rollout(tmp_path):
    """``trainer.mode=async`` on one colocated slot: the offloads resolve false (both sides stay resident), the
    next rollout generates while the trainer trains, and the weights go through shared memory after each step
    once that rollout is done. Every step's row is written; the first rollout was made by the initial weights
    and trained at once (staleness 0), each later one by the weights one step behind the trainer's."""
    d = tmp_path / "run"
    summary = run(d, "parallelism=cpu_colocate", "trainer.mode=async", "trainer.num_rollout=3",
                  "trainer.save_last=false", *FAST)
    config = (d / "config.yaml").read_text()
    assert "offload_train: false" in config and "offload_rollout: false" in config and "transport: tensor" in config
    rows = metrics(d)[1:]
    assert [r["step"] for r in rows] == [1, 2, 3] and summary["steps"] == 3
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]
    assert all(r["perf/offload_time"] == 0 and r["perf/weight_sync_bytes"] > 0 for r in rows)  # pushed every step
    # one step off-policy: the trainer's log-probs differ from those of the older weights that sampled
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in rows[1:]) > 1e-4
    assert not leftover_processes()


@pytest.mark.slow
def test_disk_transport_two_trainers_async(tmp_path):
    """Two data-parallel trainer ranks (DDP over gloo), weights through disk, one-step off-policy loop."""
    d = tmp_path / "run"
    summary = run(d, "parallelism.trainer_gpus=2", "parallelism.gpus_per_node=3", "sync.transport=disk",
                  "trainer.mode=async", "trainer.num_rollout=4", *FAST)
    rows = metrics(d)
    assert len(rows) == 5
    # one step off-policy: the trainer's recomputed log-probs differ from the engine's (older weights)
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in rows[2:]) > 1e-4
    assert summary["steps"] == 4


@pytest.mark.slow
def test_resume_continues_where_it_stopped(tmp_path):
    d = tmp_path / "run"
    run(d, "trainer.num_rollout=4", "trainer.save_interval=2", *FAST)
    state4 = json.loads((d / "checkpoints" / "step_000004" / "data_state.json").read_text())
    run(d, "trainer.num_rollout=6", "trainer.save_interval=2", "trainer.resume=auto", *FAST)
    rows = metrics(d)
    assert [r["step"] for r in rows] == list(range(7))
    state6 = json.loads((d / "checkpoints" / "step_000006" / "data_state.json").read_text())
    assert state6["next_group_index"] == state4["next_group_index"] + 2 * 32  # no prompt skipped or repeated


@pytest.mark.slow
def test_sweep_runs_each_job_in_its_own_directory(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "run.py", "-m", "algo.lr=1e-3,3e-3", "algo.lr_decay=constant", "trainer.num_rollout=2",
           f"hydra.sweep.dir={sweep}", *FAST]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    dirs = sorted(p for p in sweep.iterdir() if (p / "summary.json").exists())
    assert len(dirs) == 2
    lrs = sorted(float(json.loads((p / "metrics.jsonl").read_text().splitlines()[1])["train/lr"]) for p in dirs)
    assert lrs == [1e-3, 3e-3]
    assert not leftover_processes()


def test_ctrl_c_stops_cleanly(tmp_path):
    """SIGINT mid-run: the process exits within 10 s (it once took over 60 s on a loaded machine: the
    driver asked its actors to shut down, which waited behind the rollout or training step they were
    running, and the interpreter's teardown took 6 s more), no Ray/engine/router process survives, and
    the last complete checkpoint is intact."""
    d = tmp_path / "run"
    cmd = [sys.executable, "run.py", f"hydra.run.dir={d}", "trainer.num_rollout=500", "trainer.save_interval=2", *FAST]
    # Ctrl-C's SIGINT as a terminal sends it. A suite started in the background (`make test &`, a CI
    # runner without job control) runs with SIGINT ignored, which every child inherits: Python then never
    # raises KeyboardInterrupt, and the run went on for minutes (the earlier "did not stop within 60 s").
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while not (d / "checkpoints" / "latest").exists():
        time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 300 s of the start (a very loaded machine?)"
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("run did not stop within 10 s of SIGINT")
    time.sleep(2)
    assert not leftover_processes(), leftover_processes()
    latest = (d / "checkpoints" / "latest").read_text().strip()
    ckpt = d / "checkpoints" / latest
    assert (ckpt / "meta.json").exists() and (ckpt / "hf" / "config.json").exists()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt / "hf")
