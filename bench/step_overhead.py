"""Where a step of the embedded default goes: rollout, reward, training, weight sync, driver.

    python bench/step_overhead.py                 # 16 prompts x 8 samples of <= 4 tokens, then the default 32 x 16
    python bench/step_overhead.py --sizes 16x8:4 --steps 60
    python bench/step_overhead.py -- rollout.router.enabled=false     # extra overrides for every run

A size is prompts x samples per rollout, with ``:L`` the most tokens per answer
(``rollout.max_response_len``; without it, the recipe's: 1). Two measurements per size:

1. A real run, ``python run.py rollout.batch_size=P rollout.n_samples_per_prompt=N ...`` with
   evaluation and checkpoints off, whose ``metrics.jsonl`` gives per step (medians after warm-up):
   the step, the rollout as the rollout manager timed it (generation and rewards), the Ray hand-over
   (the driver's wait minus that), training (the trainer's call, as the driver sees it), weight sync
   (the push and its checks), and the driver's own overhead (the step minus all of those). Time to
   the first step is counted from the command's start (Ray start-up, engine and router launch
   included).
2. The parts of a rollout timed directly: the tiny model's decoding of P x N requests inside the
   engine process's code (no HTTP), the same samples over HTTP to an embedded engine server: P
   requests of N samples (SGLang's batched form, as the default generate function sends a group,
   straight to the engine: sglang-router cannot forward it), and P x N requests of one sample
   (directly and through sglang-router, as a custom generate function sends them), one weight push
   over the distributed transport, and the reward function over P x N samples.

The table is printed and written to ``bench/results/step_overhead.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
PROMPT = "3815="
WARMUP = 5  # steps left out of the medians (first allocations, connection pools)


def median_ms(values: List[float]) -> float:
    return round(statistics.median(values) * 1000, 1) if values else float("nan")


# ------------------------------------------------------------------------------------ 1. a run
def real_run(prompts: int, samples: int, steps: int, extra: List[str], run_dir: Path) -> Dict[str, float]:
    cmd = [sys.executable, "run.py", f"hydra.run.dir={run_dir}", f"rollout.batch_size={prompts}",
           f"rollout.n_samples_per_prompt={samples}", f"trainer.num_rollout={steps}", "eval.interval=0",
           "eval.before_train=false", "trainer.save_interval=0", "logging.progress=false", "logging.wandb=false",
           "logging.plot=false", *extra]
    env = {**os.environ, "WANDB_MODE": "offline", "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    metrics, first_step = run_dir / "metrics.jsonl", None
    while proc.poll() is None:
        if first_step is None and metrics.exists() and metrics.stat().st_size > 0:
            first_step = time.perf_counter() - t0
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout.read()[-3000:]}")
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "perf/step_time" in r][WARMUP:]
    col = {k: [r[k] for r in rows] for k in rows[0]}
    driver = [r["perf/step_time"] - r["perf/rollout_wait_time"] - r["perf/train_time"] - r["perf/weight_sync_time"]
              for r in rows]
    ray_handover = [r["perf/rollout_wait_time"] - r["perf/rollout_time"] for r in rows]
    return {"step_ms": median_ms(col["perf/step_time"]), "rollout_ms": median_ms(col["perf/rollout_time"]),
            "ray_ms": median_ms(ray_handover), "train_ms": median_ms(col["perf/train_time"]),
            "sync_ms": median_ms(col["perf/weight_sync_time"]), "driver_ms": median_ms(driver),
            "first_step_s": round(first_step or float("nan"), 1), "wall_s": round(wall, 1), "steps": len(rows)}


# ----------------------------------------------------------------------------------- 2. parts
def parts(prompts: int, samples: int, max_new: int, repeats: int, work: Path) -> Dict[str, float]:
    import torch

    from slime_hydra.config.schema import RouterConfig
    from slime_hydra.model.hf import build_random_checkpoint
    from slime_hydra.rollout.embedded.engine import EmbeddedEngine, Request, SamplingParams
    from slime_hydra.rollout.engines import ServerSpec, server_command
    from slime_hydra.rollout.router import Router
    from slime_hydra.utils.proc import free_port, kill_tree, spawn, wait_http

    torch.set_num_threads(1)
    cfg = composed()
    ckpt = str(work / "tiny")
    if not os.path.isdir(ckpt):
        build_random_checkpoint(cfg.model, ckpt)
    n, out = prompts * samples, {}
    engine = EmbeddedEngine(ckpt)
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)

    def batch():
        return [Request(ids, SamplingParams(max_new_tokens=max_new, sampling_seed=i), rid=str(i), return_logprob=True)
                for i in range(n)]

    times = []
    for _ in range(repeats):
        reqs = batch()
        t = time.perf_counter()
        engine.generate(reqs)
        times.append(time.perf_counter() - t)
    out["decode_ms"] = median_ms(times)
    out["reward_ms"] = reward_ms(cfg, n, repeats)

    spec = ServerSpec(engine="embedded", model_path=ckpt, tokenizer_path=ckpt, dtype="float32", device="cpu", gpus=1,
                      seed=0, max_batch=max(n, 256), num_threads=1)
    port = free_port("127.0.0.1")
    log = str(work / "engine.log")
    proc = spawn(server_command(spec, "127.0.0.1", port), log)
    url = f"http://127.0.0.1:{port}"
    router = None
    try:
        wait_http(url + "/health_generate", proc, 120, log)
        out["http_direct_ms"] = median_ms(http_rollouts(url, ids, n, max_new, repeats))
        out["http_group_ms"] = median_ms(http_rollouts(url, ids, n, max_new, repeats, group=samples))
        router = Router(RouterConfig(policy=cfg.rollout.router.policy), "127.0.0.1", str(work / "router.log"))
        router.add_worker(url)
        out["http_router_ms"] = median_ms(http_rollouts(router.url, ids, n, max_new, repeats))
        out["push_ms"] = median_ms(pushes(url, ckpt, work, repeats))
    finally:
        if router is not None:
            router.stop()
        kill_tree(proc)
    return out


def composed():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from slime_hydra.config import load, resolve
    from slime_hydra.config.store import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return resolve(load(compose("config")))


def reward_ms(cfg, n: int, repeats: int) -> float:
    from slime_hydra.rewards import compute_reward
    from slime_hydra.rollout.sample import Sample

    async def all_rewards():
        await asyncio.gather(*(compute_reward(cfg.reward, Sample(prompt=PROMPT, label="8", response=str(i % 10)))
                               for i in range(n)))

    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        asyncio.run(all_rewards())
        times.append(time.perf_counter() - t)
    return median_ms(times)


def http_rollouts(base: str, ids: List[int], n: int, max_new: int, repeats: int, group: int = 1) -> List[float]:
    """``n`` samples in concurrent /generate requests: one per sample (a custom generate function),
    or with ``group`` > 1 one per group of ``group`` samples in SGLang's batched form (the default one)."""
    from slime_hydra.rollout.client import GenerateClient

    def body(seeds: List[int]) -> Dict:
        params = [{"max_new_tokens": max_new, "sampling_seed": seed} for seed in seeds]
        if group == 1:
            return {"input_ids": ids, "return_logprob": True, "sampling_params": params[0]}
        return {"input_ids": [ids] * len(seeds), "return_logprob": True, "sampling_params": params,
                "rid": [f"{seeds[0]}-{i}" for i in range(len(seeds))]}

    async def rollouts():
        client = GenerateClient(base, concurrency=max(n, 512))
        times = []
        for r in range(repeats + 2):
            t = time.perf_counter()
            await asyncio.gather(*(client.post("/generate", body(list(range(r * n + i, r * n + i + group))))
                                   for i in range(0, n, group)))
            times.append(time.perf_counter() - t)
        await client.aclose()
        return times[2:]  # the first opens the connections

    return asyncio.run(rollouts())


def pushes(url: str, ckpt: str, work: Path, repeats: int) -> List[float]:
    import torch
    from transformers import AutoModelForCausalLM

    from slime_hydra.sync.sender import Endpoint, WeightSender

    model = AutoModelForCausalLM.from_pretrained(ckpt)
    sender = WeightSender("distributed", [Endpoint(url)], torch.device("cpu"), 512, str(work / "sync"), ckpt)
    sender.connect()
    try:
        return [sender.push(model.state_dict().items(), v)["seconds"] for v in range(1, repeats + 1)]
    finally:
        sender.close()


# ---------------------------------------------------------------------------------------- main
def table(results: List[Tuple[str, Dict[str, float]]]) -> str:
    columns = [("step", "step_ms", "ms"), ("rollout (manager)", "rollout_ms", "ms"), ("Ray hand-over", "ray_ms", "ms"),
               ("train", "train_ms", "ms"), ("weight sync", "sync_ms", "ms"), ("driver", "driver_ms", "ms"),
               ("first step", "first_step_s", "s"), ("decode (in process)", "decode_ms", "ms"),
               ("HTTP per group", "http_group_ms", "ms"), ("HTTP per sample direct", "http_direct_ms", "ms"),
               ("HTTP per sample via router", "http_router_ms", "ms"), ("push alone", "push_ms", "ms"),
               ("reward", "reward_ms", "ms")]
    lines = ["| size[:tokens] | " + " | ".join(name for name, _, _ in columns) + " |",
             "| --- | " + " | ".join(["---"] * len(columns)) + " |"]
    for size, r in results:
        lines.append(f"| {size} | " + " | ".join(f"{r[key]} {unit}" for _, key, unit in columns) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16x8:4,32x16", help="PxN[:L] (prompts x samples[:max tokens]), comma-separated")
    ap.add_argument("--steps", type=int, default=40, help="rollouts per real run")
    ap.add_argument("--repeats", type=int, default=15, help="repetitions of each directly timed part")
    ap.add_argument("extra", nargs="*", help="Hydra overrides for every run (after --)")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="step_overhead_") as tmp:
        for size in args.sizes.split(","):
            shape, _, tokens = size.partition(":")
            prompts, samples = map(int, shape.split("x"))
            max_new = int(tokens) if tokens else composed().rollout.max_response_len
            extra = [f"rollout.max_response_len={max_new}", *args.extra]
            row = real_run(prompts, samples, args.steps, extra, Path(tmp) / f"run_{prompts}x{samples}")
            row.update(parts(prompts, samples, max_new, args.repeats, Path(tmp)))
            results.append((size, row))
            print(size, json.dumps(row), flush=True)
    text = (f"{table(results)}\n\nmedians over {args.steps - WARMUP} steps of a real run and {args.repeats} "
            "repetitions "
            f"of each part; {os.cpu_count()} CPUs; extra overrides: {' '.join(args.extra) or 'none'}\n")
    print("\n" + text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "step_overhead.md").write_text(text)


if __name__ == "__main__":
    main()
