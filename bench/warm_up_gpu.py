"""Does ``trainer.warm_up`` leave step 1 nothing to compile? Each trainer with ``trainer.compile=true`` on the anchor
workload's shape (64 samples of 64 prompt + 256 response tokens, one micro-batch), no SGLang: the warm-up pass as
the driver runs it (``launch.driver.warm_up_shape``), then training steps as run.py runs them. Printed and written
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
from gpu_components import fake_rollout, sync  # noqa: E402

TRAINER_OVERRIDES = {"torch": ["trainer=torch"], "megatron": ["trainer=megatron"]}


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_trainer(name: str, path: str, args) -> Dict[str, Any]:
    from slime_hydra.config import load, resolve
    from slime_hydra.config.describe import compose
    from slime_hydra.launch.driver import warm_up_shape
    from slime_hydra.train.backend import load_backend
    from slime_hydra.train.trainer import RLTrainer

    tokens = args.batch * (args.prompt + args.resp)
    cfg = resolve(load(compose([
        f"model={args.preset}", f"model.path={path}", "model.tokenizer=null", "model.dtype=bfloat16",
        "parallelism=1gpu" if args.device == "cuda" else "parallelism=cpu", "data=jsonl",
        f"data.path={path}/config.json", "eval.datasets=[]", f"rollout.batch_size={args.batch // 8}",
        "rollout.n_samples_per_prompt=8", f"rollout.max_prompt_len={args.prompt}",
        f"rollout.max_response_len={args.resp}", "algo.kl_loss_coef=0", "trainer.compile=true",
        *TRAINER_OVERRIDES[name], f"trainer.max_tokens_per_micro_batch={tokens}" if name == "megatron"
        else f"trainer.micro_batch_size={args.batch}"])))
    cfg.output_dir = "/tmp"
    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    be = load_backend(name)(model=cfg.model, algo=cfg.algo, trainer=cfg.trainer, parallelism=cfg.parallelism,
                            model_path=path, rank=0, world_size=1, device=dev)
    try:
        rl = RLTrainer(be, cfg.algo, cfg.trainer.num_steps_per_rollout)
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
