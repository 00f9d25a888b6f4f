"""Where the engine-trainer log-prob gap comes from (issue 24). Through run.py, the mean |engine - trainer| per
token was 0.006 on the Qwen3-0.6B shape, 0.034 on the 4B shape and 0.059 on the 8B shape, all with random bf16
weights. Is it bf16 rounding growing with the model, or an error?

For each shape: a random checkpoint (bench/gpu/workload.py). SGLang serves it twice, once in bfloat16 and once in
float32 (``--dtype``), and each server samples the same prompts, returning its log-probs. Every sampled token is
then scored by the Hugging Face model on the GPU in two ways:
- **reference**: float32 weights, float32 compute;
- **trainer**: float32 weights under bfloat16 autocast, the torch trainer's precision with ``model.dtype=bfloat16``.

The per-token mean and max of |a - b| for the pairs (engine, reference), (trainer, reference) and
(engine, trainer) say where the gap comes from:
- the float32 engine against the reference: the engine's own error, rounding aside;
- the bfloat16 engine and the trainer against the reference: each side's bf16 rounding.

    BENCH_SGLANG=1 source bench/gpu/env.sh && python3 bench/logprob_gap_gpu.py --shapes qwen3_0_6b,qwen3_4b
    python bench/logprob_gap_gpu.py --cpu          # this script's own code: the tiny model, the embedded engine

Writes ``$OUT/logprob_gap.json`` and ``.md`` after every server and every scoring (a call cut short keeps what it
measured); about 6 minutes on an H200 for both shapes (four SGLang start-ups).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from gpu.harness import log, table, write_json, write_text  # noqa: E402 - bench/ is on the path from here
from gpu.sglang_server import SERVER_ARGS, prompt_ids, sampling_params, serving  # noqa: E402
from gpu.workload import Workload, build_checkpoint, write_prompts  # noqa: E402

DTYPES = ("bfloat16", "float32")  # a float32 server starts as the engine starts one (FLOAT32_SERVER_ARGS)
PAIRS = (("engine", "reference"), ("trainer", "reference"), ("engine", "trainer"))


def sample(w: Workload, dtype: str, prompts: List[List[int]]) -> Dict[str, Any]:
    """One server of ``dtype`` on the checkpoint: every prompt sampled ``w.samples`` times (seeded), each
    answer's tokens and the engine's log-probs."""
    from slime_hydra.rollout.client import GenerateClient
    from slime_hydra.rollout.engines import ServerSpec
    from slime_hydra.utils.http import control

    spec = ServerSpec(engine="sglang" if w.device == "cuda" else "embedded", model_path=w.ckpt, tokenizer_path=w.ckpt,
                      dtype=dtype, device=w.device, gpus=1, seed=0,
                      server_args={**SERVER_ARGS, "cuda_graph_max_bs_decode": len(prompts) * w.samples})

    async def go(url: str):
        client = GenerateClient(url, concurrency=len(prompts) * w.samples, retries=0)
        try:
            return await asyncio.gather(*(client.post("/generate", {
                "input_ids": p, "sampling_params": sampling_params(1000 * i + k, w.new_tokens), "return_logprob": True})
                for i, p in enumerate(prompts) for k in range(w.samples)))
        finally:
            await client.aclose()

    with serving(spec, os.path.join(w.work, f"gap_{os.path.basename(w.ckpt)}_{dtype}.log"), timeout_s=600) as srv:
        served = control(srv["url"], "/get_server_info", method="GET", timeout=30).get("dtype")
        if served != dtype:  # a row must be the dtype it names (an unset --dtype serves the checkpoint's)
            raise RuntimeError(f"asked for a {dtype} server, /get_server_info says dtype={served!r}")
        outs = asyncio.run(go(srv["url"]))
    seqs = [{"prompt": p, "ids": [t for _, t, *_ in o["meta_info"]["output_token_logprobs"]],
             "engine": [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]}
            for p, o in zip((p for p in prompts for _ in range(w.samples)), outs)]
    log(f"{w.preset} {dtype} server: up in {srv['startup_s']:.0f} s, {sum(len(s['ids']) for s in seqs)} tokens sampled")
    return {"startup_s": round(srv["startup_s"], 1), "seqs": seqs}


def score(w: Workload, seqs: List[Dict[str, Any]]) -> None:
    """Each sequence's sampled tokens scored by the float32 model, with and without bfloat16 autocast."""
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device(w.device)
    model = AutoModelForCausalLM.from_pretrained(w.ckpt, dtype=torch.float32).to(device).eval()
    try:
        for s in seqs:
            ids = torch.tensor([s["prompt"] + s["ids"]], device=device)
            p, n = len(s["prompt"]), len(s["ids"])
            for name, cast in (("reference", None), ("trainer", torch.bfloat16)):
                with torch.no_grad(), torch.autocast(device.type, dtype=cast, enabled=cast is not None):
                    logits = model(ids).logits[0, p - 1:p - 1 + n].float()
                lp = torch.log_softmax(logits, -1).gather(-1, ids[0, p:p + n, None])[:, 0]
                s[name] = lp.tolist()
    finally:
        del model
        if w.device == "cuda":
            torch.cuda.empty_cache()


def gaps(seqs: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    out = {}
    for a, b in PAIRS:
        d = [abs(x - y) for s in seqs for x, y in zip(s[a], s[b])]
        out[f"{a} - {b}"] = {"mean": statistics.mean(d), "max": max(d), "tokens": len(d)}
    out["mean_logprob"] = {"mean": statistics.mean(x for s in seqs for x in s["reference"])}
    return out


def report(res: Dict[str, Any], path: str) -> None:
    write_json(path + ".json", res)
    rows = []
    for shape, by_dtype in res["shapes"].items():
        for dtype, r in by_dtype.items():
            g = r.get("gaps")
            if not g:
                rows.append([shape, dtype, r.get("error", "not scored"), "", "", "", ""])
                continue
            rows.append([shape, dtype] + [f"{g[f'{a} - {b}']['mean']:.4f} ({g[f'{a} - {b}']['max']:.3f})"
                                          for a, b in PAIRS] + [f"{g['mean_logprob']['mean']:.2f}",
                                                                str(g["engine - reference"]["tokens"])])
    lines = [f"# Log-prob gaps by precision ({res['device']})", "",
             "Per sampled token, mean |a - b| (max in brackets). engine: SGLang's own log-probs, served in the dtype "
             "of the row; reference: the Hugging Face model in float32; trainer: the same float32 weights under "
             "bfloat16 autocast (the torch trainer's precision). bench/logprob_gap_gpu.py says how.", "",
             f"`{res['cmdline']}`", "",
             *table(["shape", "engine dtype", "engine - reference", "trainer - reference", "engine - trainer",
                     "mean log-prob", "tokens"], rows)]
    write_text(path + ".md", "\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=os.environ.get("SHAPES", "qwen3_0_6b,qwen3_4b"))
    ap.add_argument("--dtypes", default=os.environ.get("DTYPES", ",".join(DTYPES)), help="engine dtypes, in order")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--cpu", action="store_true", help="this script's own code on a CPU (tiny model, embedded engine)")
    args = ap.parse_args()
    shapes = ["tiny"] if args.cpu else [s for s in args.shapes.split(",") if s]
    device = "cpu" if args.cpu else "cuda"
    res: Dict[str, Any] = {"cmdline": "python " + " ".join(sys.argv), "shapes": {}}
    if args.cpu:
        res["device"] = "cpu"
    else:
        import torch

        res["device"] = torch.cuda.get_device_name()
    path = os.path.join(args.out, "logprob_gap")
    os.makedirs(args.out, exist_ok=True)
    for shape in shapes:
        w = Workload(f"/tmp/gapbench{'_cpu' if args.cpu else ''}", shape, args.prompts, args.samples,
                     16 if args.cpu else args.new_tokens, prompt_words=8 if args.cpu else 64, words=20 if args.cpu
                     else 1000, device=device)
        os.makedirs(w.work, exist_ok=True)
        build_checkpoint(w.ckpt, shape, device=device, reuse=True)
        write_prompts(w.data, args.prompts, w.prompt_words, w.words)
        prompts = prompt_ids(w, args.prompts)
        by_dtype = res["shapes"].setdefault(shape, {})
        for dtype in [d for d in args.dtypes.split(",") if d]:
            try:
                got = sample(w, dtype, prompts)
                score(w, got["seqs"])
                by_dtype[dtype] = {"startup_s": got["startup_s"], "gaps": gaps(got["seqs"])}
            except Exception as e:  # noqa: BLE001 - one failed server (e.g. a dtype SGLang refuses) must not hide the rest
                by_dtype[dtype] = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}  # the end: the log's last lines
            log(f"{shape} {dtype}: {by_dtype[dtype]}")
            report(res, path)
    print(open(path + ".md").read())


if __name__ == "__main__":
    main()
