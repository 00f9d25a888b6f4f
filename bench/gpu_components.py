"""GPU component timings on a Qwen3-0.6B-shaped model with random weights (no download, bench/gpu/workload.py):
embedded-engine decode throughput, one torch-backend training rollout, and a weight push to a
colocated embedded engine over each transport that one GPU allows (tensor = CUDA IPC, disk).
How a GPU run is set up: bench/README.md.

    python bench/gpu_components.py [--out DIR]
    python bench/gpu_components.py --device cpu --preset tiny --batch 16 --new-tokens 8   # a check of this script

Prints a table and writes ``gpu_components.json``. Also the torch trainer and fake rollouts that
bench/train_gpu.py times.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from gpu.harness import write_json  # noqa: E402 - bench/ is on the path from here
from gpu.workload import build_checkpoint  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_engine(path: str, batch: int, prompt_len: int, new_tokens: int, device: str) -> dict:
    from slime_hydra.rollout.embedded.engine import EmbeddedEngine, Request, SamplingParams

    eng = EmbeddedEngine(path, dtype="bfloat16", device=device)
    g = torch.Generator().manual_seed(0)

    def reqs(n):
        return [Request(torch.randint(2, eng.vocab_size, (prompt_len,), generator=g).tolist(),  # noqa: F821 - deleted after use
                        SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), rid=str(i), return_logprob=True)
                for i in range(n)]

    eng.generate(reqs(8))  # warm-up
    sync(device)
    t0 = time.perf_counter()
    outs = eng.generate(reqs(batch))
    sync(device)
    dt = time.perf_counter() - t0
    toks = sum(len(o["output_ids"]) for o in outs)
    del eng
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"batch": batch, "new_tokens": new_tokens, "seconds": dt, "tokens_per_s": toks / dt,
            "ms_per_decode_step": 1000 * dt / new_tokens}


def rl_trainer(path: str, batch: int, micro: int, preset: str, device: str, kl_loss_coef: float = 0.04,
               overrides: tuple = ()):
    """The trainer backend (the torch one unless ``overrides`` name another) and the RL step as run.py builds
    them, for ``batch`` samples a rollout (8 per prompt) in micro-batches of ``micro``; GRPO with
    ``algo.kl_loss_coef``; more config ``overrides``."""
    from slime_hydra.config import load, resolve
    from slime_hydra.config.describe import compose
    from slime_hydra.train.backend import BACKENDS
    from slime_hydra.train.trainer import RLTrainer

    cfg = resolve(load(compose([
        f"model={preset}", f"model.path={path}", "model.tokenizer=null", "model.dtype=bfloat16",
        "parallelism=1gpu" if device == "cuda" else "parallelism=cpu", "data=jsonl",
        f"data.path={path}/config.json", "eval.datasets=[]", f"rollout.batch_size={batch // 8}",
        "rollout.n_samples_per_prompt=8", f"trainer.micro_batch_size={micro}", f"algo.kl_loss_coef={kl_loss_coef}",
        *overrides])))
    cfg.output_dir = "/tmp"
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    tr = BACKENDS[cfg.trainer.backend](model=cfg.model, algo=cfg.algo, trainer=cfg.trainer,
                                           parallelism=cfg.parallelism, model_path=path, rank=0, world_size=1,
                                           device=dev)
    return tr, RLTrainer(tr, cfg.algo, cfg.trainer.num_steps_per_rollout), cfg


def fake_rollout(batch: int, prompt_len: int, resp_len: int, vocab: int, seed: int = 0) -> dict:
    """A rollout's training data: random tokens (ids below ``vocab``), random rewards."""
    g = torch.Generator().manual_seed(seed)
    return {"tokens": [torch.randint(2, vocab, (prompt_len + resp_len,), generator=g).tolist() for _ in range(batch)],
            "response_lengths": [resp_len] * batch, "loss_masks": [None] * batch,
            "rewards": torch.randn(batch, generator=g).tolist(), "raw_rewards": [0.0] * batch,
            "rollout_log_probs": [[-1.0] * resp_len for _ in range(batch)]}


def bench_train(path: str, batch: int, prompt_len: int, resp_len: int, micro: int, preset: str, device: str) -> dict:
    tr, rl, _ = rl_trainer(path, batch, micro, preset, device)
    data = fake_rollout(batch, prompt_len, resp_len, min(1000, tr.model.config.vocab_size))
    rl.train(data, temperature=1.0, max_response_len=resp_len)  # warm-up
    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m = rl.train(data, temperature=1.0, max_response_len=resp_len)
    sync(device)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    out = {"batch": batch, "tokens": batch * (prompt_len + resp_len), "seconds": dt,
           "tokens_per_s": batch * (prompt_len + resp_len) / dt, "peak_gib": peak, "grad_norm": m.get("grad_norm")}
    named = tr.hf_weights()
    return out, tr, named


def bench_sync(path: str, named, tmpdir: str, device: str) -> dict:
    from slime_hydra.rollout.engines import ServerSpec, server_command
    from slime_hydra.sync.sender import Endpoint, WeightSender
    from slime_hydra.utils.proc import free_port, kill_tree, spawn, wait_http

    spec = ServerSpec(engine="embedded", model_path=path, tokenizer_path=path, dtype="bfloat16", device=device, gpus=1,
                      seed=0)
    port = free_port()
    log = os.path.join(tmpdir, "engine.log")
    proc = spawn(server_command(spec, "127.0.0.1", port, base_gpu_id=0), log)
    url = f"http://127.0.0.1:{port}"
    results = {}
    try:
        wait_http(url + "/health_generate", proc, 600, log)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        for kind in ("tensor", "disk"):
            dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
            if kind == "tensor" and device == "cpu":
                torch.multiprocessing.set_sharing_strategy("file_system")
            sender = WeightSender(kind, [Endpoint(url, 1)], dev, 512, os.path.join(tmpdir, kind), path)
            sender.connect()
            sender.push(named, version=1)  # warm-up
            times = [sender.push(named, version=v)["seconds"] for v in (2, 3, 4)]
            sender.close()
            results[kind] = {"seconds": min(times), "GiB": nbytes / 2**30, "GiB_per_s": nbytes / 2**30 / min(times)}
    finally:
        kill_tree(proc)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--preset", default="qwen3_0_6b")
    ap.add_argument("--device", default="cuda", help="cpu: a quick check of this script with --preset tiny")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    args = ap.parse_args()
    dev = args.device
    os.makedirs(args.out, exist_ok=True)
    path = build_checkpoint("/tmp/bench_ckpt", args.preset)
    res = {"gpu": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "preset": args.preset}
    res["engine"] = [bench_engine(path, b, 128, args.new_tokens, dev) for b in (args.batch // 4, args.batch)]
    train, tr, named = bench_train(path, args.batch, 128, args.new_tokens, 16, args.preset, dev)
    res["train"] = train
    named = [(k, v.detach().clone()) for k, v in named]
    del tr
    if dev == "cuda":
        torch.cuda.empty_cache()
    res["sync"] = bench_sync(path, named, "/tmp/bench_sync", dev)
    write_json(os.path.join(args.out, "gpu_components.json"), res)
    print(f"{res['gpu']}, {args.preset} shape, random weights, bf16")
    for e in res["engine"]:
        print(f"engine decode  batch {e['batch']:>4}: {e['tokens_per_s']:>9.0f} tok/s  "
              f"({e['ms_per_decode_step']:.1f} ms/step)")
    t = res["train"]
    print(f"train rollout  {t['batch']} x {128 + args.new_tokens} tok: {t['seconds']:.2f} s  "
          f"{t['tokens_per_s']:.0f} tok/s  peak {t['peak_gib']:.1f} GiB")
    for k, s in res["sync"].items():
        print(f"weight push    {k:<8}: {s['seconds']:.3f} s for {s['GiB']:.2f} GiB ({s['GiB_per_s']:.1f} GiB/s)")


if __name__ == "__main__":
    main()
