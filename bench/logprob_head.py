"""The log-prob head alone: the model's [B, L, V] logits then the float32 log-softmax
(``train/batch.response_log_probs``) against the fused head (``train/logprobs.py``, ``trainer.fused_logprobs``),
and the fused head with its softmax statistics compiled (``compiled``: as ``trainer.compile`` runs it; the first
step, a warm-up, compiles), forward and backward of a GRPO-like loss over the response tokens' log-probs and
entropies.

    python bench/logprob_head.py                       # GPU: Qwen3-0.6B's head (V 151936, H 1024), 32 x (64 + 256)
    python bench/logprob_head.py --device cpu --samples 2 --prompt 16 --response 64   # CPU: a smaller batch

Prints seconds (median of ``--steps`` after a warm-up), the peak memory above the inputs on a GPU, and the
largest difference between the two heads' log-probs and gradients; writes ``logprob_head.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime_hydra.train.batch import MicroBatch, response_log_probs  # noqa: E402
from slime_hydra.train.logprobs import head_log_probs, response_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    B, P, T, H, V = args.samples, args.prompt, args.response, args.hidden, args.vocab
    g = torch.Generator().manual_seed(0)
    # the final norm's output (float32 on GPUs under autocast with float32 master weights) and the head
    hidden = (torch.randn(B, P + T, H, generator=g)).to(dev).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.02).to(dev).requires_grad_(True)
    ids = torch.randint(0, V, (B, T), generator=g).to(dev)
    start = torch.full((B,), P, dtype=torch.long, device=dev)
    mb = MicroBatch(input_ids=None, attention_mask=None, response_start=start, response_ids=ids,
                    loss_mask=torch.ones(B, T, device=dev), indices=list(range(B)))
    adv = torch.randn(B, T, generator=g).to(dev)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def plain():
        with amp:
            logits = hidden @ weight.T
        return response_log_probs(logits, mb, 1.0, with_entropy=True, entropy_grad=False)

    def fused(fuse: bool = False):
        with amp:
            lp, ent = head_log_probs(response_rows(hidden, start, T), weight, ids.reshape(-1), 1.0, with_entropy=True,
                                     fuse=fuse)
        return lp.view(B, T), ent.detach().view(B, T)

    results = {"shape": {"samples": B, "prompt": P, "response": T, "hidden": H, "vocab": V},
               "device": torch.cuda.get_device_name(0) if cuda else "cpu", "cmdline": " ".join(sys.argv)}
    grads = {}
    heads = (("logits", plain), ("fused", fused), ("compiled", lambda: fused(True)))
    for name, head in heads:
        def step(head=head):
            hidden.grad = weight.grad = None
            lp, ent = head()
            (-(lp * adv).mean() - 0.0 * ent.mean()).backward()
            return lp.detach(), ent

        step()
        times, peak = [], None
        for _ in range(args.steps):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            lp, ent = step()
            if cuda:
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            times.append(time.perf_counter() - t0)
        grads[name] = (lp.float(), ent.float(), hidden.grad.float().clone(), weight.grad.float().clone())
        results[name] = {"seconds": statistics.median(times), "all_s": times, "peak_gib_above_inputs": peak}
    for name in ("fused", "compiled"):
        diffs = [float((a - b).abs().max()) for a, b in zip(grads["logits"], grads[name])]
        results["max_abs_diff" if name == "fused" else f"max_abs_diff_{name}"] = dict(
            zip(("log_probs", "entropy", "grad_hidden", "grad_weight"), diffs))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "logprob_head.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"{results['device']}: {B} x ({P} + {T}) tokens, H {H}, V {V}; seconds (forward + backward), "
          f"median of {args.steps}")
    for name, _ in heads:
        r = results[name]
        peak = r["peak_gib_above_inputs"]
        print(f"  {name:>7}: {r['seconds']:.4f} s" + (f", peak {peak:.2f} GiB above the inputs" if peak else ""))
    for name, key in (("fused", "max_abs_diff"), ("compiled", "max_abs_diff_compiled")):
        print(f"  max |logits - {name}|: " + ", ".join(f"{k} {v:.2e}" for k, v in results[key].items()))


if __name__ == "__main__":
    main()
