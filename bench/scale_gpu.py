"""GRPO through run.py with trainer=megatron and rollout=sglang on several GPUs of one machine, one layout
after another, in one device call (issue 13). How a GPU run is set up: bench/README.md.

    bash bench/scale_gpu.sh                                  # tp2_2gpu, pp2_2gpu, split_1_1 on two GPUs
    LAYOUTS=pp2_tp2_4gpu,split_2_2 STEPS=4 bash bench/scale_gpu.sh

Each layout runs ``python run.py`` on a random-weight checkpoint of a real model's shape (Qwen3-4B; a
Qwen3-30B-A3B shape cut to fewer layers for the MoE layout), prompts of 64 random words, 32 (env PROMPTS)
prompts x 8 samples x 256 new tokens a step, the micro-batch and recompute chosen by the plan, and a
reward that varies within a group (the share of even token ids in the response: bench/gpu_rewards.py),
so every step has advantages, gradients and new weights to push: the train/rollout log-prob gap after a
push checks the sync. Per layout it reports, over the steps after the first:
seconds per step split into rollout, train and sync; training tokens/s per trainer GPU and MFU; sync
seconds per GB; peak memory per GPU (nvidia-smi, every 0.5 s); start-up time; the log-prob gap.

MFU counts (6 + 2 x E) x N FLOPs per trained token, N the matmul parameters per token: the training
step's forward and backward (6N) and E forward passes besides it (2N each), E the run's
``train/extra_forward_passes`` (the old policy's log-probs, where the training step does not give them, and
the reference's; 0 for one optimiser step without KL). A run without that metric (before it existed) is
counted with E = 1, and its summary says so (``extra_forward_passes_assumed``). Against the 790 TFLOP/s bf16
matmul peak measured on the H200 (bench/megatron_gpu.py); attention's quadratic FLOPs are left out
(sequences of 320 tokens). ``--cpu``: a dry run of this script on a CPU machine (tiny model, torch trainer, embedded
engine), to check its own code.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from gpu import harness as h  # noqa: E402 - bench/ is on the path from here
from gpu.workload import arch_of, build_checkpoint, write_prompts  # noqa: E402

WORK = "/tmp/scalebench"
PROMPTS = int(os.environ.get("PROMPTS", 32))  # 8: TRL's anchor batch (8 x 8 samples)
SAMPLES, NEW_TOKENS, PROMPT_WORDS = 8, 256, 64
PEAK_TFLOPS = 790.0  # bf16 dense matmul measured on the H200 (bench/megatron_gpu.py)
# what conf/rollout/sglang.yaml leaves to the deployment: the SGLang bundle has no FA3 kernels
SERVER_ARGS = ["rollout.server_args.mem_fraction_static=0.5", "+rollout.server_args.attention_backend=triton",
               "+rollout.server_args.sampling_backend=pytorch", "+rollout.server_args.grammar_backend=none",
               # 8 decode graphs, not 36 (SGLang's list up to 256): 72 s of capture for the 4B shape otherwise
               "+rollout.server_args.cuda_graph_bs_decode=[1,4,16,32,64,128,192,256]"]
SPLIT = ["trainer.mode=async", "+rollout.server_args.disable_prefill_cuda_graph=true"]
TWO = ["parallelism=1gpu", "parallelism.gpus_per_node=2", "parallelism.trainer_gpus=2"]
MOE = ["model.arch.num_layers=8"]  # the Qwen3-30B-A3B shape, 8 of its 48 layers (5.4B parameters)
LAYOUTS: Dict[str, Dict[str, Any]] = {
    # one GPU, trainer and engine colocated, offload as the plan chooses (PROMPTS=8: issue 24's 4B run)
    "colocate_1gpu": {"model": "qwen3_4b", "gpus": 1, "args": ["parallelism=1gpu"]},
    "colocate_4gpu": {"model": "qwen3_4b", "gpus": 4, "args": ["parallelism=colocate_4gpu"]},
    "pp2_tp2_4gpu": {"model": "qwen3_4b", "gpus": 4, "args": ["parallelism=pp2_tp2_4gpu"]},
    "split_2_2": {"model": "qwen3_4b", "gpus": 4, "args": ["parallelism=split_2_2", *SPLIT]},
    "moe_ep4_4gpu": {"model": "qwen3_30b_a3b", "gpus": 4, "args": [
        "parallelism=colocate_4gpu", "parallelism.tensor_parallel=1", "parallelism.expert_parallel=4", *MOE]},
    # two GPUs (nvidia-h200-x2)
    "tp2_2gpu": {"model": "qwen3_4b", "gpus": 2, "args": [
        *TWO, "parallelism.name=tp2_2gpu", "parallelism.colocate=true", "parallelism.tensor_parallel=2",
        "parallelism.gpus_per_engine=2"]},
    "pp2_2gpu": {"model": "qwen3_4b", "gpus": 2, "args": [
        *TWO, "parallelism.name=pp2_2gpu", "parallelism.colocate=true", "parallelism.pipeline_parallel=2",
        "parallelism.gpus_per_engine=2"]},
    "split_1_1": {"model": "qwen3_4b", "gpus": 1, "args": [
        *TWO, "parallelism.name=split_1_1", "parallelism.colocate=false", "parallelism.trainer_gpus=1",
        "parallelism.rollout_gpus=1", *SPLIT]},
    # --cpu: the script's own plumbing
    "cpu": {"model": "tiny", "gpus": 2, "args": ["parallelism=cpu", "trainer=torch", "rollout=embedded"]},
}


def matmul_params(arch) -> int:
    """Parameters in a matmul per token: attention and MLP (the routed experts a token visits, the
    router) of every layer, and the LM head."""
    h, d = arch.hidden_size, arch.head_dim or arch.hidden_size // arch.num_heads
    attn = h * d * (2 * arch.num_heads + 2 * arch.num_kv_heads)
    if getattr(arch, "num_experts", None):
        mlp = 3 * h * arch.moe_intermediate_size * arch.num_experts_per_tok + h * arch.num_experts
    else:
        mlp = 3 * h * arch.intermediate_size
    return arch.num_layers * (attn + mlp) + arch.vocab_size * h


# ---------------------------------------------------------------------------------------- run
def run_layout(name: str, spec: Dict[str, Any], ckpt: str, data: str, steps: int, limit_s: float,
               cpu: bool) -> Dict[str, Any]:
    from slime_hydra.utils.proc import tail

    run_dir = os.path.join(WORK, f"run_{name}")
    args = [f"model={spec['model']}", f"model.path={ckpt}", "model.tokenizer=null", "data=jsonl",
            f"data.path={data}", "data.apply_chat_template=false", "eval.datasets=[]",
            f"rollout.batch_size={PROMPTS}", f"rollout.n_samples_per_prompt={SAMPLES}",
            f"rollout.max_response_len={NEW_TOKENS}", f"trainer.num_rollout={steps}", "trainer.save_interval=0",
            "trainer.save_last=false",
            "reward.type=custom", "reward.custom=gpu_rewards.even_tokens", "algo.kl_loss_coef=0.0",
            "logging.wandb=false", "logging.progress=false", "sync.max_logprob_diff=0.05"]
    if not cpu:
        # the packed micro-batch and recompute are the plan's (auto): the run log prints its choice
        args += ["trainer=megatron", "rollout=sglang", f"rollout.concurrency={PROMPTS * SAMPLES}", *SERVER_ARGS]
    args += spec["args"] + os.environ.get("EXTRA", "").split()  # EXTRA: more overrides for every layout
    console = os.path.join(WORK, f"run_{name}.out")
    gpus = None if cpu else h.GpuSampler(os.path.join(WORK, f"gpu_{name}.csv"), interval_ms=500)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    run = h.run_py(args, run_dir, console, limit_s, env=env)
    out: Dict[str, Any] = {"layout": name, "command": run.command, "returncode": run.returncode,
                           "wall_s": round(run.wall_s, 1), "rows": run.rows}
    if run.startup_s() is not None:  # launch -> the first step begins
        out["startup_s"] = round(run.startup_s(), 1)
    if gpus is not None:
        gpus.stop()
        out["gpus"] = gpus.peaks()
    out["console_tail"] = tail(console, 40)
    logs = os.path.join(run_dir, "logs")
    out["log_tails"] = {f: tail(os.path.join(logs, f), 15) for f in sorted(os.listdir(logs))} \
        if os.path.isdir(logs) else {}
    h.log(f"{name}: rc={run.returncode}, {len(run.rows)} steps in {out['wall_s']} s")
    return out


# ------------------------------------------------------------------------------------- report
def summarize(res: Dict[str, Any], arch, trainer_gpus: int) -> Dict[str, Any]:
    steps = [r for r in res["rows"] if "perf/step_time" in r]
    s: Dict[str, Any] = {"steps": len(steps), "returncode": res["returncode"],
                         "startup_s": res.get("startup_s")}
    for k in ("step_time", "rollout_wait_time", "train_time", "weight_sync_time"):
        s[k] = h.steady(steps, f"perf/{k}")
    tokens = h.steady(steps, "rollout/response_tokens")
    samples = h.steady(steps, "rollout/samples")
    if tokens and samples and s["train_time"]:
        trained = tokens + samples * PROMPT_WORDS
        s["train_tokens_per_s_per_gpu"] = round(trained / s["train_time"] / trainer_gpus)
        passes = h.steady(steps, "train/extra_forward_passes")
        if passes is None:  # a run from before the metric: the old policy's log-prob pass is assumed
            passes, s["extra_forward_passes_assumed"] = 1, True
        s["extra_forward_passes"] = passes
        flops = (6 + 2 * passes) * matmul_params(arch) * s["train_tokens_per_s_per_gpu"]
        s["mfu"] = round(flops / (PEAK_TFLOPS * 1e12), 4)
    gb = h.steady(steps, "perf/weight_sync_bytes")
    if gb and s["weight_sync_time"]:
        s["sync_gb"] = round(gb / 1e9, 2)
        s["sync_s_per_gb"] = round(s["weight_sync_time"] / (gb / 1e9), 3)
    gap = "train/train_rollout_logprob_abs_diff"
    gaps = [r[gap] for r in res["rows"] if gap in r]
    s["logprob_gap_max"] = max(gaps) if gaps else None
    s["reward_mean"] = [round(r.get("rollout/reward_mean", float("nan")), 4) for r in steps]
    s["grad_norm"] = [round(r.get("train/grad_norm", float("nan")), 4) for r in steps]
    s["peak_gib_per_gpu"] = {g: v["peak_gib"] for g, v in (res.get("gpus") or {}).items()}
    return s



def trainer_of(command: str) -> str:
    """The trainer a run.py command line ran (Hydra takes the last ``trainer=`` override: EXTRA's wins)."""
    return ([a.split("=", 1)[1] for a in command.split() if a.startswith("trainer=")] or ["torch"])[-1]

def report(results: Dict[str, Any], path: str) -> None:
    h.write_json(path + ".json", results)
    rows = []
    for name, r in results["layouts"].items():
        s, c = r.get("summary", {}), h.cell
        rows.append([name, trainer_of(r.get("command") or ""), r.get("model"),
                     f"{s.get('steps', 0)} (rc {s.get('returncode')})",
                     c(s.get("startup_s"), ".0f"), c(s.get("step_time")), c(s.get("rollout_wait_time")),
                     c(s.get("train_time")), c(s.get("weight_sync_time")), c(s.get("sync_s_per_gb"), ".3f"),
                     c(s.get("train_tokens_per_s_per_gpu"), ".0f"),
                     c(s.get("extra_forward_passes"), "g") + ("*" if s.get("extra_forward_passes_assumed") else ""),
                     c(s.get("mfu"), ".3f"),
                     c(s.get("logprob_gap_max"), ".4f"),
                     " ".join(f"{v:.0f}" for v in s.get("peak_gib_per_gpu", {}).values()) or "-"])
    lines = [f"# GRPO through run.py with rollout=sglang on {results.get('gpu', '?')}", "",
             f"{PROMPTS} prompts x {SAMPLES} samples x {NEW_TOKENS} new tokens a step, {PROMPT_WORDS}-token "
             "prompts, random bf16 weights; medians over the steps after the first. train tokens/s and MFU "
             "per trainer GPU ((6 + 2 x E) x N FLOPs per token: the training step's forward and backward, and "
             "the E forward passes besides it, `train/extra_forward_passes`; E = 1 assumed where a run did not "
             "log it, marked *); sync with offload and onload where colocated.", "",
             *h.table(["layout", "trainer", "model", "steps", "start-up s", "step s", "rollout s", "train s", "sync s",
                       "sync s/GB", "train tok/s/GPU", "E", "MFU", "log-prob gap max", "peak GiB per GPU"], rows),
             "", "Commands:", ""] + [f"- {n}: `{r.get('command')}`" for n, r in results["layouts"].items()]
    h.write_text(path + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=os.environ.get("LAYOUTS", "tp2_2gpu,pp2_2gpu,split_1_1"))
    ap.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 4)))
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BENCH_BUDGET_S", 540)),
                    help="seconds for everything; each layout gets an equal share of what is left")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--cpu", action="store_true", help="dry run of this script on a CPU machine")
    args = ap.parse_args()
    if args.cpu:  # the tiny model's context is 64 tokens
        global NEW_TOKENS, PROMPT_WORDS
        NEW_TOKENS, PROMPT_WORDS = 16, 8
    budget = h.Budget(args.budget)
    names = ["cpu"] if args.cpu else [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        sys.exit(f"unknown layouts {unknown}; known: {sorted(LAYOUTS)}")
    os.makedirs(WORK, exist_ok=True)
    data = write_prompts(os.path.join(WORK, "prompts.jsonl"), 4096, PROMPT_WORDS, labels=False)
    results: Dict[str, Any] = {"layouts": {}, "steps": args.steps}
    if not args.cpu:
        import torch

        results["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    path = os.path.join(args.out, "scale_gpu")
    for i, name in enumerate(names):
        spec = LAYOUTS[name]
        arch = arch_of(spec["model"], spec["args"])
        ckpt = os.path.join(WORK, f"{spec['model']}_{arch.num_layers}l")
        build_checkpoint(ckpt, arch=arch, device="cpu" if args.cpu else "cuda", reuse=True)
        left = budget.left()  # each layout: an equal share of what is left after its checkpoint
        if left < 60:
            h.log(f"{name}: skipped, {left:.0f} s left of the budget")
            continue
        res = run_layout(name, spec, ckpt, data, args.steps, left / (len(names) - i), args.cpu)
        trainer_gpus = 1 if args.cpu else {"split_2_2": 2}.get(name, spec["gpus"])  # gpus: the trainer's
        res["model"] = f"{spec['model']} ({arch.num_layers} layers)"
        res["summary"] = summarize(res, arch, trainer_gpus)
        results["layouts"][name] = res
        report(results, path)
    failed = [n for n, r in results["layouts"].items() if r["returncode"] != 0 or r["summary"]["steps"] < args.steps]
    sys.exit(1 if failed or len(results["layouts"]) < len(names) else 0)


if __name__ == "__main__":
    main()
