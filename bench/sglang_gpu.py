"""Real SGLang 0.5.17 on the lent GPU machine, against raw SGLang, the embedded engine and TRL, in one call.

    bash bench/sglang_gpu.sh                      # one H200 colocated, TRL's anchor workload (8 x 8 x 256)
    WORKLOAD=256x256 bash bench/sglang_gpu.sh     # the same table for 32 prompts x 8 samples x 256 tokens
    bash bench/sglang_gpu_split.sh                # two H200s: trainer on GPU 0, SGLang on GPU 1, async

Workloads (``--workload``): ``anchor``, TRL's GRPO anchor (8 prompts x 8 samples x 256 new tokens a step);
``256x256``, 256 samples of 256 new tokens a step (32 prompts x 8 samples).

Phases (each a child process with its own time limit, so one that hangs or dies leaves the others):
  raw       SGLang started from the engine class's own command line on a Qwen3-0.6B-shaped random
            checkpoint; the GRPO step's requests (8 prompts x 8 samples x 256 new tokens, 64-token prompts,
            the run's sampling parameters) sent straight to it (no router, no manager): the reference
            time. Then checks against the live server: protocol (/model_info,
            /get_weight_version 404), weight updates over disk, CUDA IPC (and NCCL broadcast when the
            server has its own GPU) that must change the policy and restore it exactly, memory release
            and resume around a push (colocated), abort of all requests and of one rid.
  sglang    python run.py rollout=sglang algo=grpo (no KL loss, as TRL's default) on the same checkpoint
            and data, colocated without offload
            (parallelism.offload_train=false offload_rollout=false: nothing moves, the push reads the
            trainer's GPU tensors; split: the layout's own): per-step rollout, train and sync seconds,
            the train/rollout log-prob gap, startup (run start to the first step, engines up, SGLang's
            own weight-load and CUDA-graph capture times).
  sglang_offload  the same, colocated with both offloads on (the trainer's state to the host while
            SGLang generates, SGLang's memory released while the trainer trains).
  trl       TRL's GRPOTrainer (HF generate, no vLLM) on the same checkpoint, prompts and batch: 8 x 8
            completions of exactly the workload's length a step, micro-batches of 16 as ours, fp32
            weights under bf16 autocast, no KL (TRL's default beta 0). Rollout = its
            _generate_and_score_completions, train = the rest of the optimiser step, sync = 0 (one model).
  embedded  the same run.py run with the embedded engine (fewer steps), for comparison; not in the default
            phases (one 10-minute call holds three SGLang start-ups, not a fourth run).
Phases run in that order (``--phases``); one that the time budget cannot fit is skipped and reported.

Writes ``$OUT/sglang_gpu_<layout>.json`` and ``.md`` (a table) as it goes, and exits non-zero when a
check failed or a phase did not finish; speed goals (issue 10) are reported as met or missed, not
checked. Every number comes from this run.

``--cpu``: a dry run of this script's own code on a CPU machine: the tiny model, 16 new tokens, the embedded
engine in place of SGLang for the raw phase, its checks and the sglang phases (it speaks the same
protocol), TRL on the CPU: every phase runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from gpu_watch import GpuSampler, log, read_rows  # noqa: E402 - bench/ is on the path from here

WORK = "/tmp/sglbench"
CKPT, DATA = f"{WORK}/q06", f"{WORK}/q06.jsonl"
PROMPTS, SAMPLES, NEW_TOKENS, PROMPT_WORDS = 8, 8, 256, 64
PRESET, DEVICE, LONG_TOKENS, WORDS = "qwen3_0_6b", "cuda", 4096, 1000  # --cpu changes these (dry_run_on_cpu)
# what conf/rollout/sglang.yaml leaves to the deployment; the bundle (../shared/tools/sglang-bundle.sh)
# has no FA3 kernels, so attention runs on triton
SERVER_ARGS = {"mem_fraction_static": 0.5, "attention_backend": "triton", "sampling_backend": "pytorch",
               "grammar_backend": "none"}
GOALS = {"rollout_vs_raw": 1.5, "sync_ms_per_gb": 50.0, "step_s": 2.5}  # issue 10, one H200 colocated
WORKLOADS = {"anchor": (8, 8, 256), "256x256": (32, 8, 256)}  # prompts, samples per prompt, new tokens
MICRO_BATCH = 16  # samples per micro-batch, ours and TRL's
PHASES = ("build", "raw", "sglang", "sglang_offload", "trl", "embedded")
RUN_PHASES = ("sglang", "sglang_offload", "embedded")  # python run.py
# what each run phase adds to run.py's command line (colocated layout)
OFFLOAD = {"sglang": ["parallelism.offload_train=false", "parallelism.offload_rollout=false"],
           "sglang_offload": ["parallelism.offload_train=true", "parallelism.offload_rollout=true"], "embedded": []}


def set_workload(name: str) -> None:
    global PROMPTS, SAMPLES, NEW_TOKENS
    PROMPTS, SAMPLES, NEW_TOKENS = WORKLOADS[name]


def dry_run_on_cpu() -> None:
    global WORK, CKPT, DATA, NEW_TOKENS, PROMPT_WORDS, PRESET, DEVICE, LONG_TOKENS, WORDS
    WORK = "/tmp/sglbench_cpu"
    CKPT, DATA = f"{WORK}/tiny", f"{WORK}/tiny.jsonl"
    NEW_TOKENS, PROMPT_WORDS, PRESET, DEVICE, LONG_TOKENS, WORDS = 16, 8, "tiny", "cpu", 2000, 20


# ------------------------------------------------------------------------------------ helpers
def median(xs: List[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def gpu_ids(layout: str) -> Dict[str, int]:
    return {"trainer": 0, "engine": 0} if layout == "colocated" else {"trainer": 0, "engine": 1}


def check(results: Dict[str, Any], name: str, ok: bool, detail: str) -> bool:
    results.setdefault("checks", {})[name] = {"pass": bool(ok), "detail": detail}
    log(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    return ok


# ------------------------------------------------------------------------------- build (phase)
def build() -> Dict[str, Any]:
    """The random Qwen3-0.6B-shaped checkpoint (a word-level tokenizer of its vocabulary size) and
    2048 prompts of 64 random words (bench/gpu_real_shape.sh's data)."""
    import random

    import gpu_components

    os.makedirs(WORK, exist_ok=True)
    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(CKPT, "config.json")):
        gpu_components.build_checkpoint(CKPT, PRESET)
    rng = random.Random(0)
    with open(DATA, "w") as f:
        for _ in range(2048):
            words = " ".join(f"t{rng.randrange(WORDS)}" for _ in range(PROMPT_WORDS))
            f.write(json.dumps({"prompt": words, "label": f"t{rng.randrange(10)}"}) + "\n")
    return {"build_s": time.perf_counter() - t0}


# --------------------------------------------------------------------------------- raw (phase)
def sampling_params(seed: int, max_new_tokens: int = NEW_TOKENS) -> Dict[str, Any]:
    """The run's sampling parameters (slime_hydra/rollout/sampling.py, rollout=sglang defaults) and a
    sampling seed per sample, as the default generate function sends them."""
    return {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new_tokens,
            "skip_special_tokens": True, "no_stop_trim": True, "spaces_between_special_tokens": False,
            "sampling_seed": seed}


def prompt_ids(n: int) -> List[List[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(CKPT)
    with open(DATA) as f:
        rows = [json.loads(next(f))["prompt"] for _ in range(n)]
    return [tok.encode(r, add_special_tokens=False) for r in rows]


async def timed_requests(url: str, prompts: List[List[int]], samples: int, new_tokens: int) -> Dict[str, Any]:
    """All ``len(prompts) x samples`` requests at once, one /generate each (as the rollout sends them)."""
    from slime_hydra.rollout.client import GenerateClient

    client = GenerateClient(url, concurrency=len(prompts) * samples, retries=0)
    try:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(client.post("/generate", {
            "input_ids": p, "sampling_params": sampling_params(1000 * i + k, new_tokens), "return_logprob": True})
            for i, p in enumerate(prompts) for k in range(samples)))
        dt = time.perf_counter() - t0
    finally:
        await client.aclose()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"seconds": dt, "tokens": tokens, "tokens_per_s": tokens / dt}


def greedy(url: str, prompts: List[List[int]]) -> List[Dict[str, Any]]:
    """Greedy answers (16 tokens) with log-probs: the fingerprint of the weights the server runs."""
    import httpx

    r = httpx.post(url + "/generate", timeout=120, json={
        "input_ids": prompts, "return_logprob": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}})
    r.raise_for_status()
    return [{"ids": o["output_ids"], "lps": [p[0] for p in o["meta_info"]["output_token_logprobs"]]} for o in r.json()]


def fingerprint_gap(a: List[Dict[str, Any]], b: List[Dict[str, Any]]) -> Dict[str, float]:
    same = sum(x["ids"] == y["ids"] for x, y in zip(a, b)) / len(a)
    gaps = [abs(p - q) for x, y in zip(a, b) for p, q in zip(x["lps"], y["lps"])]
    return {"same_tokens": same, "max_lp_gap": max(gaps), "mean_lp": statistics.mean(p for x in b for p in x["lps"])}


def checkpoint_weights(device) -> List:
    """The checkpoint's tensors, each storage once (tied lm_head is the embedding), on ``device``."""
    from safetensors.torch import load_file

    named = {}
    for f in sorted(os.listdir(CKPT)):
        if f.endswith(".safetensors"):
            named.update(load_file(os.path.join(CKPT, f), device=str(device)))
    return sorted(named.items())


def phase_raw(layout: str, out: Dict[str, Any]) -> None:
    import httpx
    import torch

    from slime_hydra.rollout.engines import ServerSpec, make_engine
    from slime_hydra.sync.sender import Endpoint, WeightSender
    from slime_hydra.utils.http import EngineError, control, weight_version
    from slime_hydra.utils.proc import free_port, kill_tree, spawn, wait_http

    gpus = gpu_ids(layout)
    colocated = layout == "colocated"
    spec = ServerSpec(engine="sglang" if DEVICE == "cuda" else "embedded", model_path=CKPT, tokenizer_path=CKPT,
                      dtype="bfloat16", device=DEVICE, gpus=1, seed=0, memory_saver=colocated,
                      server_args={**SERVER_ARGS, "cuda_graph_max_bs_decode": PROMPTS * SAMPLES,
                                   **({} if colocated else {"disable_prefill_cuda_graph": True})})
    engine = make_engine(spec)
    port = free_port()
    cmd = engine.command("127.0.0.1", port, gpus["engine"], nccl_port=free_port())
    for name in engine.unset_env:
        os.environ.pop(name, None)
    server_log = os.path.join(WORK, f"raw_{layout}_server.log")
    open(server_log, "w").close()
    url = f"http://127.0.0.1:{port}"
    out["command"] = " ".join(cmd[1:])
    t0 = time.perf_counter()
    proc = spawn(cmd, server_log, engine.env())
    try:
        wait_http(url + "/health_generate", proc, 400, server_log)
        out["startup_s"] = time.perf_counter() - t0
        out["server_log_times"] = sglang_log_times(server_log)
        log(f"raw {spec.engine} up in {out['startup_s']:.1f}s: {out['server_log_times']}")

        # the reference: the GRPO step's requests, then 256 x 256
        prompts = prompt_ids(256)
        step = prompts[:PROMPTS]
        asyncio.run(timed_requests(url, step, SAMPLES, NEW_TOKENS))  # warm-up
        runs = [asyncio.run(timed_requests(url, step, SAMPLES, NEW_TOKENS)) for _ in range(3)]
        out["grpo_step_requests"] = {"requests": PROMPTS * SAMPLES, "new_tokens": NEW_TOKENS,
                                     "seconds": [r["seconds"] for r in runs], "tokens": runs[-1]["tokens"],
                                     "median_s": median([r["seconds"] for r in runs])}
        log(f"raw SGLang, {PROMPTS}x{SAMPLES}x{NEW_TOKENS}: {out['grpo_step_requests']['seconds']}")

        # checks against the live server
        info = httpx.get(url + "/model_info").json()
        old = httpx.get(url + "/get_weight_version")
        check(out, "protocol", info.get("weight_version") == "default" and old.status_code == 404,
              f"/model_info weight_version={info.get('weight_version')!r}, /get_weight_version -> {old.status_code}")
        probe = prompts[:4]
        control(url, "/flush_cache")  # the answers below and after each push: computed from scratch alike
        base = greedy(url, probe)
        device = torch.device("cuda", gpus["trainer"]) if DEVICE == "cuda" else torch.device("cpu")
        w1 = checkpoint_weights(device)
        sharp = [(n, t * 20 if n == "model.embed_tokens.weight" else t) for n, t in w1]  # a peaked policy
        # the transports of the layout: CUDA IPC on one GPU, NCCL broadcast across two; disk in both
        pushes = [("disk", sharp, 1), ("tensor" if colocated else "distributed", w1, 2)]
        for kind, named, version in pushes:
            sender = WeightSender(kind, [Endpoint(url, 1)], device, 512, os.path.join(WORK, f"disk_{layout}"), CKPT)
            try:
                sender.connect()
                stats = sender.push(named, version)
                got = greedy(url, probe)
                gap = fingerprint_gap(base, got)
                if named is sharp:  # a different policy: log-probs move by nats (the random model's are near -11.9)
                    ok = gap["max_lp_gap"] > 1.0
                else:  # the checkpoint again: the first answers, to bf16 rounding
                    ok = gap["same_tokens"] == 1 and gap["max_lp_gap"] < 1e-2
                check(out, f"update_weights_{kind}_v{version}", ok and weight_version(url) == str(version),
                      f"{stats['bytes'] / 2**30:.2f} GiB in {stats['seconds']:.3f}s; model_info version "
                      f"{weight_version(url)}; vs first answers: {gap}")
                out.setdefault("push_s", {})[f"{kind}_v{version}"] = stats["seconds"]
            except Exception as e:  # noqa: BLE001 - one failed check must not hide the others
                check(out, f"update_weights_{kind}_v{version}", False, repr(e))
            finally:
                sender.close()
        if colocated:
            try:  # the colocated choreography around a push: release all, resume weights, push, resume the cache
                t = time.perf_counter()
                control(url, "/flush_cache")
                control(url, "/release_memory_occupation", {"tags": None})
                control(url, "/resume_memory_occupation", {"tags": ["weights"]})
                sender = WeightSender("tensor", [Endpoint(url, 1)], device, 512, WORK, CKPT)
                sender.push(w1, 3)
                control(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
                dt = time.perf_counter() - t
                gap = fingerprint_gap(base, greedy(url, probe))
                check(out, "release_resume_push", gap["same_tokens"] == 1 and gap["max_lp_gap"] < 1e-2,
                      f"{dt:.3f}s for release + resume + push + resume; vs first answers: {gap}")
            except (EngineError, RuntimeError) as e:
                check(out, "release_resume_push", False, repr(e))
        del w1, sharp
        torch.cuda.empty_cache()
        check_batched(url, out)
        check_aborts(url, out)
    finally:
        kill_tree(proc)
        out["server_log"] = server_log


def check_batched(url: str, out: Dict[str, Any]) -> None:
    """One group as one /generate (SGLang's batched form, as the rollout sends a group): a list of
    ``input_ids``, one ``sampling_params`` and one ``rid`` per sample; the answer is a list in the same
    order, each sample under its own rid."""
    import httpx

    ids = prompt_ids(1)[0]
    rids = [f"bench-group-{k}" for k in range(SAMPLES)]
    body = {"input_ids": [ids] * SAMPLES, "rid": rids, "return_logprob": True,
            "sampling_params": [{**sampling_params(k, 32), "ignore_eos": True} for k in range(SAMPLES)]}
    try:
        t = time.perf_counter()
        r = httpx.post(url + "/generate", json=body, timeout=120)
        batched_s = time.perf_counter() - t
        r.raise_for_status()
        outs = r.json()
        got = [o["meta_info"]["id"] for o in outs] if isinstance(outs, list) else outs
        lens = [len(o["meta_info"]["output_token_logprobs"]) for o in outs] if isinstance(outs, list) else []
        check(out, "batched_generate", got == rids and lens == [32] * SAMPLES,
              f"{SAMPLES} samples in one request: {batched_s:.3f}s; ids in order: {got == rids}; tokens {lens}")
    except (httpx.HTTPError, KeyError, TypeError) as e:
        check(out, "batched_generate", False, repr(e))


def check_aborts(url: str, out: Dict[str, Any]) -> None:
    """abort_all while 16 long requests run, then one request aborted by its rid."""
    import concurrent.futures

    import httpx

    from slime_hydra.utils.http import control

    long = {"temperature": 1.0, "max_new_tokens": LONG_TOKENS, "ignore_eos": True}
    ids = prompt_ids(1)[0]

    def post(body):
        return httpx.post(url + "/generate", json=body, timeout=120).json()

    with concurrent.futures.ThreadPoolExecutor(17) as pool:
        futs = [pool.submit(post, {"input_ids": ids, "sampling_params": long}) for _ in range(16)]
        time.sleep(1.5)
        t = time.perf_counter()
        control(url, "/abort_request", {"abort_all": True})
        outs = [f.result() for f in futs]
        dt = time.perf_counter() - t
        kinds = [o["meta_info"]["finish_reason"]["type"] for o in outs]
        lens = [o["meta_info"]["completion_tokens"] for o in outs]
        check(out, "abort_all", all(k == "abort" for k in kinds) and max(lens) < LONG_TOKENS,
              f"16 requests answered {dt:.2f}s after abort_all: {sorted(set(kinds))}, {min(lens)}-{max(lens)} tokens")
        fut = pool.submit(post, {"input_ids": ids, "sampling_params": long, "rid": "bench-abort-1"})
        time.sleep(1.0)
        control(url, "/abort_request", {"rid": "bench-abort-1"})
        o = fut.result()
        reason = o["meta_info"]["finish_reason"]
        check(out, "abort_rid", reason["type"] == "abort", f"finish_reason {reason}, "
              f"{o['meta_info']['completion_tokens']} tokens")
        # one sample of a batched request aborted by its rid, the others a second later (abort_all): the
        # one stopped first, the others decoded on in between
        rids = [f"bench-abort-group-{k}" for k in range(4)]
        fut = pool.submit(post, {"input_ids": [ids] * 4, "sampling_params": [long] * 4, "rid": rids})
        time.sleep(1.0)
        control(url, "/abort_request", {"rid": rids[1]})
        time.sleep(1.0)
        control(url, "/abort_request", {"abort_all": True})
        outs = fut.result()
        kinds = [o["meta_info"]["finish_reason"]["type"] for o in outs]
        lens = [o["meta_info"]["completion_tokens"] for o in outs]
        check(out, "abort_rid_in_batch", kinds == ["abort"] * 4 and lens[1] < min(lens[:1] + lens[2:]),
              f"finish reasons {kinds}, tokens {lens} (sample 1 aborted a second before the others)")


# ------------------------------------------------------------------------------ runs (phase)
def run_overrides(layout: str, phase: str, steps: int, extra: str = "") -> List[str]:
    """run.py's command line for a run phase; on CPU (--cpu) the embedded engine stands in for SGLang."""
    engine = "embedded" if phase == "embedded" or DEVICE == "cpu" else "sglang"
    common = [f"model={PRESET}", f"model.path={CKPT}", "model.tokenizer=null", "data=jsonl", f"data.path={DATA}",
              "data.apply_chat_template=false", "eval.datasets=[]", f"rollout.batch_size={PROMPTS}",
              f"rollout.n_samples_per_prompt={SAMPLES}", f"rollout.max_response_len={NEW_TOKENS}",
              f"trainer.num_rollout={steps}", f"trainer.micro_batch_size={MICRO_BATCH}", "trainer.save_interval=1000",
              "logging.wandb=false", "logging.progress=false", "sync.max_logprob_diff=0.05",
              # no KL loss: TRL's default (beta 0), so both run the same objective; algo=grpo's KL 0.04 adds a
              # reference pass, which bench/train_gpu.py times
              "algo.kl_loss_coef=0"]
    if DEVICE == "cpu":
        common += ["parallelism=cpu_colocate"] if layout == "colocated" else ["parallelism=cpu", "trainer.mode=async"]
    elif layout == "colocated":
        common += ["parallelism=1gpu"]
    else:
        common += ["parallelism=1gpu", "parallelism.name=split_1_1", "parallelism.colocate=false",
                   "parallelism.gpus_per_node=2", "parallelism.rollout_gpus=1", "trainer.mode=async"]
    if layout == "colocated":
        common += OFFLOAD[phase]
    if engine == "sglang":
        # no prefill CUDA graph in any layout: engines with the memory saver turn it off themselves, and it
        # made SGLang's start 159 s instead of 45 s
        common += ["rollout=sglang", f"rollout.concurrency={PROMPTS * SAMPLES}",
                   f"rollout.server_args.mem_fraction_static={SERVER_ARGS['mem_fraction_static']}",
                   *(f"+rollout.server_args.{k}={v}" for k, v in SERVER_ARGS.items() if k != "mem_fraction_static"),
                   "+rollout.server_args.disable_prefill_cuda_graph=true"]
    else:
        common += ["rollout=embedded", f"rollout.embedded_max_batch={PROMPTS * SAMPLES}"]
    return common + extra.split()


def phase_run(layout: str, engine: str, steps: int, limit_s: float, out: Dict[str, Any], extra: str = "") -> None:
    """``engine``: the run phase (sglang, sglang_offload, embedded)."""
    from slime_hydra.utils.proc import kill_tree, spawn, tail

    run_dir = os.path.join(WORK, f"run_{layout}_{engine}")
    subprocess.run(["rm", "-rf", run_dir])
    cmd = [sys.executable, os.path.join(ROOT, "run.py"), *run_overrides(layout, engine, steps, extra),
           f"hydra.run.dir={run_dir}"]
    out["command"] = "python run.py " + " ".join(cmd[2:])
    log(out["command"])
    metrics = os.path.join(run_dir, "metrics.jsonl")
    seen: Dict[int, float] = {}  # step -> wall time its row appeared
    sampler = GpuSampler(os.path.join(WORK, f"gpu_{layout}_{engine}.csv")) if layout != "colocated" and \
        DEVICE == "cuda" else None
    console = os.path.join(WORK, f"run_{layout}_{engine}.out")
    open(console, "w").close()
    t0, wall0 = time.perf_counter(), time.time()
    # its own process group, killed with this process: a run stopped at its limit takes its Ray processes along
    proc = spawn(cmd, console)
    while proc.poll() is None and time.perf_counter() - t0 < limit_s:
        time.sleep(0.2)
        for row in read_rows(metrics):
            seen.setdefault(row["step"], time.perf_counter() - t0)
    if proc.poll() is None:
        log(f"run over its {limit_s:.0f}s: stopped")
        kill_tree(proc, timeout=20)
    if sampler is not None:
        sampler.stop()
    rows = read_rows(metrics)
    for row in rows:
        seen.setdefault(row["step"], time.perf_counter() - t0)
    out["returncode"] = proc.returncode
    out["wall_s"] = time.perf_counter() - t0
    out["rows"] = rows
    if rows:
        out["startup_s"] = seen[rows[0]["step"]] - rows[0]["perf/step_time"]  # launch -> first step begins
        out["after_last_step_s"] = out["wall_s"] - seen[rows[-1]["step"]]  # final save and shutdown
    out["log_times"] = run_log_times(run_dir)
    out["run_dir"] = run_dir
    if sampler is not None and len(rows) > 2:
        since = wall0 + seen[rows[1]["step"]]  # steady state: after the second step
        out["gpu_idle"] = sampler.idle_share(since)
    out["console_tail"] = tail(console, 25)
    log(f"{engine}: rc={proc.returncode}, {len(rows)} steps, wall {out['wall_s']:.0f}s")


# ------------------------------------------------------------------------------- trl (phase)
def phase_trl(steps: int, out: Dict[str, Any]) -> None:
    """TRL's GRPOTrainer on the same checkpoint, prompts and batch (see the module docstring). Each
    step's row has run.py's metric names, so the table reads both alike."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = DEVICE == "cuda"
    out["versions"] = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    rollout_s: List[float] = []

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):  # generation, rewards, advantages, old log-probs
            sync()
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                sync()
                rollout_s.append(time.perf_counter() - t)

    rows: List[Dict[str, Any]] = out.setdefault("rows", [])

    class StepTimes(TrainerCallback):
        """Wall time between optimiser steps (as run.py's perf/step_time: everything of the step)."""

        def on_train_begin(self, args, state, control, **kw):
            sync()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            now = time.perf_counter()
            step, gen = now - self.t, sum(rollout_s)
            rollout_s.clear()
            rows.append({"step": state.global_step, "perf/step_time": step, "perf/rollout_wait_time": gen,
                         "perf/rollout_time": gen, "perf/train_time": step - gen, "perf/weight_sync_time": 0.0,
                         "perf/offload_time": 0.0})
            log(f"trl step {state.global_step}: {step:.2f}s (rollout {gen:.2f}s)")
            self.t = now

    with open(DATA) as f:
        data = [json.loads(line) for line in f][:PROMPTS * (steps + 1)]
    dataset = Dataset.from_list([{"prompt": d["prompt"], "label": d["label"]} for d in data])

    def first_word_is_label(completions, label, **kw):
        return [float(c.split()[:1] == [lab]) for c, lab in zip(completions, label)]

    args = GRPOConfig(
        output_dir=os.path.join(WORK, "trl"), max_steps=steps, num_generations=SAMPLES,
        per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=PROMPTS * SAMPLES // MICRO_BATCH,
        max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0, learning_rate=1e-6, beta=0.0,
        gradient_checkpointing=False, bf16=cuda, use_cpu=not cuda, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, generation_kwargs={"min_new_tokens": NEW_TOKENS})  # every completion full
    out["config"] = {k: getattr(args, k) for k in ("num_generations", "per_device_train_batch_size",
                                                    "gradient_accumulation_steps", "generation_batch_size",
                                                    "max_completion_length", "bf16", "gradient_checkpointing",
                                                    "beta", "loss_type", "use_vllm")}
    model = AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.float32)  # fp32 master weights, as ours
    tok = AutoTokenizer.from_pretrained(CKPT)
    t0 = time.perf_counter()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=first_word_is_label, args=args, train_dataset=dataset,
                               processing_class=tok, callbacks=[StepTimes()])
    out["startup_s"] = time.perf_counter() - t0  # the trainer's construction (the model was loaded before)
    trainer.train()
    out["returncode"] = 0
    out["wall_s"] = time.perf_counter() - t0
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30


def sglang_log_times(path: str) -> Dict[str, float]:
    """SGLang's own timings in a server log: weight load, each CUDA-graph capture."""
    text = open(path, errors="replace").read()
    out = {}
    m = re.search(r"Load weight end\. elapsed=([\d.]+) s", text)
    if m:
        out["load_weights_s"] = float(m.group(1))
    for name, secs in re.findall(r"Capture (\S+) CUDA graph end\. elapsed=([\d.]+) s", text):
        out[f"capture_{name}_graph_s"] = float(secs)
    return out


def run_log_times(run_dir: str) -> Dict[str, Any]:
    """Startup milestones from the run's logs: engines up (the fleet's own count), first weight push,
    SGLang's weight load and graph captures."""
    out: Dict[str, Any] = {}
    logs = os.path.join(run_dir, "logs")
    for root, _, files in os.walk(run_dir):
        for f in files:
            if not f.endswith(".log"):
                continue
            text = open(os.path.join(root, f), errors="replace").read()
            m = re.search(r"engine\(s\) up in ([\d.]+)s", text)
            if m:
                out["engines_up_s"] = float(m.group(1))
            m = re.search(r"weights v0 pushed to the engines \(([\d.]+)s", text)
            if m:
                out["first_push_s"] = float(m.group(1))
            if f.startswith("engine_"):
                out.update(sglang_log_times(os.path.join(root, f)))
    out["logs"] = logs
    return out


# ----------------------------------------------------------------------------------- report
def steady(rows: List[Dict[str, Any]], key: str) -> Optional[float]:
    """Median over the steps after the first (warm-up)."""
    vals = [r[key] for r in rows[1:] if key in r] or [r[key] for r in rows if key in r]
    return median(vals)


def summarize_run(res: Dict[str, Any]) -> Dict[str, Any]:
    """Medians after the first step. sync_all: the weight push plus the memory moved before training
    (perf/offload_time), i.e. every offload and onload of the step (issue 10's goal counts them all)."""
    rows = res.get("rows") or []
    s = {k: steady(rows, f"perf/{k}") for k in ("step_time", "rollout_wait_time", "rollout_time", "train_time",
                                                "weight_sync_time", "offload_time", "weight_push_time",
                                                "weight_transfer_time")}
    s["sync_all"] = (s["weight_sync_time"] or 0.0) + (s["offload_time"] or 0.0) \
        if s["weight_sync_time"] is not None else None
    s["logprob_gap_max"] = max((r["train/train_rollout_logprob_abs_diff"] for r in rows
                                if "train/train_rollout_logprob_abs_diff" in r), default=None)
    s["logprob_gap_median"] = steady(rows, "train/train_rollout_logprob_abs_diff")
    gb = steady(rows, "perf/weight_sync_bytes")
    s["sync_gb"] = gb / 1e9 if gb else None
    s["sync_ms_per_gb"] = 1000 * s["sync_all"] / s["sync_gb"] if gb and s["sync_all"] else None
    s["steps"] = len(rows)
    return s


ROW_NAMES = {"sglang": "run.py sglang, no offload", "sglang_offload": "run.py sglang, offload",
             "embedded": "run.py embedded", "trl": "TRL GRPOTrainer (HF generate)"}


def report(results: Dict[str, Any], path: str) -> None:
    with open(path + ".json", "w") as f:
        json.dump(results, f, indent=1, default=str)
    lines = [f"# SGLang on the GPU: {results['layout']}, workload {results.get('workload')} "
             f"({results.get('gpu', '?')})", "",
             "Seconds per GRPO step, medians of the steps after the first. rollout wait: the driver waiting for "
             "the rollout (async: it overlaps training); rollout: the rollout's own time; sync: the weight push "
             "with the memory moved around it, plus what moved before training (offload s); sync ms/GB counts "
             "both; log-prob gap: mean |engine - trainer| per step, the largest step. TRL: rollout = its "
             "generation and scoring, train = the rest of the step, no sync (one model).", "",
             f"{PRESET} shape, random bf16 weights; {PROMPTS} prompts x {SAMPLES} samples x {NEW_TOKENS} new "
             f"tokens a step; `{results.get('cmdline', '')}`", ""]
    raw = results.get("raw", {})
    ref = (raw.get("grpo_step_requests") or {}).get("median_s")
    lines += ["| | startup s | step s | rollout wait s | rollout s | train s | sync s | offload s | sync ms/GB | "
              "log-prob gap (max) | steps |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    if ref:
        lines.append(f"| raw SGLang (same requests) | {raw.get('startup_s', 0):.1f} | | | {ref:.3f} | | | | | | |")

    def cell(v, fmt=".2f"):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    for name in ("sglang", "sglang_offload", "trl", "embedded"):
        res = results.get(name)
        if not res:
            continue
        if not res.get("rows"):
            why = res.get("skipped") or res.get("error") or f"rc {res.get('phase_rc')}"
            lines.append(f"| {ROW_NAMES[name]} | no steps: {str(why)[:80]} | | | | | | | | | |")
            continue
        s = summarize_run(res)
        lines.append(f"| {ROW_NAMES[name]} | {cell(res.get('startup_s'), '.1f')} | {cell(s['step_time'])} | "
                     f"{cell(s['rollout_wait_time'])} | {cell(s['rollout_time'])} | {cell(s['train_time'])} | "
                     f"{cell(s['weight_sync_time'])} | {cell(s['offload_time'])} | "
                     f"{cell(s['sync_ms_per_gb'], '.0f')} | {cell(s['logprob_gap_max'], '.4f')} | {s['steps']} |")
    trl_step = summarize_run(results["trl"])["step_time"] if (results.get("trl") or {}).get("rows") else None
    if trl_step:
        for name in ("sglang", "sglang_offload", "embedded"):
            step = summarize_run(results[name])["step_time"] if (results.get(name) or {}).get("rows") else None
            if step:
                lines.append(f"- {ROW_NAMES[name]}: {trl_step / step:.1f}x as fast as TRL a step")
    for name in ("raw", *RUN_PHASES):
        res = results.get(name) or {}
        times = res.get("server_log_times") or res.get("log_times")
        if times:
            lines.append(f"- {name} startup parts: " + ", ".join(f"{k} {v}" for k, v in times.items() if k != "logs"))
        s = summarize_run(res) if res.get("rows") else {}
        if s.get("weight_push_time") is not None:
            lines.append(f"- {name} sync parts (medians): the push {s['weight_push_time']:.3f} s, of which the "
                         f"weights' transfer {s['weight_transfer_time']:.3f} s (the rest: pause, cache flush, resume, "
                         "version check)")
        if res.get("gpu_idle"):
            lines.append(f"- {name} GPU idle share after step 2: {res['gpu_idle']}")
    if (results.get("trl") or {}).get("config"):
        lines.append(f"- trl: {results['trl'].get('versions')}, {results['trl']['config']}, "
                     f"peak {cell(results['trl'].get('peak_gib'), '.1f')} GiB")
    if results.get("goals"):
        lines += ["", "Goals (issue 10, run.py sglang without offload): " +
                  "; ".join(f"{k}: {v}" for k, v in results["goals"].items())]
    lines += ["", "Checks:"] + [f"- {'PASS' if c['pass'] else 'FAIL'} {k}: {c['detail']}"
                                for k, c in results.get("checks", {}).items()]
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def goals(results: Dict[str, Any]) -> Dict[str, str]:
    raw = (results.get("raw", {}).get("grpo_step_requests") or {}).get("median_s")
    s = summarize_run(results["sglang"]) if results.get("sglang", {}).get("rows") else None
    if not s:
        return {}
    out = {}
    if raw and s["rollout_wait_time"]:
        r = s["rollout_wait_time"] / raw
        out["rollout_vs_raw"] = f"{r:.2f}x ({'met' if r <= GOALS['rollout_vs_raw'] else 'missed'}, goal 1.5x)"
    if s["sync_ms_per_gb"]:
        v = s["sync_ms_per_gb"]
        out["sync_ms_per_gb"] = f"{v:.0f} ({'met' if v <= GOALS['sync_ms_per_gb'] else 'missed'}, goal 50)"
    if s["step_time"]:
        v = s["step_time"]
        out["step_s"] = f"{v:.2f} ({'met' if v <= GOALS['step_s'] else 'missed'}, goal 2.5)"
    return out


# ------------------------------------------------------------------------------------- main
def steps_of(phase: str, args) -> int:
    return {"sglang": args.steps, "sglang_offload": args.offload_steps, "embedded": args.embedded_steps,
            "trl": args.trl_steps}.get(phase, 0)


def child(phase: str, args, limit_s: float) -> Dict[str, Any]:
    """Run one phase in a child process (this file with --phase), within ``limit_s``."""
    res_path = os.path.join(WORK, f"phase_{args.layout}_{phase}.json")
    if os.path.exists(res_path):
        os.remove(res_path)
    cmd = [sys.executable, __file__, "--layout", args.layout, "--workload", args.workload, "--phase", phase,
           "--steps", str(args.steps), "--offload-steps", str(args.offload_steps),
           "--embedded-steps", str(args.embedded_steps), "--trl-steps", str(args.trl_steps),
           "--limit", str(limit_s), *(["--cpu"] if args.cpu else []), "--sglang-overrides", args.sglang_overrides]
    log(f"phase {phase} (at most {limit_s:.0f}s)")
    try:
        rc = subprocess.run(cmd, timeout=limit_s + 30).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    res = json.load(open(res_path)) if os.path.exists(res_path) else {}
    res["phase_rc"] = rc
    return res


def run_phase(args) -> None:
    out: Dict[str, Any] = {}
    res_path = os.path.join(WORK, f"phase_{args.layout}_{args.phase}.json")

    def save():
        with open(res_path, "w") as f:
            json.dump(out, f, default=str)

    stop = threading.Event()

    def autosave():  # what a phase measured survives its being killed
        while not stop.wait(5):
            save()

    threading.Thread(target=autosave, daemon=True).start()
    try:
        if args.phase == "build":
            out.update(build())
        elif args.phase == "raw":
            phase_raw(args.layout, out)
        elif args.phase in RUN_PHASES:
            phase_run(args.layout, args.phase, steps_of(args.phase, args), args.limit - 15, out,
                      args.sglang_overrides if args.phase != "embedded" else "")
        elif args.phase == "trl":
            phase_trl(args.trl_steps, out)
    except BaseException as e:
        out["error"] = repr(e)
        raise
    finally:
        stop.set()
        save()


# phase -> (the least it finishes in, the most it may take), seconds on one H200. Seen there on 2026-12-01:
# build 43 s, raw 145-156 s (SGLang up in 135-156 s), sglang 147-176 s and sglang_offload 120 s (run.py's
# first step after 96-131 s, the final checkpoint 22 s after the last step), trl 45 s, embedded 150 s (2
# steps of 26 s). Three SGLang start-ups do not leave room for the embedded run in one 10-minute call, so it
# runs only when asked for (PHASES=...,embedded).
PLAN = {"build": (20, 90), "raw": (150, 180), "sglang": (150, 230), "sglang_offload": (125, 160),
        "trl": (50, 120), "embedded": (120, 170)}
DEFAULT_PHASES = ("build", "raw", "sglang", "sglang_offload", "trl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", choices=["colocated", "split"], default="colocated")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default=os.environ.get("WORKLOAD", "anchor"),
                    help="anchor: 8 prompts x 8 samples x 256 tokens; 256x256: 32 x 8 x 256 (env WORKLOAD)")
    ap.add_argument("--phases", default=os.environ.get("PHASES", ",".join(DEFAULT_PHASES)),
                    help=f"comma-separated, in this order: {','.join(PHASES)} (env PHASES; build always runs)")
    ap.add_argument("--steps", type=int, default=6, help="steps of the sglang run (no offload)")
    ap.add_argument("--offload-steps", type=int, default=4, help="steps of the sglang run with offload")
    ap.add_argument("--embedded-steps", type=int, default=2)
    ap.add_argument("--trl-steps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BENCH_BUDGET_S", 540)),
                    help="seconds for all phases (env BENCH_BUDGET_S; with the setup, within 9 minutes)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--cpu", action="store_true", help="a dry run of this script on a CPU machine (see above)")
    ap.add_argument("--sglang-overrides", default=os.environ.get("SGLANG_OVERRIDES", ""),
                    help="more run.py overrides for the sglang runs, space-separated (env SGLANG_OVERRIDES)")
    ap.add_argument("--skip-embedded", action="store_true", default=bool(os.environ.get("SKIP_EMBEDDED")),
                    help="no embedded run (env SKIP_EMBEDDED=1)")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cpu:
        dry_run_on_cpu()
    set_workload(args.workload)
    if args.cpu:
        globals()["NEW_TOKENS"] = 16
    os.makedirs(WORK, exist_ok=True)
    if args.phase:
        run_phase(args)
        return
    wanted = {p.strip() for p in args.phases.split(",") if p.strip()} | {"build"}
    unknown = wanted - set(PHASES)
    if unknown:
        ap.error(f"--phases: unknown {sorted(unknown)} (known: {', '.join(PHASES)})")
    if args.layout == "split":
        wanted.discard("sglang_offload")  # nothing takes turns on a GPU of its own
    if args.skip_embedded:
        wanted.discard("embedded")
    phases = [p for p in PHASES if p in wanted]
    t_end = time.perf_counter() + args.budget
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"sglang_gpu_{args.layout}" + ("" if args.workload == "anchor" else
                                                                 f"_{args.workload}"))
    names = ["cpu (dry run)"] if args.cpu else subprocess.run(  # not torch: this process keeps no CUDA context
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.split("\n")
    results: Dict[str, Any] = {"layout": args.layout, "workload": args.workload, "gpu": names[0].strip(),
                               "gpus": len([n for n in names if n]), "cmdline": " ".join(sys.argv)}
    for i, phase in enumerate(phases):
        # what the phases after this one need stays theirs; a phase that cannot get its own need is skipped
        need, cap = PLAN[phase] if not args.cpu else (0, args.budget)  # --cpu: only the budget counts
        if i == len(phases) - 1:
            cap = args.budget  # the last phase may take what is left (a first SGLang start on a fresh machine)
        reserve = 0 if args.cpu else sum(PLAN[p][0] for p in phases[i + 1:])
        limit = min(cap, t_end - time.perf_counter() - reserve)
        if limit < max(need, 30):
            results[phase] = {"skipped": f"{limit:.0f}s left, needs {need}s"}
            check(results, f"phase_{phase}", False, f"no time left ({limit:.0f}s of the {need}s it needs)")
            continue
        results[phase] = child(phase, args, limit)
        results.setdefault("checks", {}).update(results[phase].pop("checks", {}))
        rc = results[phase].get("phase_rc")
        if phase in ("build", "raw") and rc != 0:
            check(results, f"phase_{phase}", False, f"rc {rc}: {results[phase].get('error', 'see the log above')}")
            if phase == "build":
                break
        if phase in RUN_PHASES or phase == "trl":
            res = results[phase]
            s = summarize_run(res) if res.get("rows") else {}
            want = steps_of(phase, args)
            check(results, f"run_{phase}", res.get("returncode") == 0 and s.get("steps") == want,
                  f"rc {res.get('returncode')}, {s.get('steps', 0)}/{want} steps, wall {res.get('wall_s', 0):.0f}s"
                  + (f"; {res['error']}" if res.get("error") else ""))
            reqs = [r["rollout/generate_requests"] for r in res.get("rows") or [] if "rollout/generate_requests" in r]
            if reqs:  # the default generate function sends a group as one batched request
                check(results, f"group_requests_{phase}", all(n == PROMPTS for n in reqs),
                      f"{reqs} generate requests a step for {PROMPTS} groups of {SAMPLES}")
            if s.get("logprob_gap_max") is not None and phase != "trl":
                check(results, f"logprob_gap_{phase}", s["logprob_gap_max"] < 0.05,
                      f"max {s['logprob_gap_max']:.4f}, median {s['logprob_gap_median']:.4f} (bf16 engine, "
                      "fp32 master weights under autocast; limit 0.05)")
        results["goals"] = goals(results)
        report(results, path)
    results["goals"] = goals(results)
    report(results, path)
    print(open(path + ".md").read())
    failed = [k for k, c in results.get("checks", {}).items() if not c["pass"]]
    if failed:
        log(f"FAILED: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
