"""The torch trainer's GRPO step on the GPU, taken apart: where a training step's time goes.
How a GPU run is set up: bench/README.md.

    python bench/train_gpu.py [--out DIR]          # one H200: about a minute after the imports
    python bench/train_gpu.py --device cpu --preset tiny --batch 16 --new-tokens 8   # a check of this script

On a Qwen3-0.6B-shaped model with random weights (``gpu_components.build_checkpoint``), for TRL's anchor
batch (64 samples of 64 prompt + 256 response tokens, micro-batches of 16) and 256 x 256:

- ``RLTrainer.train`` as run.py runs it, with GRPO's KL loss (``algo.kl_loss_coef=0.04``: a reference
  pass) and without (0, TRL's default beta): seconds a step (median of ``--steps`` after a warm-up),
  peak memory; and without KL with the levers of issue 24 taken away one at a time (``--variants``:
  ``no_kl_logits``, the [B, L, V] logits head of before ``trainer.fused_logprobs``; ``no_kl_recompute``,
  the old policy's log-probs in a pass of their own; ``megatron`` and ``megatron_compile``, the megatron
  trainer); for each, the share inside the backend's ``train_step`` (forward, backward, optimizer) against
  the RL step's own work around it;
- ``--micro 16 32 64``: each micro-batch size a run;
- the floor: the same micro-batches through the bare Hugging Face model (float32 weights under bfloat16
  autocast, the response tokens' log-probs, backward, fused AdamW), the least a step of this model
  and batch costs without the RL step around it;
- with ``--profile``: one trainer step under torch.profiler: GPU busy time against the wall clock and
  the kernels that take the most GPU time.

Writes ``train_gpu.json`` under ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from gpu.harness import write_json  # noqa: E402 - bench/ is on the path
from gpu.workload import build_checkpoint  # noqa: E402
from gpu_components import fake_rollout, rl_trainer, sync  # noqa: E402

PROMPT = 64
# RL-step variants: (algo.kl_loss_coef, more config overrides). no_kl_logits: the log-prob head of before
# trainer.fused_logprobs (the model's [B, L, V] logits, then the float32 log-softmax); no_kl_recompute: the
# old policy's log-probs in a pass of their own (no on-policy shortcut: RLTrainer.reuse_step_log_probs);
# no_kl_compile: trainer.compile=true (the warm-up step compiles; "compile_s" is its time); megatron,
# megatron_compile: the megatron trainer (--micro samples packed into a micro-batch: one with --micro 64 on the
# anchor batch; the plan's "auto" token budget and trainer.recompute are resolved by run.py only, so they are set
# here: a budget by samples, recompute none, as the plan picks it on an H200 there)
MEGATRON = ("trainer=megatron", "trainer.max_tokens_per_micro_batch=null", "trainer.recompute=none")
VARIANTS = {"kl": (0.04, (), True), "no_kl": (0.0, (), True),
            "no_kl_logits": (0.0, ("trainer.fused_logprobs=false",), True), "no_kl_recompute": (0.0, (), False),
            "no_kl_compile": (0.0, ("trainer.compile=true",), True),
            "megatron": (0.0, MEGATRON, True), "megatron_compile": (0.0, (*MEGATRON, "trainer.compile=true"), True)}


def timed(fn, steps: int, device: str, warmup: List[float] = None) -> List[float]:
    t0 = time.perf_counter()
    fn()  # warm-up
    sync(device)
    if warmup is not None:
        warmup.append(time.perf_counter() - t0)
    out = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def in_train_step(backend, rl, data, resp: int, steps: int, device: str) -> Dict[str, float]:
    """Medians over ``steps`` more steps of ``RLTrainer.train`` and of its time inside the backend's ``train_step``
    (forward, backward and the optimizer), the device synchronised around each: the difference is the RL step's
    own work (the batch's micro-batches, advantages, the loss's inputs, metrics)."""
    inside: List[float] = []  # a step's time in train_step (summed over its optimizer steps)
    step = backend.train_step

    def timed_step(*a, **k):  # noqa: ANN002, ANN003, ANN202
        sync(device)
        t0 = time.perf_counter()
        out = step(*a, **k)
        sync(device)
        inside[-1] += time.perf_counter() - t0
        return out

    def rl_step() -> None:
        inside.append(0.0)
        rl.train(data, temperature=1.0, max_response_len=resp)

    backend.train_step = timed_step
    try:
        whole = timed(rl_step, steps, device)
    finally:
        del backend.train_step  # the bound method again
    return {"step_s": statistics.median(whole), "inside_s": statistics.median(inside[1:])}  # [0]: timed's warm-up


def bench_trainer(path: str, batch: int, resp: int, args, kl: float, overrides: tuple = (),
                  reuse: bool = True) -> Dict[str, Any]:
    backend, rl, cfg = rl_trainer(path, batch, args.micro, args.preset, args.device, kl, overrides)
    try:
        return trainer_runs(backend, rl, batch, resp, args, kl, overrides, reuse)
    finally:
        if cfg.trainer.backend == "megatron":  # megatron's process group, for the next variant to make its own
            import torch.distributed as dist
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def trainer_runs(backend, rl, batch: int, resp: int, args, kl: float, overrides: tuple,
                 reuse: bool) -> Dict[str, Any]:
    rl.reuse_step_log_probs = reuse
    vocab = backend.hf.vocab_size if hasattr(backend, "hf") else backend.model.config.vocab_size
    data = fake_rollout(batch, PROMPT, resp, min(1000, vocab))
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    warmup: List[float] = []
    times = timed(lambda: rl.train(data, temperature=1.0, max_response_len=resp), args.steps, args.device, warmup)
    res = {"kl_loss_coef": kl, "overrides": list(overrides), "reuse_step_log_probs": reuse,
           "seconds": statistics.median(times), "all_s": times, "warmup_s": warmup[0],
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
           "train_step": in_train_step(backend, rl, data, resp, args.steps, args.device)}
    if kl and args.device == "cuda":  # the reference's weights move with the trainer's state and come back whole
        mbs = backend.micro_batches(data, list(range(batch)), resp)
        before = backend.log_probs(mbs, 1.0, reference=True)
        backend.offload()
        res["offloaded_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
        backend.onload()
        res["reference_exact_after_offload"] = torch.equal(backend.log_probs(mbs, 1.0, reference=True), before)
    if args.profile and kl == 0:
        res["profile"] = profile(lambda: rl.train(data, temperature=1.0, max_response_len=resp), args.device)
    return res  # the trainer goes with this frame; the caller empties the CUDA cache


def bench_floor(path: str, batch: int, resp: int, args) -> Dict[str, Any]:
    """The bare model: forward under autocast, the response tokens' log-probs, backward, fused AdamW."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    cuda = args.device == "cuda"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if cuda else torch.bfloat16).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=cuda)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, min(1000, model.config.vocab_size), (batch, PROMPT + resp), generator=g).to(dev)

    def step():
        opt.zero_grad(set_to_none=True)
        for mb in ids.split(args.micro):
            with torch.autocast(args.device, dtype=torch.bfloat16):
                logits = model(input_ids=mb).logits[:, PROMPT - 1:-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, mb[:, PROMPT:, None])[..., 0]
            (-lp.mean() * mb.shape[0] / batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    times = timed(step, args.steps, args.device)
    return {"seconds": statistics.median(times), "all_s": times}


def profile(fn, device: str, top: int = 12) -> Dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with torch_profile(activities=acts) as prof:
        fn()
        sync(device)
    wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and not e.is_user_annotation]
    gpu_us = sum(e.self_device_time_total for e in events)
    kernels = sorted(events, key=lambda e: -e.self_device_time_total)[:top]
    return {"wall_s": wall, "gpu_busy_s": gpu_us / 1e6,
            "kernels": [{"name": e.key[:90], "ms": e.self_device_time_total / 1e3, "calls": e.count}
                        for e in kernels]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--preset", default="qwen3_0_6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="samples a step")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--micro", type=int, nargs="+", default=[16], help="micro-batch sizes, each a run")
    ap.add_argument("--variants", default="kl,no_kl,no_kl_logits,floor",
                    help=f"comma-separated, of {', '.join([*VARIANTS, 'floor'])}")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = build_checkpoint("/tmp/bench_ckpt", args.preset)
    res: Dict[str, Any] = {"gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                           "preset": args.preset, "cmdline": " ".join(sys.argv), "runs": []}
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS) - {"floor"}
    if unknown:
        ap.error(f"--variants: unknown {sorted(unknown)}; known: {', '.join([*VARIANTS, 'floor'])}")
    micros = args.micro
    for batch in args.batch:
        for micro in micros:
            args.micro = micro
            row = {"batch": batch, "micro": micro, "tokens": batch * (PROMPT + args.new_tokens)}
            res["runs"].append(row)
            for key in variants:
                try:
                    if key == "floor":
                        row[key] = bench_floor(path, batch, args.new_tokens, args)
                    else:
                        kl, overrides, reuse = VARIANTS[key]
                        row[key] = bench_trainer(path, batch, args.new_tokens, args, kl, overrides, reuse)
                except torch.OutOfMemoryError as e:  # a too-large micro-batch: say so and go on
                    row[key] = {"error": f"out of memory: {str(e)[:200]}"}
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                write_json(os.path.join(args.out, "train_gpu.json"), res)  # partial results as it goes
    print(f"{res['gpu']}, {args.preset} shape, {PROMPT} + {args.new_tokens} tokens a sample; seconds a step, "
          f"median of {args.steps} (peak GiB)")
    print(f"{'samples':>8} {'micro':>6} " + " ".join(f"{k:>18}" for k in variants))
    for r in res["runs"]:
        cells = []
        for k in variants:
            v = r.get(k, {})
            peak = v.get("peak_gib")
            cells.append("OOM" if "error" in v else f"{v['seconds']:.3f}" + (f" ({peak:.1f})" if peak else ""))
        print(f"{r['batch']:>8} {r['micro']:>6} " + " ".join(f"{c:>18}" for c in cells))
    for r in res["runs"]:
        if "reference_exact_after_offload" in r.get("kl", {}):
            print(f"  offload with KL: {r['kl']['offloaded_allocated_gib']:.2f} GiB left allocated; reference "
                  f"log-probs exact after the round trip: {r['kl']['reference_exact_after_offload']}")
        for k in variants:
            if "train_step" in r.get(k, {}):
                t = r[k]["train_step"]
                print(f"  {k}: {t['inside_s']:.3f} s of {t['step_s']:.3f} s a step inside the backend's train_step")
            p = r.get(k, {}).get("profile")
            if p:
                print(f"  profile of {k}: wall {p['wall_s']:.3f} s, GPU busy {p['gpu_busy_s']:.3f} s")
                for kern in p["kernels"]:
                    print(f"    {kern['ms']:8.1f} ms {kern['calls']:6d}x  {kern['name']}")


if __name__ == "__main__":
    main()
