"""Does ``trainer.warm_up`` leave step 1 nothing to compile? Each trainer with ``trainer.compile=true`` on the anchor
workload's shape (64 samples of 64 prompt + 256 response tokens, one micro-batch), no SGLang: the warm-up pass as
the driver runs it (``launch.parts.warm_up_shape``), then training steps as run.py runs them. Printed and written
(``warm_up_gpu.json``): the warm-up's seconds, each step's seconds, and how many graphs torch.compile made in the
warm-up and in each step (0 after the warm-up: step 1 is a steady step). How a GPU run is set up: bench/README.md.

    python3 bench/warm_up_gpu.py --out $OUT                      # one H200, both trainers: about 3 minutes
    python bench/warm_up_gpu.py --device cpu --preset tiny --trainers torch --batch 8 --prompt 4 --resp 8
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace
from typing import Any, Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from gpu.harness import write_json  # noqa: E402 - bench/ is on the path
from gpu.workload import build_checkpoint  # noqa: E402
from gpu_components import fake_rollout, rl_trainer, sync  # noqa: E402

TRAINER_OVERRIDES = {"torch": ["trainer=torch"], "megatron": ["trainer=megatron"]}


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_trainer(name: str, path: str, args) -> Dict[str, Any]:
    from torch._dynamo.utils import counters

    from slime_hydra.launch.parts import warm_up_shape

    tokens = args.batch * (args.prompt + args.resp)
    torch._dynamo.reset()
    counters.clear()
    be, rl, cfg = rl_trainer(path, args.batch, args.batch, args.preset, args.device, 0.0, (
        f"rollout.max_prompt_len={args.prompt}", f"rollout.max_response_len={args.resp}", "trainer.compile=true",
        *TRAINER_OVERRIDES[name], f"trainer.max_tokens_per_micro_batch={tokens}"))
    try:
        shape = warm_up_shape(cfg, SimpleNamespace(data_parallel=1))
        sync(args.device)
        t0 = time.perf_counter()
        be.warm_up(1.0, shape)
        sync(args.device)
        out: Dict[str, Any] = {"warm_up_shape": vars(shape), "warm_up_s": round(time.perf_counter() - t0, 2),
                               "warm_up_graphs": graphs()}
        steps: List[Dict[str, float]] = []
        vocab = min(1000, be.hf.vocab_size if name == "megatron" else be.model.config.vocab_size)
        for s in range(args.steps):
            data = fake_rollout(args.batch, args.prompt, args.resp, vocab, seed=s)
            before = graphs()
            sync(args.device)
            t0 = time.perf_counter()
            rl.train(data, temperature=1.0, max_response_len=args.resp)
            sync(args.device)
            seconds = round(time.perf_counter() - t0, 3)
            steps.append({"step": s + 1, "seconds": seconds, "new_graphs": graphs() - before})
            print(f"{name} step {s + 1}: {steps[-1]}", flush=True)
        out["steps"] = steps
        return out
    finally:
        if name == "megatron":
            import torch.distributed as dist
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        del be
        if args.device == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="qwen3_0_6b")
    ap.add_argument("--trainers", default="torch,megatron")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--resp", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = build_checkpoint(f"/tmp/warm_up_gpu_{args.preset}", args.preset, device=args.device)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "preset": args.preset,
              "batch": args.batch, "prompt": args.prompt, "resp": args.resp, "trainers": {}}
    for name in args.trainers.split(","):
        try:
            result["trainers"][name] = run_trainer(name, path, args)
        except Exception as e:  # the other trainer still runs; the error is the result
            result["trainers"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
        print(name, result["trainers"][name], flush=True)
    if args.out:
        write_json(os.path.join(args.out, "warm_up_gpu.json"), result)


if __name__ == "__main__":
    main()
