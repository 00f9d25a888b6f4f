"""LoRA's weight push: the merged weights against the adapter through SGLang's LoRA endpoints (issue 23).

    bash bench/lora_push_gpu.sh          # one H200, one call (set-up: bench/README.md, peft's wheel in .gpu-extra)

The torch backend pushes LoRA runs' weights merged (``trainer.lora.push=merged``: ``W + (alpha/r) B A`` per
layer as the weights stream out, then SGLang's ``/update_weights_from_tensor``). SGLang 0.5.17 can instead
serve the adapter beside the base weights (``--enable-lora``) and take a new one each step:
``/unload_lora_adapter`` then ``/load_lora_adapter_from_tensors`` (the tensors as one flattened bucket over
CUDA IPC, as a weight push sends them) or ``/load_lora_adapter`` (PEFT's files on disk), requests naming it
(``lora_path``). This measures both, on the Qwen3-4B shape (random bf16 weights, bench/gpu/workload.py).

Phases (each a child process with its own time limit: bench/gpu/harness.py):
  build  the checkpoint (kept from an earlier call while the machine is warm: bench/lora_gpu.sh builds the
         same one) and its prompts.
  lora   one SGLang server with LoRA on (``--enable-lora --max-lora-rank <largest rank> --lora-target-modules
         <the family's defaults, train/backends/torch/lora.py> --max-loras-per-batch 2``) and the memory saver,
         as a colocated run would start it. The trainer's side in this process, on the same GPU: the
         checkpoint wrapped by ``lora.wrap`` as the torch backend wraps it, B made non-zero. For each rank
         (16 and 64):
           push     3 steps a route, the adapter changed each step; each step as a run would push it: the
                    trainer's tensors to a request body (or files), unload the last adapter, load the new one,
                    set the weight version, one request served with it (the engine moves the adapter to the
                    GPU on its first use). Routes: from tensors in bf16 (the engine's dtype) and in fp32 (the
                    trainer's), from /dev/shm. Then the merged push (``lora.merged_weights`` through
                    ``WeightSender``, as run.py pushes) on the same server.
           rollout  8 prompts x 8 samples x 256 new tokens at temperature 1 (one /generate a sample, as the
                    rollout sends them): the base model against the adapter, 2 timed runs each after a warm-up.
           agree    teacher-forced log-probs of 4 prompts with 16 more tokens: the adapter (from tensors, from
                    disk) against the merged weights pushed to the same server, and against the base (the
                    adapter's own effect); greedy answers. The base weights are pushed back after.
         Then the memory saver with an adapter loaded: release everything, resume the weights, push the
         adapter, resume the cache (the colocated order): the adapter's log-probs must not move.
  plain  the same server without ``--enable-lora`` (what the merged route runs on): the rollout and the
         merged push of rank 16's adapter (the same values), its log-probs against the LoRA server's.

Writes ``$OUT/lora_push_gpu.{json,md}`` after each phase, each phase's results as it goes to
``$OUT/logs/lora_push_<phase>.json``, the servers' log tails to ``$OUT/logs/``; exits non-zero when a check
failed or a phase did not finish.

``--cpu``: this script's own code on a CPU without SGLang: the tiny model, the embedded engine (SGLang's
protocol, no LoRA endpoints) takes the merged pushes and the base rollout; the adapter's request bodies are
built and read back as SGLang reads them, its /dev/shm files loaded by PEFT, and the PEFT model itself
stands for SGLang's LoRA serving in the agreement check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from gpu import harness as h  # noqa: E402 - bench/ is on the path from here
from gpu.sglang_server import SERVER_ARGS, prompt_ids, sglang_log_times, timed_requests  # noqa: E402
from gpu.workload import Workload  # noqa: E402

NAME = "policy"  # the adapter's name on the engine (requests send it as lora_path)
ROUTES = ("tensors_bf16", "tensors_fp32", "disk")
STEPS = 3  # pushes a route, each a new adapter
ROLLOUTS = 2  # timed rollouts a mode, after one warm-up
B_STD = 0.02  # B's init (PEFT starts it at zero: no effect to compare); each step scales it by 1 + 0.1 step
SEED = 0
# phase -> (the least it finishes in, the most it may take), seconds on one H200: a SGLang start took
# 96-181 s in bench/sglang_gpu.py's calls (the first of a call the slowest), the 4B build is GPU init and an
# 8 GB write
PLAN = {"build": (30, 150), "lora": (230, 340), "plain": (120, 200)}
PHASES = ("build", "lora", "plain")


def workload(cpu: bool) -> Workload:
    if cpu:  # the tiny model's context is short
        return Workload("/tmp/lorapush_cpu", "tiny", 4, 4, 8, prompt_words=8, words=20, device="cpu")
    return Workload("/tmp/lorabench", "qwen3_4b", 8, 8, 256)  # bench/lora_gpu.py's checkpoint folder


# ------------------------------------------------------------------------------- the trainer's side
def trainer_model(w: Workload, device):
    """The checkpoint as the torch backend holds it under LoRA: the base in bf16 on GPUs (the model's
    dtype on CPU), no gradients."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(w.ckpt, dtype=dtype, device_map=str(device))
    except (ImportError, ValueError):  # no accelerate: load on the host, then move
        model = AutoModelForCausalLM.from_pretrained(w.ckpt, dtype=dtype).to(device)
    model.requires_grad_(False)
    return model.eval()


class Adapter:
    """A PEFT adapter of ``rank`` on ``model`` (``lora.wrap``: the family's target modules, alpha 32 as
    ``trainer.lora``'s default), A as PEFT draws it and B non-zero (seeded: the plain phase makes the same
    values again); ``step(k)`` stands for k training steps: B = B0 (1 + 0.1 k)."""

    def __init__(self, model, rank: int, arch_type: str):
        import torch

        from slime_hydra.config.schema import LoraConfig
        from slime_hydra.train.backends.torch import lora

        self.rank, self.arch_type = rank, arch_type
        self.cfg = LoraConfig(rank=rank)
        torch.manual_seed(SEED + rank)
        self.peft = lora.wrap(model, self.cfg, arch_type)
        gen = torch.Generator(device=model.device).manual_seed(SEED + rank)
        self.b0 = {}
        for name, layer in lora.lora_layers(self.peft).items():
            b = layer.lora_B[lora.ADAPTER].weight
            b.data.normal_(0.0, B_STD, generator=gen)
            self.b0[name] = b.detach().clone()
        self.k = 0

    def step(self, k: int) -> None:
        from slime_hydra.train.backends.torch import lora

        for name, layer in lora.lora_layers(self.peft).items():
            layer.lora_B[lora.ADAPTER].weight.data.copy_(self.b0[name] * (1 + 0.1 * k))
        self.k = k

    def config_dict(self) -> Dict[str, Any]:
        """adapter_config.json's content (what PEFT's save_pretrained writes), for the from-tensors body."""
        from slime_hydra.train.backends.torch import lora

        raw = self.peft.peft_config[lora.ADAPTER].to_dict()
        return json.loads(json.dumps(raw, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o)))

    def tensors(self, dtype) -> List[Tuple[str, Any]]:
        """The adapter's tensors under the names PEFT saves them (``...q_proj.lora_A.weight``), in ``dtype``."""
        from peft import get_peft_model_state_dict

        return [(n, t.detach().to(dtype)) for n, t in get_peft_model_state_dict(self.peft).items()]

    def save(self, out_dir: str) -> None:
        """The adapter's files as a run's checkpoint writes them (``lora.save_adapter``)."""
        from slime_hydra.train.backends.torch import lora

        lora.save_adapter(self.peft, out_dir, lora.adapter_state(self.peft, lambda t: t))

    def merged(self):
        """(name, tensor) as the torch backend pushes a LoRA run's weights (``_named_weights``)."""
        from slime_hydra.train.backends.torch import fsdp, lora

        # the base is in the backend's compute dtype already: merged weights come back in it
        yield from lora.merged_weights(self.peft, fsdp.unique_state(lora.hf_model(self.peft)), lambda x: x.detach())

    def base(self):
        """The base weights under the engine's names (the adapter left out): what restores the engine."""
        from slime_hydra.train.backends.torch import fsdp, lora

        for name, t in fsdp.unique_state(lora.hf_model(self.peft)):
            if ".lora_" not in name:
                yield lora.hf_name(name), t.detach()

    def remove(self):
        """The base model back, without the adapter's layers (nothing merged)."""
        return self.peft.unload()


# --------------------------------------------------------------------------------- request bodies
def tensors_body(adapter: Adapter, dtype, device, config: Dict[str, Any]) -> Tuple[Dict[str, Any], Any, int]:
    """/load_lora_adapter_from_tensors' body: the tensors as one flattened bucket (its handle: CUDA IPC on a
    GPU), one copy for the engine's one rank; and the bucket (kept until the engine has copied it)."""
    import torch

    from slime_hydra.sync import transport

    named = adapter.tensors(dtype)
    payload = transport.flattened_bucket(named, device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    body = {"lora_name": NAME, "config_dict": config, "serialized_named_tensors": [transport.serialize(payload)],
            "load_format": "flattened_bucket", "pinned": False}
    return body, payload, sum(t.numel() * t.element_size() for _, t in named)


def read_tensors_body(body: Dict[str, Any], adapter: Adapter, dtype) -> Dict[str, Any]:
    """The body read back as SGLang's TpWorker reads it (deserialize, rebuild the bucket's tensors) and its
    names as SGLang's LoRAAdapter files them (a layer index each, a target module each): what --cpu checks
    in place of the endpoint."""
    import torch

    from slime_hydra.sync import transport

    data = transport.deserialize(body["serialized_named_tensors"][0])
    got = dict(transport.unflatten(data["flattened_tensor"], data["metadata"]))
    want = dict(adapter.tensors(dtype))
    targets = set(body["config_dict"]["target_modules"])
    unplaced = [n for n in got if not any(f".{m}.lora_" in n for m in targets) or ".layers." not in n]
    same = got.keys() == want.keys() and all(torch.equal(got[n].cpu(), want[n].cpu()) for n in want)
    return {"tensors": len(got), "equal": same, "unplaced": unplaced[:5],
            "config": {k: body["config_dict"].get(k) for k in ("peft_type", "r", "lora_alpha")}}


def score_body(seqs: List[List[int]], lora: Optional[str]) -> Dict[str, Any]:
    """One /generate for teacher-forced log-probs of every token of ``seqs`` (the first has none)."""
    body = {"input_ids": seqs, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 1}}
    return {**body, "lora_path": lora} if lora else body


def greedy_body(prompts: List[List[int]], lora: Optional[str], new_tokens: int = 16) -> Dict[str, Any]:
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    return {**body, "lora_path": lora} if lora else body


def score(url: str, seqs: List[List[int]], lora: Optional[str] = None) -> List[List[float]]:
    from slime_hydra.utils.http import control

    outs = control(url, "/generate", score_body(seqs, lora), timeout=120)
    return [[lp for lp, *_ in o["meta_info"]["input_token_logprobs"] if lp is not None] for o in outs]


def greedy(url: str, prompts: List[List[int]], lora: Optional[str] = None) -> List[List[int]]:
    from slime_hydra.utils.http import control

    return [o["output_ids"] for o in control(url, "/generate", greedy_body(prompts, lora), timeout=120)]


def hf_score(model, seqs: List[List[int]]) -> List[List[float]]:
    """What ``score`` gets from a server, from a model in this process (--cpu)."""
    import torch

    out = []
    with torch.no_grad():
        for ids in seqs:
            x = torch.tensor([ids], device=model.device)
            lp = model(input_ids=x).logits[0].float().log_softmax(-1)
            out.append(lp[:-1].gather(-1, x[0, 1:, None])[:, 0].tolist())
    return out


def gap(a: List[List[float]], b: List[List[float]]) -> Dict[str, float]:
    d = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return {"max": max(d), "mean": sum(d) / len(d), "tokens": len(d)}


# ------------------------------------------------------------------------------------ the server
class Server:
    """One engine server on GPU 0 (SGLang; on --cpu the embedded engine), started from the engine
    class's own command line (``--enable-memory-saver`` as colocated runs start it)."""

    def __init__(self, w: Workload, name: str, server_args: Dict[str, Any], timeout_s: float):
        from slime_hydra.rollout.engines import ServerSpec, make_engine
        from slime_hydra.utils.proc import free_port, spawn, wait_http

        cpu = w.device == "cpu"
        spec = ServerSpec(engine="embedded" if cpu else "sglang", model_path=w.ckpt, tokenizer_path=w.ckpt,
                          dtype="bfloat16", device=w.device, gpus=1, seed=0, memory_saver=not cpu,
                          server_args={} if cpu else server_args)
        engine = make_engine(spec)
        port = free_port()
        self.cmd = engine.command("127.0.0.1", port, 0, nccl_port=free_port())
        for var in engine.unset_env:
            os.environ.pop(var, None)
        self.log = os.path.join(w.work, f"{name}_server.log")
        open(self.log, "w").close()
        self.url = f"http://127.0.0.1:{port}"
        t0 = time.perf_counter()
        self.proc = spawn(self.cmd, self.log, engine.env())
        try:
            wait_http(self.url + "/health_generate", self.proc, timeout_s, self.log)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0

    def stop(self) -> None:
        from slime_hydra.utils.proc import kill_tree

        kill_tree(self.proc)


def merged_push(url: str, adapter: Adapter, device, version: int, w: Workload, weights=None) -> Dict[str, float]:
    """The merged route: ``WeightSender`` over CUDA IPC (shared memory on CPU), as run.py pushes (the
    merge computed as the weights stream out, in the push's time); ``weights``: other tensors (the base)."""
    import torch

    from slime_hydra.config.schema import SyncConfig
    from slime_hydra.sync.sender import Endpoint, WeightSender

    sender = WeightSender("tensor", [Endpoint(url, 1)], device, SyncConfig().bucket_mb, os.path.join(w.work, "disk"),
                          w.ckpt)
    try:
        sender.connect()
        with torch.no_grad():
            return sender.push(adapter.merged() if weights is None else weights, version)
    finally:
        sender.close()


def adapter_push(url: Optional[str], route: str, adapter: Adapter, device, loaded: bool, version: int,
                 config: Dict[str, Any], shm: str, serve: bool = True) -> Dict[str, Any]:
    """One step of the adapter route, timed by part: the trainer's tensors to a body (or to files), the
    last adapter unloaded, the new one loaded, the weight version set, one request served with it (not
    with ``serve`` false: the cache is released then). On --cpu (``url`` None) the body is read back and
    the files loaded by PEFT instead."""
    import torch

    from slime_hydra.utils.http import control

    out: Dict[str, Any] = {}
    t0 = time.perf_counter()
    if route == "disk":
        path = os.path.join(shm, f"{NAME}_v{version}")
        shutil.rmtree(path, ignore_errors=True)
        adapter.save(path)
        body = {"lora_name": NAME, "lora_path": path, "pinned": False}
        out["bytes"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        payload = None
    else:
        dtype = torch.bfloat16 if route == "tensors_bf16" else torch.float32
        body, payload, out["bytes"] = tensors_body(adapter, dtype, device, config)
    t1 = time.perf_counter()
    out["prep_s"] = t1 - t0
    if url is None:  # --cpu: what the engine would read
        if route == "disk":
            out["read_back"] = read_saved(path, adapter)
        else:
            out["read_back"] = read_tensors_body(body, adapter, dtype)
        shutil.rmtree(os.path.join(shm, f"{NAME}_v{version - 1}"), ignore_errors=True)
        return out
    if loaded:
        control(url, "/unload_lora_adapter", {"lora_name": NAME})
    t2 = time.perf_counter()
    control(url, "/load_lora_adapter" if route == "disk" else "/load_lora_adapter_from_tensors", body)
    t3 = time.perf_counter()
    del payload  # the engine copied the tensors to its host memory before it answered
    if device.type == "cuda":
        torch.cuda.ipc_collect()
    control(url, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
    t4 = time.perf_counter()
    if serve:
        control(url, "/generate", {"input_ids": [2, 3, 4, 5], "lora_path": NAME,
                                   "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    t5 = time.perf_counter()
    out.update(unload_s=t2 - t1, load_s=t3 - t2, version_s=t4 - t3, first_request_s=t5 - t4, total_s=t5 - t0)
    if route == "disk":
        shutil.rmtree(os.path.join(shm, f"{NAME}_v{version - 1}"), ignore_errors=True)
    return out


def read_saved(path: str, adapter: Adapter) -> Dict[str, Any]:
    """The /dev/shm files loaded as PEFT loads a run's adapter, their tensors against the live adapter's."""
    import torch
    from peft.utils import load_peft_weights

    got = load_peft_weights(path, device="cpu")
    want = {n: t.cpu() for n, t in adapter.tensors(torch.float32)}
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    return {"tensors": len(got), "equal": got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want),
            "config": {k: cfg.get(k) for k in ("peft_type", "r", "lora_alpha")}}


def medians(steps: List[Dict[str, Any]]) -> Dict[str, Any]:
    keys = [k for k in steps[0] if isinstance(steps[0][k], (int, float))] if steps else []
    return {k: h.median([s[k] for s in steps]) for k in keys}


def rollout(url: str, w: Workload, prompts: List[List[int]], lora: Optional[str]) -> Dict[str, Any]:
    """One warm-up, then ``ROLLOUTS`` timed runs of the step's requests."""
    extra = {"lora_path": lora} if lora else None
    asyncio.run(timed_requests(url, prompts, w.samples, w.new_tokens, extra))
    runs = [asyncio.run(timed_requests(url, prompts, w.samples, w.new_tokens, extra)) for _ in range(ROLLOUTS)]
    return {"seconds": [r["seconds"] for r in runs], "tokens": runs[-1]["tokens"],
            "median_s": h.median([r["seconds"] for r in runs]),
            "tokens_per_s": h.median([r["tokens_per_s"] for r in runs])}


# ------------------------------------------------------------------------------------- phases
def lora_server_args(w: Workload, ranks: List[int]) -> Dict[str, Any]:
    from gpu.workload import arch_of

    from slime_hydra.train.backends.torch.lora import LORA_TARGET_MODULES

    return {**SERVER_ARGS, "cuda_graph_max_bs_decode": w.prompts * w.samples, "enable_lora": True,
            "max_lora_rank": max(ranks), "lora_target_modules": LORA_TARGET_MODULES[arch_of(w.preset).type],
            "max_loras_per_batch": 2, "lora_backend": "csgmv"}


def probe_seqs(w: Workload, prompts: List[List[int]]) -> List[List[int]]:
    """4 prompts, each with 16 more tokens of the prompts' words: what the log-probs are taken of."""
    import random

    rng = random.Random(SEED)
    return [p + [2 + rng.randrange(w.words) for _ in range(16)] for p in prompts[:4]]


def attempt(res: Dict[str, Any], key: str, fn):
    """``res[key] = fn()``, or the error there: one failed measurement must not cost the others."""
    try:
        res[key] = fn()
    except Exception as e:  # noqa: BLE001 - recorded, reported, checked
        h.log(f"{key} failed: {e!r}")
        res[key] = {"error": repr(e)[:2000]}
    return res[key]


def phase_lora(w: Workload, ranks: List[int], limit_s: float, out: Dict[str, Any]) -> None:
    import torch
    from gpu.workload import arch_of

    t_end = time.perf_counter() + limit_s - 10
    cpu = w.device == "cpu"
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    args = lora_server_args(w, ranks)
    out["server_args"] = args
    server = Server(w, "lora", args, max(60.0, t_end - time.perf_counter() - 40))
    url = None if cpu else server.url  # --cpu: no LoRA endpoints to call
    out.update(command=" ".join(server.cmd[1:]), startup_s=server.startup_s, server_log=server.log)
    h.log(f"LoRA server up in {server.startup_s:.1f}s")
    try:
        out["server_log_times"] = sglang_log_times(server.log)
        t = time.perf_counter()
        model = trainer_model(w, device)
        out["trainer_load_s"] = time.perf_counter() - t
        arch_type = arch_of(w.preset).type
        prompts = prompt_ids(w, w.prompts)
        seqs = probe_seqs(w, prompts)
        shm = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else w.work, "lorapush")
        os.makedirs(shm, exist_ok=True)
        scores: Dict[str, Any] = out.setdefault("scores", {})
        scores["base"] = None if cpu else score(url, seqs)
        state = {"version": 0, "loaded": False}
        for i, rank in enumerate(ranks):
            if time.perf_counter() > t_end - 45:
                out.setdefault("skipped", []).append(f"rank {rank}: {t_end - time.perf_counter():.0f}s left")
                continue
            ad = Adapter(model, rank, arch_type)
            res: Dict[str, Any] = out.setdefault("ranks", {}).setdefault(str(rank), {})
            with torch.no_grad():
                measure_rank(w, url, server.url, ad, device, state, res, scores.setdefault(str(rank), {}),
                             prompts, seqs, shm, base_rollout=i == 0)
            if i == len(ranks) - 1 and not cpu and state["loaded"] and time.perf_counter() < t_end - 15:
                attempt(out, "memory_saver", lambda ad=ad: memory_saver_check(url, ad, device, state, shm, seqs))
            if cpu:
                with ad.peft.disable_adapter():
                    scores["base"] = scores["base"] or hf_score(ad.peft, seqs)
            model = ad.remove()
    finally:
        server.stop()


def measure_rank(w: Workload, url: Optional[str], server_url: str, ad: Adapter, device, state: Dict[str, Any],
                 res: Dict[str, Any], sc: Dict[str, Any], prompts: List[List[int]], seqs: List[List[int]], shm: str,
                 base_rollout: bool) -> None:
    """Everything the lora phase measures for one adapter (see the module's docstring)."""
    import torch

    from slime_hydra.utils.http import EngineError, control

    cpu = url is None
    config = ad.config_dict()
    res["adapter_mb"] = sum(t.numel() * t.element_size() for _, t in ad.tensors(torch.float32)) / 2**20
    h.log(f"rank {ad.rank}: {res['adapter_mb']:.0f} MiB of adapter (fp32), targets {config.get('target_modules')}")
    for route in ROUTES:
        steps: List[Dict[str, Any]] = []
        try:
            for k in range(1, STEPS + 1):
                ad.step(k)
                state["version"] += 1
                steps.append(adapter_push(url, route, ad, device, state["loaded"], state["version"], config, shm))
                state["loaded"] = not cpu
        except Exception as e:  # noqa: BLE001 - the next route may work
            h.log(f"rank {ad.rank} {route} failed: {e!r}")
            res.setdefault("errors", {})[route] = repr(e)[:2000]
            try:  # what the engine holds is unknown now: nothing
                control(url, "/unload_lora_adapter", {"lora_name": NAME})
            except (EngineError, TypeError, AttributeError):
                pass
            state["loaded"] = False
        res.setdefault("push", {})[route] = {"steps": steps, "median": medians(steps)}
        h.log(f"rank {ad.rank} {route}: {res['push'][route]['median']}")
        if not cpu and len(steps) == STEPS and route in ("tensors_bf16", "disk"):  # step STEPS's adapter, both ways
            attempt(sc, route, lambda: score(url, seqs, NAME))
    if cpu:
        res["rollout"] = {"base": rollout(server_url, w, prompts, None)}
        sc["tensors_bf16"] = hf_score(ad.peft, seqs)  # PEFT's own forward stands for SGLang's LoRA serving
    elif state["loaded"]:
        t = time.perf_counter()
        control(url, "/generate", {"input_ids": [2, 3, 4, 5], "lora_path": NAME,
                                   "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        res["warm_request_s"] = time.perf_counter() - t
        attempt(res, "greedy_adapter", lambda: greedy(url, seqs, NAME))
        ro = res.setdefault("rollout", {})
        if base_rollout:
            attempt(ro, "base", lambda: rollout(url, w, prompts, None))
        attempt(ro, "adapter", lambda: rollout(url, w, prompts, NAME))
        h.log(f"rank {ad.rank} rollout: {ro}")
    ad.step(STEPS)  # the merged route: the same adapter (step STEPS's), on the same server

    def merged_pushes() -> Dict[str, Any]:
        pushes = []
        for _ in range(2):
            state["version"] += 1
            pushes.append(merged_push(server_url, ad, device, state["version"], w))
        return {"pushes": pushes, "median": medians(pushes)}
    attempt(res, "merged_push", merged_pushes)
    h.log(f"rank {ad.rank} merged push: {res['merged_push']}")
    if cpu:
        sc["merged"] = hf_score(merged_model(w, ad, device), seqs)
        return
    attempt(sc, "merged", lambda: score(url, seqs))
    attempt(res, "greedy_merged", lambda: greedy(url, seqs))
    state["version"] += 1
    attempt(res, "base_push", lambda: merged_push(url, ad, device, state["version"], w, weights=ad.base()))
    attempt(sc, "base_again", lambda: score(url, seqs))


def merged_model(w: Workload, adapter: Adapter, device):
    """--cpu: a model holding the merged weights, as the engine holds them after the merged push."""
    m = trainer_model(w, device)
    missing = m.load_state_dict(dict(adapter.merged()), strict=False).missing_keys
    if any(not k.startswith("lm_head") for k in missing):
        raise RuntimeError(f"the merged weights miss {missing[:5]}")
    return m


def memory_saver_check(url: str, ad: Adapter, device, state: Dict[str, Any], shm: str,
                       seqs: List[List[int]]) -> Dict[str, Any]:
    """A colocated step's order with the adapter route: release everything, resume the weights, push the
    adapter (the same values again), resume the cache; the adapter's log-probs before and after."""
    import torch

    from slime_hydra.utils.http import control

    before = score(url, seqs, NAME)
    t = time.perf_counter()
    control(url, "/flush_cache")
    control(url, "/release_memory_occupation", {"tags": None})
    control(url, "/resume_memory_occupation", {"tags": ["weights"]})
    state["version"] += 1
    with torch.no_grad():
        push = adapter_push(url, "tensors_bf16", ad, device, state["loaded"], state["version"], ad.config_dict(),
                            shm, serve=False)
    control(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    dt = time.perf_counter() - t
    after = score(url, seqs, NAME)
    return {"release_push_resume_s": dt, "push": push, "gap": gap(before, after)}


def phase_plain(w: Workload, rank: int, limit_s: float, out: Dict[str, Any]) -> None:
    """The server the merged route runs on: no --enable-lora."""
    import torch
    from gpu.workload import arch_of

    cpu = w.device == "cpu"
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    args = {**SERVER_ARGS, "cuda_graph_max_bs_decode": w.prompts * w.samples}
    server = Server(w, "plain", args, max(60.0, limit_s - 25))  # then the rollout first: the baseline
    out.update(command=" ".join(server.cmd[1:]), startup_s=server.startup_s, server_log=server.log)
    h.log(f"plain server up in {server.startup_s:.1f}s")
    try:
        out["server_log_times"] = sglang_log_times(server.log)
        prompts = prompt_ids(w, w.prompts)
        seqs = probe_seqs(w, prompts)
        out["rollout"] = rollout(server.url, w, prompts, None)
        h.log(f"plain rollout: {out['rollout']['median_s']:.3f}s")
        ad = Adapter(trainer_model(w, device), rank, arch_of(w.preset).type)
        ad.step(STEPS)
        pushes = [merged_push(server.url, ad, device, v, w) for v in (1, 2, 3)]
        out["merged_push"] = {"rank": rank, "pushes": pushes, "median": medians(pushes)}
        h.log(f"plain merged push: {out['merged_push']['median']}")
        out["scores"] = {"merged": hf_score(merged_model(w, ad, device), seqs) if cpu else score(server.url, seqs)}
    finally:
        server.stop()


def run_phase(args, w: Workload, ranks: List[int]) -> None:
    """One phase, in the child process that ``run_child`` started."""
    path = phase_path(args.out, args.phase) if args.phase != "build" else os.path.join(w.work, "phase_build.json")
    with h.phase_output(path) as out:
        if args.phase == "build":
            t0 = time.perf_counter()
            build(w)
            out["build_s"] = time.perf_counter() - t0
        elif args.phase == "lora":
            phase_lora(w, ranks, args.limit, out)
        elif args.phase == "plain":
            phase_plain(w, ranks[0], args.limit, out)


def build(w: Workload) -> None:
    """The checkpoint, initialised on the GPU (seconds for 4B parameters, minutes on a CPU; kept if there),
    and the prompts."""
    from gpu.workload import build_checkpoint, write_prompts

    os.makedirs(w.work, exist_ok=True)
    build_checkpoint(w.ckpt, w.preset, device=w.device, reuse=True)
    if not os.path.exists(w.data):
        write_prompts(w.data, 64, w.prompt_words, w.words)


def phase_path(out_dir: str, phase: str) -> str:
    return os.path.join(out_dir, "logs", f"lora_push_{phase}.json")


# ------------------------------------------------------------------------------------- report
def derive(results: Dict[str, Any], ranks: List[int], cpu: bool) -> None:
    """The checks and the comparisons across phases, from what the phases saved."""
    lo, pl = results.get("lora") or {}, results.get("plain") or {}
    scores, plain_scores = lo.get("scores") or {}, pl.get("scores") or {}
    comp = results.setdefault("agreement", {})
    for rank in ranks if "lora" in results else []:  # (not before the lora phase has run or been skipped)
        r, sc = (lo.get("ranks") or {}).get(str(rank)), scores.get(str(rank)) or {}
        if not r:
            h.check(results, f"rank_{rank}", False, f"not measured ({lo.get('skipped') or lo.get('error')})")
            continue
        for route in ROUTES:
            p = (r.get("push") or {}).get(route)
            ok = bool(p) and len(p["steps"]) == STEPS
            if cpu and ok:
                ok = all(s["read_back"]["equal"] and not s["read_back"].get("unplaced") for s in p["steps"])
            h.check(results, f"push_{route}_r{rank}", ok, f"{len(p['steps']) if p else 0}/{STEPS} steps; medians "
                    f"{ {k: round(v, 4) for k, v in p['median'].items()} if p else '-'}")
        c: Dict[str, Any] = {}
        if sc.get("tensors_bf16") and sc.get("merged") and scores.get("base"):
            c["adapter_vs_merged"] = gap(sc["tensors_bf16"], sc["merged"])
            c["adapter_vs_base"] = gap(sc["tensors_bf16"], scores["base"])
            effect, diff = c["adapter_vs_base"]["mean"], c["adapter_vs_merged"]["mean"]
            h.check(results, f"adapter_equals_merged_r{rank}", effect > 1e-3 and diff <= 0.2 * effect,
                    f"mean |adapter - merged| {diff:.4f} (max {c['adapter_vs_merged']['max']:.4f}) against the "
                    f"adapter's own effect, mean |adapter - base| {effect:.4f} (max {c['adapter_vs_base']['max']:.4f})"
                    f" nats over {c['adapter_vs_base']['tokens']} tokens; limit 0.2x the effect")
        if str(rank) == str((pl.get("merged_push") or {}).get("rank")) and plain_scores.get("merged") and \
                sc.get("tensors_bf16") and scores.get("base"):  # the server the merged route would run on
            c["adapter_vs_merged_plain"] = gap(sc["tensors_bf16"], plain_scores["merged"])
            effect, diff = gap(sc["tensors_bf16"], scores["base"])["mean"], c["adapter_vs_merged_plain"]["mean"]
            h.check(results, f"adapter_equals_merged_on_plain_r{rank}", effect > 1e-3 and diff <= 0.2 * effect,
                    f"mean |adapter - merged on the plain server| {diff:.4f} (max "
                    f"{c['adapter_vs_merged_plain']['max']:.4f}) against the adapter's effect {effect:.4f}; limit 0.2x")
        if sc.get("disk") and sc.get("tensors_bf16"):
            c["tensors_vs_disk"] = gap(sc["tensors_bf16"], sc["disk"])
            h.check(results, f"tensors_equals_disk_r{rank}", c["tensors_vs_disk"]["max"] < 1e-2,
                    f"max |from tensors - from disk| {c['tensors_vs_disk']['max']:.5f} (the same adapter; limit 0.01)")
        if sc.get("base_again") and scores.get("base"):
            c["base_restored"] = gap(sc["base_again"], scores["base"])
            h.check(results, f"base_restored_r{rank}", c["base_restored"]["max"] < 1e-2,
                    f"the base pushed back: max gap {c['base_restored']['max']:.5f} to the first base (limit 0.01)")
        if r.get("greedy_adapter") and r.get("greedy_merged"):
            a, m = r["greedy_adapter"], r["greedy_merged"]
            c["greedy_same_share"] = sum(x == y for x, y in zip(a, m)) / len(a)
        if str(rank) == str(pl.get("merged_push", {}).get("rank")) and plain_scores.get("merged") and sc.get("merged"):
            c["merged_lora_server_vs_plain"] = gap(sc["merged"], plain_scores["merged"])
        comp[str(rank)] = c
    ms = lo.get("memory_saver")
    if ms:
        h.check(results, "memory_saver_adapter", ms["gap"]["max"] < 1e-2,
                f"release all, resume weights, push the adapter, resume the cache "
                f"({ms['release_push_resume_s']:.2f}s): the adapter's log-probs moved by at most "
                f"{ms['gap']['max']:.5f} (limit 0.01)")
    for phase in PHASES:
        res = results.get(phase) or {}
        if res.get("skipped") and isinstance(res["skipped"], str) or res.get("phase_rc") not in (0, None):
            h.check(results, f"phase_{phase}", False, f"{res.get('skipped') or 'rc ' + str(res.get('phase_rc'))}: "
                    f"{str(res.get('error', ''))[:300]}")


def summary(results: Dict[str, Any], ranks: List[int]) -> List[str]:
    """A step's cost by route: the push plus the rollout (the adapter route's rollout runs on the LoRA server
    with the adapter; the merged route's on the plain server)."""
    lo, pl = results.get("lora") or {}, results.get("plain") or {}
    plain_ro = (pl.get("rollout") or {}).get("median_s")
    plain_push = ((pl.get("merged_push") or {}).get("median") or {}).get("seconds")
    out = []
    for rank in ranks:
        r = (lo.get("ranks") or {}).get(str(rank)) or {}
        push = (((r.get("push") or {}).get("tensors_bf16") or {}).get("median") or {}).get("total_s")
        ro = ((r.get("rollout") or {}).get("adapter") or {}).get("median_s")
        merged = ((r.get("merged_push") or {}).get("median") or {}).get("seconds")
        if None in (push, ro, plain_ro) or (merged is None and plain_push is None):
            continue
        m_push = plain_push if plain_push is not None else merged
        out.append(f"- rank {rank}, a step's push + rollout: adapter from tensors {push:.3f} + {ro:.3f} = "
                   f"{push + ro:.3f} s; merged {m_push:.3f} + {plain_ro:.3f} = {m_push + plain_ro:.3f} s "
                   f"(the rollout {100 * (ro / plain_ro - 1):+.0f}% with the adapter)")
    return out


def report(results: Dict[str, Any], ranks: List[int], path: str) -> None:
    lo, pl = results.get("lora") or {}, results.get("plain") or {}
    slim = {k: v for k, v in results.items() if k not in ("lora", "plain")}
    slim["lora"] = {k: v for k, v in lo.items() if k != "scores"}
    slim["plain"] = {k: v for k, v in pl.items() if k != "scores"}
    h.write_json(path + ".json", slim)
    w = results["workload"]
    lines = [f"# LoRA's weight push: merged against the adapter, {w['preset']} shape ({results.get('gpu', '?')})", "",
             f"SGLang server on one GPU, memory saver on; the trainer's tensors on the same GPU. "
             f"`{results['cmdline']}`",
             f"LoRA server: `{lo.get('command', '-')}` (up in {h.cell(lo.get('startup_s'), '.1f')} s); plain server "
             f"up in {h.cell(pl.get('startup_s'), '.1f')} s.", "",
             "Push, a step (medians of the steps): prep = the trainer's tensors to a request body (or files); "
             "first request = one request served with the new adapter (the engine moves it to the GPU then); "
             "merged = `WeightSender.push` of the merged weights (pause, cache flush, transfer, resume, version).",
             ""]
    rows = []
    for rank in ranks:
        r = (lo.get("ranks") or {}).get(str(rank)) or {}
        for route in ROUTES:
            m = ((r.get("push") or {}).get(route) or {}).get("median") or {}
            rows.append([rank, route, h.cell((m.get("bytes") or 0) / 2**20, ".1f"), h.cell(m.get("prep_s"), ".3f"),
                         h.cell(m.get("unload_s"), ".3f"), h.cell(m.get("load_s"), ".3f"),
                         h.cell(m.get("version_s"), ".3f"), h.cell(m.get("first_request_s"), ".3f"),
                         h.cell(m.get("total_s"), ".3f")])
        m = (r.get("merged_push") or {}).get("median") or {}
        rows.append([rank, "merged, LoRA server", h.cell((m.get("bytes") or 0) / 2**20, ".1f"), "", "",
                     h.cell(m.get("transfer_seconds"), ".3f"), "", "", h.cell(m.get("seconds"), ".3f")])
    m = (pl.get("merged_push") or {}).get("median") or {}
    rows.append([(pl.get("merged_push") or {}).get("rank", "-"), "merged, plain server",
                 h.cell((m.get("bytes") or 0) / 2**20, ".1f"), "", "", h.cell(m.get("transfer_seconds"), ".3f"), "",
                 "", h.cell(m.get("seconds"), ".3f")])
    lines += h.table(["rank", "route", "MiB", "prep s", "unload s", "load s", "version s", "first request s",
                      "total s"], rows)
    plain = (pl.get("rollout") or {}).get("median_s")
    lines += ["", f"Rollout, {w['prompts']} prompts x {w['samples']} samples x {w['new_tokens']} new tokens "
              f"(temperature 1; median of {ROLLOUTS} after a warm-up):", ""]
    rrows = [["plain server (the merged route)", "-", h.cell(plain, ".3f"),
              h.cell((pl.get("rollout") or {}).get("tokens_per_s"), ".0f"), "1.00" if plain else "-"]]
    for rank in ranks:
        for mode in ("base", "adapter"):
            ro = (((lo.get("ranks") or {}).get(str(rank)) or {}).get("rollout") or {}).get(mode) or {}
            rrows.append([f"LoRA server, {mode}", rank, h.cell(ro.get("median_s"), ".3f"),
                          h.cell(ro.get("tokens_per_s"), ".0f"),
                          h.cell(ro["median_s"] / plain, ".2f") if ro.get("median_s") and plain else "-"])
    lines += h.table(["server, requests", "rank", "seconds", "tokens/s", "x plain"], rrows)
    lines += ["", "Agreement (teacher-forced log-probs, nats; max / mean):", ""]
    arows = []
    for rank in ranks:
        c = (results.get("agreement") or {}).get(str(rank)) or {}

        def mm(key, c=c):
            g = c.get(key)
            return f"{g['max']:.4f} / {g['mean']:.4f}" if g else "-"
        arows.append([rank, mm("adapter_vs_merged"), mm("adapter_vs_merged_plain"), mm("adapter_vs_base"),
                      mm("tensors_vs_disk"), h.cell(c.get("greedy_same_share"), ".2f"),
                      mm("merged_lora_server_vs_plain")])
    lines += h.table(["rank", "adapter vs merged (same server)", "adapter vs merged (plain server)",
                      "adapter vs base (its effect)", "from tensors vs from disk", "greedy answers equal",
                      "merged: LoRA server vs plain"], arows)
    extra = summary(results, ranks)
    extra += [f"- {k}: {v}" for k, v in (("LoRA server startup parts", lo.get("server_log_times")),
                                         ("plain server startup parts", pl.get("server_log_times")),
                                         ("trainer model load s", lo.get("trainer_load_s")),
                                         ("skipped", lo.get("skipped"))) if v]
    for rank in ranks:
        r = (lo.get("ranks") or {}).get(str(rank)) or {}
        if r.get("warm_request_s") is not None:
            extra.append(f"- rank {rank}: adapter {r['adapter_mb']:.0f} MiB in fp32; a request with the adapter "
                         f"resident {r['warm_request_s']:.3f} s")
    h.write_text(path + ".md", "\n".join(lines + [""] + extra + ["", "Checks:"] + h.check_lines(results)) + "\n")


# ------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default=os.environ.get("RANKS", "16,64"), help="LoRA ranks, comma-separated (env RANKS)")
    ap.add_argument("--phases", default=os.environ.get("PHASES", ",".join(PHASES)),
                    help=f"comma-separated, of {','.join(PHASES)} (env PHASES; build always runs)")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BENCH_BUDGET_S", 480)),
                    help="seconds for all phases (env BENCH_BUDGET_S)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--cpu", action="store_true", help="this script's own code on a CPU, without SGLang (see above)")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--ranks: comma-separated integers, got {args.ranks!r}")
    if not ranks or min(ranks) < 1:
        ap.error(f"--ranks: at least one rank >= 1, got {args.ranks!r}")
    w = workload(args.cpu)
    os.makedirs(w.work, exist_ok=True)
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    if args.phase:
        return run_phase(args, w, ranks)
    wanted = {p.strip() for p in args.phases.split(",") if p.strip()} | {"build"}
    if wanted - set(PHASES):
        ap.error(f"--phases: unknown {sorted(wanted - set(PHASES))} (known: {', '.join(PHASES)})")
    phases = [p for p in PHASES if p in wanted]
    path = os.path.join(args.out, "lora_push_gpu" + ("_cpu" if args.cpu else ""))
    names = ["cpu (dry run)"] if args.cpu else h.gpu_names()
    results: Dict[str, Any] = {"gpu": (names or [""])[0], "cmdline": " ".join(sys.argv), "ranks": ranks,
                               "workload": {"preset": w.preset, "prompts": w.prompts, "samples": w.samples,
                                            "new_tokens": w.new_tokens, "prompt_words": w.prompt_words}}
    needs = {p: (0, args.budget) for p in phases} if args.cpu else PLAN
    try:
        for phase, limit, skipped in h.Budget(args.budget).plan(phases, needs):
            if skipped:
                results[phase] = {"skipped": skipped}
            else:
                file = phase_path(args.out, phase) if phase != "build" else os.path.join(w.work, "phase_build.json")
                results[phase] = h.run_child(phase, limit, file)
            results.pop("checks", None)
            derive(results, ranks, args.cpu)
            report(results, ranks, path)
            if phase == "build" and results[phase].get("phase_rc") != 0:
                break
        print(open(path + ".md").read())
    finally:
        for name in ("lora", "plain"):
            log_file = os.path.join(w.work, f"{name}_server.log")
            if os.path.exists(log_file):
                h.write_text(os.path.join(args.out, "logs", f"lora_push_{name}_server.log"),
                             _tail(log_file, 150) + "\n")
    if h.failed(results):
        h.log(f"FAILED: {h.failed(results)}")
        sys.exit(1)


def _tail(path: str, lines: int) -> str:
    from slime_hydra.utils.proc import tail

    return tail(path, lines)


if __name__ == "__main__":
    main()
