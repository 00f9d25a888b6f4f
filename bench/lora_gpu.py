"""LoRA against full fine-tuning through run.py with SGLang colocated on one H200 (issue 23).

    bash bench/lora_gpu.sh                          # every run, in one call if the time allows
    RUNS=4b_full,4b_lora16 bash bench/lora_gpu.sh   # some of them (one 10-minute call holds about three)

Runs (each ``python run.py`` on a random-weight checkpoint of the preset's shape, the bench's prompts,
rollout=sglang, parallelism=1gpu, algo=grpo with its KL loss, the offload the plan chooses):

  4b_full     Qwen3-4B shape, full weights, DDP (the default strategy)
  4b_lora16   the same with trainer.lora.rank=16
  4b_lora64   the same with trainer.lora.rank=64
  8b_lora16   Qwen3-8B shape with trainer.lora.rank=16 (full weights do not fit one H200: the plan refuses)
  06b_fsdp, 06b_fsdp_lora   Qwen3-0.6B shape with trainer.strategy=fsdp (offloaded), and with LoRA: FSDP2's
              GPU path (one GPU shards nothing; its multi-GPU memory is the plan's, tested on CPU ranks)

For each: the plan's estimate (``dry_run=true`` of the same command: trainer GiB, the colocated GPU's
peak in training and in rollout, the offload it picked) beside what the run measured: median seconds
per step after the first (step, train, weight push, offload), the trainer's own peak
(``train/gpu_peak_gib``: torch.cuda.max_memory_allocated during training) and the GPU's peak
(nvidia-smi, engine included). Writes ``$OUT/lora_gpu.json`` and ``.md`` after every run.

``--cpu``: a dry run of this script on a CPU machine (the tiny model, the embedded engine, cpu_colocate).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from gpu.harness import GpuSampler, log, plan_of, read_rows  # noqa: E402 - bench/ is on the path from here
from gpu.workload import build_checkpoint, write_prompts  # noqa: E402

WORK = "/tmp/lorabench"
RUNS = {"4b_full": ("qwen3_4b", []), "4b_lora16": ("qwen3_4b", ["trainer.lora.rank=16"]),
        "4b_lora64": ("qwen3_4b", ["trainer.lora.rank=64"]), "8b_lora16": ("qwen3_8b", ["trainer.lora.rank=16"]),
        # FSDP2's GPU path on one GPU (it shards nothing there): bf16 mixed precision, offload and onload of its
        # shards, the gathered push over CUDA IPC, with LoRA too
        "06b_fsdp": ("qwen3_0_6b", ["trainer.strategy=fsdp", "parallelism.offload_train=true",
                                    "parallelism.offload_rollout=true"]),
        "06b_fsdp_lora": ("qwen3_0_6b", ["trainer.strategy=fsdp", "trainer.lora.rank=16"])}
PROMPTS, SAMPLES, NEW_TOKENS, PROMPT_WORDS, MICRO_BATCH = 8, 8, 256, 64, 8
SERVER_ARGS = {"mem_fraction_static": 0.5, "attention_backend": "triton", "sampling_backend": "pytorch",
               "grammar_backend": "none", "disable_prefill_cuda_graph": "true"}  # as bench/sglang_gpu.py
CPU = False


def build(preset: str) -> str:
    """A random checkpoint of ``preset``'s shape (word-level tokenizer) and the prompts (bench/gpu/workload.py)."""
    data = os.path.join(WORK, "prompts.jsonl")
    if not os.path.exists(data):
        write_prompts(data, 2048, PROMPT_WORDS)
    ckpt = os.path.join(WORK, preset)
    t0 = time.perf_counter()
    build_checkpoint(ckpt, preset, device="cpu" if CPU else "cuda", reuse=True)
    log(f"{ckpt} ready in {time.perf_counter() - t0:.0f}s")
    return ckpt


def overrides(name: str, steps: int) -> List[str]:
    preset, extra = RUNS[name]
    if CPU:
        return ["model=tiny", "parallelism=cpu_colocate", f"trainer.num_rollout={steps}", "eval.interval=0",
                "eval.before_train=false", "logging.progress=false", "logging.wandb=false",
                "trainer.save_interval=0", "trainer.save_last=false", "rollout.batch_size=4",
                "rollout.n_samples_per_prompt=4", *extra]
    ckpt = build(preset)
    return [f"model={preset}", f"model.path={ckpt}", "model.tokenizer=null", "data=jsonl",
            f"data.path={os.path.join(WORK, 'prompts.jsonl')}", "data.apply_chat_template=false", "eval.datasets=[]",
            "rollout=sglang", f"rollout.batch_size={PROMPTS}", f"rollout.n_samples_per_prompt={SAMPLES}",
            f"rollout.max_response_len={NEW_TOKENS}", f"rollout.max_prompt_len={PROMPT_WORDS + 8}",
            f"rollout.concurrency={PROMPTS * SAMPLES}", "parallelism=1gpu", "algo=grpo",
            f"trainer.num_rollout={steps}", f"trainer.micro_batch_size={MICRO_BATCH}",
            "trainer.gradient_checkpointing=true", "trainer.save_interval=0", "trainer.save_last=false",
            "logging.wandb=false",
            "logging.progress=false", "sync.max_logprob_diff=" + os.environ.get("MAX_LOGPROB_DIFF", "0.05"),
            f"rollout.server_args.mem_fraction_static={SERVER_ARGS['mem_fraction_static']}",
            *(f"+rollout.server_args.{k}={v}" for k, v in SERVER_ARGS.items() if k != "mem_fraction_static"), *extra]


def median_after_first(rows: List[Dict[str, Any]], key: str):
    vals = sorted(r[key] for r in rows[1:] if key in r)
    return vals[len(vals) // 2] if vals else None


def run(name: str, steps: int, limit_s: float) -> Dict[str, Any]:
    from slime_hydra.utils.proc import kill_tree, spawn

    args = overrides(name, steps)
    res: Dict[str, Any] = {"command": "python run.py " + " ".join(args), "plan": plan_of(args)}
    log(f"{name}: plan {res['plan']}")
    if res["plan"]["returncode"]:
        return res
    run_dir = os.path.join(WORK, f"run_{name}")
    subprocess.run(["rm", "-rf", run_dir])
    sampler = None if CPU else GpuSampler(os.path.join(WORK, f"gpu_{name}.csv"))
    console = os.path.join(WORK, f"run_{name}.out")
    t0 = time.perf_counter()
    proc = spawn([sys.executable, os.path.join(ROOT, "run.py"), *args, f"hydra.run.dir={run_dir}"], console)
    while proc.poll() is None and time.perf_counter() - t0 < limit_s:
        time.sleep(1)
    if proc.poll() is None:
        log(f"{name}: over its {limit_s:.0f}s, stopped")
        kill_tree(proc, timeout=20)
    if sampler is not None:
        sampler.stop()
        res["gpu"] = sampler.peaks()
    rows = [r for r in read_rows(os.path.join(run_dir, "metrics.jsonl")) if "perf/step_time" in r]  # steps only
    res.update(returncode=proc.returncode, wall_s=round(time.perf_counter() - t0, 1), steps=len(rows))
    res["measured"] = {k: median_after_first(rows, f"perf/{k}") for k in
                       ("step_time", "rollout_wait_time", "train_time", "weight_push_time", "weight_sync_time",
                        "offload_time")}
    res["measured"]["trainer_peak_gib"] = max((r["train/gpu_peak_gib"] for r in rows if "train/gpu_peak_gib" in r),
                                              default=None)
    res["measured"]["weight_sync_gb"] = (median_after_first(rows, "perf/weight_sync_bytes") or 0) / 1e9
    res["measured"]["logprob_gap_max"] = max((r["train/train_rollout_logprob_abs_diff"] for r in rows
                                              if "train/train_rollout_logprob_abs_diff" in r), default=None)
    with open(console, errors="replace") as f:
        res["console_tail"] = f.read()[-3000:]
    log(f"{name}: rc={proc.returncode}, {len(rows)} steps, {res['measured']}")
    return res


def report(results: Dict[str, Any], path: str) -> None:
    with open(path + ".json.tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".json.tmp", path + ".json")

    def c(v, fmt=".2f"):
        return "-" if v is None else format(v, fmt)

    lines = ["| run | step s | train s | push s | offload s | trainer peak GiB (plan) | GPU peak GiB "
             "(plan: training / rollout) | offload |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results["runs"].items():
        m, p = r.get("measured", {}), r["plan"]
        gpu = max((g["peak_gib"] for g in (r.get("gpu") or {}).values()), default=None)
        lines.append(f"| {name} | {c(m.get('step_time'))} | {c(m.get('train_time'))} | {c(m.get('weight_push_time'))}"
                     f" | {c(m.get('offload_time'))} | {c(m.get('trainer_peak_gib'), '.1f')} "
                     f"({c(p.get('trainer_gib'), '.1f')}) | {c(gpu, '.1f')} ({c(p.get('training_peak_gib'), '.1f')}"
                     f" / {c(p.get('rollout_peak_gib'), '.1f')}) | {p.get('offload')} |")
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    log("\n" + "\n".join(lines))


def main() -> None:
    global CPU, WORK
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=os.environ.get("RUNS", ",".join(RUNS)))
    ap.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 4)))
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BUDGET", 570)),
                    help="seconds for all runs; a run that cannot get 150 s is skipped")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    CPU = args.cpu
    if CPU:
        WORK = "/tmp/lorabench_cpu"
    os.makedirs(WORK, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "lora_gpu" + ("_cpu" if CPU else ""))
    results: Dict[str, Any] = {"runs": {}, "skipped": []}
    t_end = time.perf_counter() + args.budget
    for name in args.runs.split(","):
        left = t_end - time.perf_counter()
        if left < 150:
            results["skipped"].append(name)
            continue
        results["runs"][name] = run(name, args.steps, left - 20)
        report(results, path)
    report(results, path)
    ok = all(r.get("returncode") == 0 for r in results["runs"].values()) and not results["skipped"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
