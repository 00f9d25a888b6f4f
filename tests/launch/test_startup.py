"""The start-up's account (launch/startup.py): the parts of an SGLang server's start read from its log,
the rollout side's report folded into the driver's clock, the console's line, and what the watch says
about each engine while the run starts. The run itself is checked in tests/launch/test_e2e.py."""

from __future__ import annotations

import logging
import time
from datetime import datetime

import pytest

from conftest import resolved
from slime_hydra.launch.startup import StartupClock, StartupWatch, engine_log_status
from slime_hydra.plan.resources import engine_batch, make_plan
from slime_hydra.rollout.engines.embedded import EmbeddedEngine
from slime_hydra.rollout.engines.sglang.engine import SglangEngine

T0 = datetime(2026, 12, 1, 16, 14, 51).timestamp()


def stamp(seconds: float, ms: bool = True) -> str:
    t = datetime.fromtimestamp(T0 + seconds)
    return t.strftime("%Y-%m-%d %H:%M:%S") + (f".{int(round(t.microsecond / 1000)):03d}" if ms else "")


def sglang_log(ms: bool = True, graphs: bool = True, offset: float = 0.0) -> str:
    """A server log as sglang 0.5.17 writes it (its own messages, SGLANG_LOG_MS on), started at T0 + offset."""
    lines = [(3.0, "server_args=ServerArgs(model_path='/ckpt', ...)"),
             (9.5, "Init torch distributed begin."),
             (11.0, "Init torch distributed ends. elapsed=1.50 s, mem usage=0.00 GB"),
             (12.0, "Load weight begin. avail mem=139.20 GB"),
             (12.4, "Load weight end. elapsed=0.35 s, type=Qwen3ForCausalLM, avail mem=138.05 GB, mem usage=1.15 GB."),
             (14.0, "KV Cache is allocated. #tokens: 644965, K size: 34.45 GB, V size: 34.45 GB"),
             (14.1, "Memory pool end. avail mem=68.90 GB"),
             (14.2, "max_total_num_tokens=644965, chunked_prefill_size=8192, max_prefill_tokens=16384, "
                    "max_running_requests=4096, context_len=40960, available_gpu_mem=68.85 GB")]
    if graphs:
        lines += [(15.0, "Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, "
                         "bs=[1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64], avail mem=68.50 GB"),
                  (41.1, "Capture target decode CUDA graph end. elapsed=26.05 s, mem usage=0.40 GB, "
                         "avail mem=68.10 GB.")]
    lines += [(43.0, "INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)"),
              (44.2, "The server is fired up and ready to roll!")]
    out = [f"[{stamp(offset + t, ms)}{' TP0' if 'Load' in m else ''}] {m}" for t, m in lines]
    out.insert(5, "Capturing batches (bs=64 avail_mem=68.50 GB):  50%|#####     | 6/12\rnot a log line")
    return "\n".join(out) + "\n"


def test_sglang_start_parts_from_its_log():
    parts = SglangEngine.startup_parts(sglang_log(), T0, T0 + 45.0)
    assert parts == {"process_s": 9.5, "distributed_init_s": 2.5, "weights_s": 0.4, "kv_cache_s": 1.7,
                     "cuda_graphs_s": 27.0, "http_server_s": 3.1, "first_answer_s": 0.8, "graph_capture_s": 26.05,
                     "kv_tokens": 644965}
    # they add up to the server's start, and seconds-only timestamps (SGLANG_LOG_MS off) still parse
    assert sum(v for k, v in parts.items() if k not in ("graph_capture_s", "kv_tokens")) == pytest.approx(45.0)
    coarse = SglangEngine.startup_parts(sglang_log(ms=False), T0, T0 + 45.0)
    assert coarse["cuda_graphs_s"] == pytest.approx(27.0, abs=1.0)


def test_sglang_start_parts_without_graphs_or_lines():
    """No decode graphs (disabled): the KV cache runs to the HTTP server; no log at all: no parts."""
    parts = SglangEngine.startup_parts(sglang_log(graphs=False), T0, T0 + 45.0)
    assert "cuda_graphs_s" not in parts and parts["http_server_s"] == pytest.approx(30.1)
    assert SglangEngine.startup_parts("", T0, T0 + 45.0) == {}
    assert EmbeddedEngine.startup_parts(sglang_log(), T0, T0 + 45.0) == {}


def test_clock_folds_in_the_rollout_side_and_says_it_in_one_line():
    clock = StartupClock(launched=T0)
    clock.add("before_train", 18.0)
    clock.add("ray_init", 6.0)
    clock.add("trainers", 20.0)
    clock.add("trainers", 1.0)  # rebuilt once: the part adds up
    parts = SglangEngine.startup_parts(sglang_log(offset=30.0), T0 + 30.0, T0 + 75.0)
    report = {"created": T0 + 26.0, "launched": T0 + 28.0, "data_s": 3.0, "up": T0 + 76.0,
              "engines": [{"rank": 0, "started": T0 + 30.0, "ready": T0 + 75.0, "parts": parts},
                          {"rank": 1, "started": T0 + 29.5, "ready": T0 + 60.0, "parts": {}}]}
    clock.add_rollout_side(report, created_at=T0 + 25.0)
    clock.done_at = T0 + 80.0
    m = clock.metrics()
    assert m["startup/trainers_s"] == 21.0 and m["startup/total_s"] == 80.0
    assert m["startup/manager_actor_s"] == 1.0 and m["startup/engines_launch_s"] == 2.0
    assert m["startup/rollout_side_s"] == 51.0 and m["startup/engine_actor_s"] == 2.0  # the later engine's spawn
    assert m["startup/engine_server_s"] == 45.0 and m["startup/engine_cuda_graphs_s"] == 27.0  # the slower engine
    assert m["startup/engine_kv_tokens"] == 644965
    line = clock.line()
    assert line.startswith("start-up: 80.0s from launch to the first step done: before train 18.0, ray init 6.0, "
                           "trainers 21.0; rollout side 51.0 from its creation: manager actor 1.0, data 3.0, "
                           "engine actor 2.0, server 45.0 (process 9.5, torch.distributed 2.5, weights 0.4"), line


def test_clock_counts_the_kernels_built_beside_the_server():
    """The kernel prebuild beside the servers (rollout/engines/sglang/fast_start.py) is a part of its own: the one that
    built, whichever engine ran it (the others on its node find the kernels claimed)."""
    clock = StartupClock(launched=T0)
    parts = SglangEngine.startup_parts(sglang_log(), T0, T0 + 45.0)
    prebuild = {"kernels": [{"kernel": "qknorm", "status": "ok", "seconds": 7.2}], "seconds": 31.2}
    claimed = {"kernels": [], "seconds": 0.4, "skipped": "another prebuild on this machine builds the same kernels"}
    clock.add_rollout_side({"created": T0, "launched": T0, "up": T0 + 46.0, "engines": [
        {"rank": 0, "started": T0, "ready": T0 + 44.0, "parts": parts, "prebuild": prebuild},
        {"rank": 1, "started": T0, "ready": T0 + 45.0, "parts": parts, "prebuild": claimed}]}, created_at=T0)
    clock.done_at = T0 + 50.0
    assert clock.metrics()["startup/engine_prebuild_s"] == 31.2
    assert "644,965 tokens of KV cache, its kernel prebuild beside it 31.2)" in clock.line()
    # a prebuild that built nothing (no GPU, no config) is not a part
    clock.add_rollout_side({"engines": [{"rank": 0, "started": T0, "ready": T0 + 45.0, "parts": parts,
                                         "prebuild": {"kernels": [], "skipped": "no GPU visible"}}]}, created_at=T0)
    assert "startup/engine_prebuild_s" not in clock.metrics()


def test_engine_log_status(tmp_path):
    (tmp_path / "engine_0.log").write_text("$ python -m sglang.launch_server --model-path m\n")
    (tmp_path / "engine_1.log").write_text(sglang_log().rsplit("\n", 2)[0] + "\nCapturing batches (bs=8):  "
                                           "10%|#| 1/12\rCapturing batches (bs=4):  20%|##| 2/12")
    (tmp_path / "engine_2_node1.log").write_text(sglang_log())
    assert engine_log_status(str(tmp_path)) == [
        "engine 0: started, no output yet", "engine 1: Capturing batches (bs=4):  20%|##| 2/12",
        "engine 2 node1: The server is fired up and ready to roll!"]


def test_watch_says_what_the_start_waits_for(tmp_path, caplog):
    (tmp_path / "engine_0.log").write_text(sglang_log())
    clock = StartupClock(launched=time.time() - 12)
    with caplog.at_level(logging.INFO, logger="slime_hydra"):
        with StartupWatch(clock, lambda: "the rollout side (engines)", str(tmp_path), interval=0.05):
            time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("starting")]
    assert lines and lines[0].startswith("starting (12s since launch): waiting for the rollout side (engines)")
    assert lines[0].endswith("\n  engine 0: The server is fired up and ready to roll!")


def test_watch_says_why_the_capture_takes_long(tmp_path, caplog, monkeypatch):
    """An engine log that stands on SGLang's first CUDA-graph capture gets a word on why (its kernels compile
    there on a machine's first start); a log that moves does not."""
    from slime_hydra.rollout.engines.sglang import engine as sglang_engine

    monkeypatch.setattr(sglang_engine, "CAPTURE_NOTE_S", 0.15)
    (tmp_path / "engine_0.log").write_text("Capturing batches (bs=64 avail_mem=68.50 GB):   0%|          | 0/12")
    (tmp_path / "engine_1.log").write_text("Load weight end. mem usage=1.12 GB")
    with caplog.at_level(logging.INFO, logger="slime_hydra"):
        with StartupWatch(StartupClock(), lambda: "the rollout side (engines)", str(tmp_path), interval=0.05,
                          note=sglang_engine.SglangEngine.log_note):
            time.sleep(0.5)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("starting")]
    assert "engine 0: Capturing batches (bs=64 avail_mem=68.50 GB):   0%|          | 0/12\n" in lines[0]
    noted = [ln for ln in lines if "SGLang compiles its kernels here" in ln]
    assert noted and noted[0] != lines[0]
    assert all(path in noted[0] for path in sglang_engine.KERNEL_CACHES) and "docs/startup.md" in noted[0]
    assert all(ln.endswith("\n  engine 1: Load weight end. mem usage=1.12 GB") for ln in noted)  # no note


@pytest.mark.parametrize("overrides, batch", [
    (["rollout.batch_size=8", "rollout.n_samples_per_prompt=8"], 64),
    (["rollout.batch_size=8", "rollout.n_samples_per_prompt=8", "rollout.concurrency=3"], 24),
    (["rollout.batch_size=7", "rollout.n_samples_per_prompt=8", "parallelism.rollout_gpus=2",
      "parallelism.trainer_gpus=2", "parallelism.gpus_per_node=4"], 32),  # 4 and 3 groups: the larger
    (["rollout.batch_size=8", "rollout.n_samples_per_prompt=4", "rollout.over_sampling_batch_size=16",
      "algo.dynamic_sampling=true"], 92),  # 8 + 16 - 1 groups in flight at most
    (["rollout.batch_size=8", "rollout.rollout_function=examples.custom_rollout.rollout"], None),
])
def test_engine_batch(overrides, batch):
    cfg = resolved(["parallelism=cpu", *overrides])
    assert engine_batch(cfg, len(make_plan(cfg).engines)) == batch
    assert make_plan(cfg).engine_batch == batch


def test_deferred_checks_stop_the_run_before_a_trainer(tmp_path):
    """A deferred check (config/deferred.py: sglang's parser, still running after validation) is answered while
    the rollout side starts (its engines take the longest), and one that finds a problem stops the run with
    ConfigError before a trainer starts."""
    import ray

    from slime_hydra.config import ConfigError
    from slime_hydra.launch.loop import train

    cfg = resolved(["trainer.num_rollout=1", "logging.progress=false"])
    cfg.output_dir = str(tmp_path / "run")
    (tmp_path / "run").mkdir()  # as launch/main.py makes it
    logs = tmp_path / "run" / "logs"
    asked = []

    class Late:
        def kill(self) -> None:
            pass

        def problems(self) -> list:
            # the rollout manager was started before the check was answered: its log appears meanwhile
            deadline = time.time() + 120
            while not (logs / "rollout_manager.log").exists() and time.time() < deadline:
                time.sleep(0.1)
            asked.append((ray.is_initialized(), (logs / "rollout_manager.log").exists()))
            return ["rollout.server_args.no_such_option: not a ServerArgs option of sglang 0.5.17"]

    clock = StartupClock()
    with pytest.raises(ConfigError, match="no_such_option"):
        train(cfg, make_plan(cfg), clock, [Late()])
    assert asked == [(True, True)] and not ray.is_initialized()
    assert "late_checks" in clock.parts and "trainers" not in clock.parts  # no trainer group was built
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_driver_starts_ray_before_it_imports_torch():
    """``python run.py`` reaches Ray's start (launch/loop.py) without importing torch or transformers: everything
    before Ray's start delays the engines' start. The initial checkpoint, which needs them when it builds one,
    imports them in its own thread while Ray starts."""
    import subprocess
    import sys

    code = ("import sys; import slime_hydra.launch.main, slime_hydra.launch.loop; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
