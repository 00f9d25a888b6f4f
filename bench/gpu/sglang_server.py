"""Raw SGLang, the reference of bench/sglang_gpu.py's ``raw`` phase: the server started from the engine class's
own command line, the GRPO step's requests sent straight to it (no router, no manager), then checks against
that live server: the protocol, weight updates (disk, CUDA IPC, NCCL broadcast) that must change the policy
and restore it exactly, memory release and resume around a push (colocated), a group as one batched
request, aborts. On a CPU (``--cpu``) the embedded engine stands in: it speaks the same protocol."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import statistics
import time
from typing import Any, Dict, Iterator, List, Optional

from gpu.harness import check, log, median
from gpu.workload import Workload

# what conf/rollout/sglang.yaml leaves to the deployment; the bundle (bench/README.md) has no FA3 kernels,
# so attention runs on triton
SERVER_ARGS = {"mem_fraction_static": 0.5, "attention_backend": "triton", "sampling_backend": "pytorch",
               "grammar_backend": "none"}


def sampling_params(seed: int, max_new_tokens: int) -> Dict[str, Any]:
    """The run's sampling parameters (slime_hydra/rollout/sampling.py, rollout=sglang defaults) and a
    sampling seed per sample, as the default generate function sends them."""
    return {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new_tokens,
            "skip_special_tokens": True, "no_stop_trim": True, "spaces_between_special_tokens": False,
            "sampling_seed": seed}


def prompt_ids(w: Workload, n: int) -> List[List[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(w.ckpt)
    with open(w.data) as f:
        rows = [json.loads(next(f))["prompt"] for _ in range(n)]
    return [tok.encode(r, add_special_tokens=False) for r in rows]


async def timed_requests(url: str, prompts: List[List[int]], samples: int, new_tokens: int,
                         extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """All ``len(prompts) x samples`` requests at once, one /generate each (as the rollout sends them);
    ``extra``: more fields of each request's body (e.g. ``lora_path``)."""
    from slime_hydra.rollout.client import GenerateClient

    client = GenerateClient(url, concurrency=len(prompts) * samples, retries=0)
    try:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(client.post("/generate", {
            "input_ids": p, "sampling_params": sampling_params(1000 * i + k, new_tokens), "return_logprob": True,
            **(extra or {})})
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


def checkpoint_weights(ckpt: str, device) -> List:
    """The checkpoint's tensors, each storage once (tied lm_head is the embedding), on ``device``."""
    from safetensors.torch import load_file

    named = {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            named.update(load_file(os.path.join(ckpt, f), device=str(device)))
    return sorted(named.items())


@contextlib.contextmanager
def serving(spec, log_path: str, gpu: int = 0, timeout_s: float = 400,
            out: Optional[Dict[str, Any]] = None) -> Iterator[Dict[str, Any]]:
    """A server of ``spec`` (``slime_hydra.rollout.engines.ServerSpec``) started as the engine actor starts one, with
    its log at ``log_path``, until it answers ``/health_generate``; killed, with its process group, on exit. Yields
    {url, engine, started (``time.time()`` at launch), startup_s}; ``out`` gets its command line before the start,
    and its ``startup_s``."""
    from slime_hydra.rollout.engines import make_engine
    from slime_hydra.utils.proc import free_port, kill_tree, spawn, wait_http

    out = {} if out is None else out
    engine = make_engine(spec)
    port = free_port()
    cmd = engine.command("127.0.0.1", port, gpu, nccl_port=free_port())
    for name in engine.unset_env:
        os.environ.pop(name, None)
    open(log_path, "w").close()
    url = f"http://127.0.0.1:{port}"
    out["command"] = " ".join(cmd[1:])
    t0, started = time.perf_counter(), time.time()
    proc = spawn(cmd, log_path, engine.env())
    try:
        wait_http(url + "/health_generate", proc, timeout_s, log_path)
        out["startup_s"] = time.perf_counter() - t0
        yield {"url": url, "engine": engine, "started": started, "startup_s": out["startup_s"]}
    finally:
        kill_tree(proc)


def phase_raw(w: Workload, layout: str, out: Dict[str, Any]) -> None:
    import httpx
    import torch

    from slime_hydra.rollout.engines import ServerSpec
    from slime_hydra.sync.sender import Endpoint, WeightSender
    from slime_hydra.utils.http import EngineError, control, weight_version

    colocated = layout == "colocated"
    gpus = {"trainer": 0, "engine": 0 if colocated else 1}
    spec = ServerSpec(engine="sglang" if w.device == "cuda" else "embedded", model_path=w.ckpt,
                      tokenizer_path=w.ckpt, dtype="bfloat16", device=w.device, gpus=1, seed=0, memory_saver=colocated,
                      server_args={**SERVER_ARGS, "cuda_graph_max_bs_decode": w.prompts * w.samples,
                                   **({} if colocated else {"disable_prefill_cuda_graph": True})})
    server_log = os.path.join(w.work, f"raw_{layout}_server.log")
    out["server_log"] = server_log
    with serving(spec, server_log, gpus["engine"], 400, out) as srv:
        url = srv["url"]
        with open(server_log, errors="replace") as f:  # the server's parts, from its log's timestamps
            parts = srv["engine"].startup_parts(f.read(), srv["started"], time.time())
        out["server_log_times"] = {**sglang_log_times(server_log), **parts}
        log(f"raw {spec.engine} up in {out['startup_s']:.1f}s: {out['server_log_times']}")

        # the reference: the GRPO step's requests, then 256 x 256
        prompts = prompt_ids(w, 256)
        step = prompts[:w.prompts]
        asyncio.run(timed_requests(url, step, w.samples, w.new_tokens))  # warm-up
        runs = [asyncio.run(timed_requests(url, step, w.samples, w.new_tokens)) for _ in range(3)]
        out["grpo_step_requests"] = {"requests": w.prompts * w.samples, "new_tokens": w.new_tokens,
                                     "seconds": [r["seconds"] for r in runs], "tokens": runs[-1]["tokens"],
                                     "median_s": median([r["seconds"] for r in runs])}
        log(f"raw SGLang, {w.prompts}x{w.samples}x{w.new_tokens}: {out['grpo_step_requests']['seconds']}")

        # checks against the live server
        info = httpx.get(url + "/model_info").json()
        old = httpx.get(url + "/get_weight_version")
        check(out, "protocol", info.get("weight_version") == "default" and old.status_code == 404,
              f"/model_info weight_version={info.get('weight_version')!r}, /get_weight_version -> {old.status_code}")
        probe = prompts[:4]
        control(url, "/flush_cache")  # the answers below and after each push: computed from scratch alike
        base = greedy(url, probe)
        device = torch.device("cuda", gpus["trainer"]) if w.device == "cuda" else torch.device("cpu")
        w1 = checkpoint_weights(w.ckpt, device)
        sharp = [(n, t * 20 if n == "model.embed_tokens.weight" else t) for n, t in w1]  # a peaked policy
        # the transports of the layout: CUDA IPC on one GPU, NCCL broadcast across two; disk in both
        pushes = [("disk", sharp, 1), ("tensor" if colocated else "distributed", w1, 2)]
        for kind, named, version in pushes:
            sender = WeightSender(kind, [Endpoint(url, 1)], device, 512, os.path.join(w.work, f"disk_{layout}"),
                                  w.ckpt)
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
                sender = WeightSender("tensor", [Endpoint(url, 1)], device, 512, w.work, w.ckpt)
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
        check_batched(w, url, out)
        check_aborts(w, url, out)


def check_batched(w: Workload, url: str, out: Dict[str, Any]) -> None:
    """One group as one /generate (SGLang's batched form, as the rollout sends a group): a list of
    ``input_ids``, one ``sampling_params`` and one ``rid`` per sample; the answer is a list in the same
    order, each sample under its own rid."""
    import httpx

    ids = prompt_ids(w, 1)[0]
    rids = [f"bench-group-{k}" for k in range(w.samples)]
    body = {"input_ids": [ids] * w.samples, "rid": rids, "return_logprob": True,
            "sampling_params": [{**sampling_params(k, 32), "ignore_eos": True} for k in range(w.samples)]}
    try:
        t = time.perf_counter()
        r = httpx.post(url + "/generate", json=body, timeout=120)
        batched_s = time.perf_counter() - t
        r.raise_for_status()
        outs = r.json()
        got = [o["meta_info"]["id"] for o in outs] if isinstance(outs, list) else outs
        lens = [len(o["meta_info"]["output_token_logprobs"]) for o in outs] if isinstance(outs, list) else []
        check(out, "batched_generate", got == rids and lens == [32] * w.samples,
              f"{w.samples} samples in one request: {batched_s:.3f}s; ids in order: {got == rids}; tokens {lens}")
    except (httpx.HTTPError, KeyError, TypeError) as e:
        check(out, "batched_generate", False, repr(e))


def check_aborts(w: Workload, url: str, out: Dict[str, Any]) -> None:
    """abort_all while 16 long requests run, then one request aborted by its rid."""
    import concurrent.futures

    import httpx

    from slime_hydra.utils.http import control

    long_tokens = 4096 if w.device == "cuda" else 2000  # long enough to be running when aborted
    long = {"temperature": 1.0, "max_new_tokens": long_tokens, "ignore_eos": True}
    ids = prompt_ids(w, 1)[0]

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
        check(out, "abort_all", all(k == "abort" for k in kinds) and max(lens) < long_tokens,
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



def sglang_log_times(path: str) -> Dict[str, float]:
    """SGLang's own timings in a server log: weight load, each CUDA-graph capture."""
    text = open(path, errors="replace").read()
    out = {}
    m = re.search(r"Load weight end\. elapsed=([\d.]+) s", text)
    if m:
        out["load_weights_s"] = float(m.group(1))
    for name, secs in re.findall(r"Capture ([\w ]+?) CUDA graph end\. elapsed=([\d.]+) s", text):
        out[f"capture_{name.replace(' ', '_')}_graph_s"] = float(secs)  # sglang 0.5.17: "target decode"
    return out


# sglang 0.5.17's lines for each prefill batch and every 40th decode batch (decode_log_interval), stamped in local time
BATCH_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(\.\d+)?\] (?:Prefill batch.*?#new-seq: (\d+)|"
                        r"Decode batch.*?#running-req: (\d+).*?gen throughput \(token/s\): ([\d.]+))")


def sglang_batches(path: str) -> List[Dict[str, Any]]:
    """SGLang's batches in a server log: each prefill (its new sequences) and each decode line (the sequences
    running, the tokens a second since the line before), with the wall time of the line."""
    out = []
    for line in open(path, errors="replace"):
        m = BATCH_LINE.match(line)
        if not m:
            continue
        stamp = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + float(m.group(2) or 0)
        if m.group(3) is not None:
            out.append({"t": stamp, "prefill_seqs": int(m.group(3))})
        else:
            out.append({"t": stamp, "decode_running": int(m.group(4)), "tokens_per_s": float(m.group(5))})
    return out
