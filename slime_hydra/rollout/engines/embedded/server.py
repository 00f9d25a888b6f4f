"""SGLang's native HTTP protocol in front of the embedded engine.

    python -m slime_hydra.rollout.engines.embedded.server --model-path DIR --host 127.0.0.1 --port 30000

The flags are SGLang's names. Every model operation runs on one worker thread, which gathers concurrent
``/generate`` requests into batches. Endpoints, fields and answers are SGLang 0.5.17's own server's
(tests/rollout/test_engine_protocol.py checks them).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import logging
import os
import queue
import threading
import time
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from slime_hydra.rollout.engines.embedded.engine import EmbeddedModel, MemoryReleased, Request, SamplingParams
from slime_hydra.sync import transport

log = logging.getLogger("slime_hydra.embedded")
VERSION = "slime_hydra-embedded-0.1"
_RIDS = itertools.count()  # ids of requests that come without one (cheaper than uuid4)


class Worker:
    """Owns the engine; runs generate batches and control calls one at a time, in arrival order."""

    # A batch starts once no request came for batch_wait_s (or after max_wait_s, or at max_batch); requests
    # that arrive while it decodes form the next batch (static batching).
    def __init__(self, engine: EmbeddedModel, max_batch: int, batch_wait_s: float = 0.003, max_wait_s: float = 0.5):
        self.engine, self.max_batch, self.batch_wait_s, self.max_wait_s = engine, max_batch, batch_wait_s, max_wait_s
        self.jobs: "queue.Queue[tuple]" = queue.Queue()
        self.running: Dict[str, Request] = {}
        self.pending_reqs: Dict[int, Request] = {}  # every /generate request not answered yet
        self.resumed = threading.Event()
        self.resumed.set()
        self.abort_epoch = 0
        self.recent: "collections.deque[dict]" = collections.deque(maxlen=64)  # timings of the last batches
        threading.Thread(target=self._loop, name="engine-worker", daemon=True).start()

    async def submit(self, kind: str, payload: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if kind == "generate":
            self.pending_reqs[id(payload)] = payload
        self.jobs.put((kind, payload, loop, fut, time.monotonic()))
        try:
            return await fut
        finally:
            if kind == "generate":
                self.pending_reqs.pop(id(payload), None)

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """SGLang's abort of running and waiting requests: all (``abort_all``), or those with id or parent ``rid``."""
        if abort_all:
            self.abort_epoch += 1
        elif rid:
            for r in list(self.pending_reqs.values()):
                if rid in (r.rid, r.parent):
                    r.aborted = True

    def pending(self) -> int:
        return self.jobs.qsize()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job[0] == "generate":
                self.resumed.wait()
                batch, job = self._gather(job)
                self._run_batch(batch)
                if job is None:
                    continue
            self._run_call(job)

    def _gather(self, first: tuple):
        """Generate jobs until max_batch, a quiet gap or max_wait -> (batch, a control job that came meanwhile)."""
        batch, deadline = [first], time.monotonic() + self.max_wait_s
        while len(batch) < self.max_batch and time.monotonic() < deadline:
            try:
                job = self.jobs.get(timeout=self.batch_wait_s)
            except queue.Empty:
                break
            if job[0] != "generate":
                return batch, job
            batch.append(job)
        return batch, None

    def _run_batch(self, batch: List[tuple]) -> None:
        reqs = [job[1] for job in batch]
        t0 = time.monotonic()
        for r in reqs:
            self.running[r.rid] = r
        try:
            results: List[Any] = self.engine.generate(reqs, lambda r: r.epoch < self.abort_epoch)
        except Exception as e:  # noqa: BLE001 - every waiter must get an answer
            log.exception("generation failed") if not isinstance(e, MemoryReleased) else None
            results = [e] * len(batch)
        finally:
            for r in reqs:
                self.running.pop(r.rid, None)
        t1 = time.monotonic()
        self.recent.append({"size": len(batch), "first_wait_s": t0 - batch[0][4], "last_wait_s": t0 - batch[-1][4],
                            "compute_s": t1 - t0})
        for (_, _, loop, fut, _), res in zip(batch, results):
            loop.call_soon_threadsafe(_resolve, fut, res)

    def _run_call(self, job: tuple) -> None:
        _, fn, loop, fut, _ = job
        try:
            res: Any = fn()
        except Exception as e:  # noqa: BLE001
            res = e
        loop.call_soon_threadsafe(_resolve, fut, res)


def _resolve(fut: asyncio.Future, res: Any) -> None:
    if fut.done():
        return
    if isinstance(res, BaseException):
        fut.set_exception(res)
    else:
        fut.set_result(res)


def _ok(message: str, **extra) -> JSONResponse:
    return JSONResponse({"success": True, "message": message, **extra})


def _fail(message: str, status: int = 400, **extra) -> JSONResponse:
    return JSONResponse({"success": False, "message": message, **extra}, status_code=status)


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def build_app(engine: EmbeddedModel, server_args: Dict[str, Any], max_batch: int = 256) -> "GenerateFirst":
    """Plain Starlette routes (FastAPI's per-request work costs much on tiny requests)."""
    worker = Worker(engine, max_batch)
    routes: List[Route] = []

    def route(*paths: str, methods: tuple = ("GET",)):
        def add(fn):
            routes.extend(Route(p, fn, methods=list(methods)) for p in paths)
            return fn
        return add

    async def body(req: HTTPRequest) -> Dict[str, Any]:
        data = await req.json() if await req.body() else {}
        return data if isinstance(data, dict) else {}

    async def call(fn: Callable[[], Any]) -> Any:
        return await worker.submit("call", fn)

    async def generate(data: Any) -> Tuple[int, Any]:
        """/generate -> (HTTP status, JSON body)."""
        try:
            batch, reqs = _parse_generate(data if isinstance(data, dict) else {}, engine, worker.abort_epoch)
        except (ValueError, TypeError, KeyError) as e:
            return 400, {"error": {"message": str(e)}}
        try:
            if batch:
                return 200, list(await asyncio.gather(*(worker.submit("generate", r) for r in reqs)))
            return 200, await worker.submit("generate", reqs[0])
        except MemoryReleased as e:
            return 503, {"error": {"message": str(e)}}
        except ValueError as e:
            return 400, {"error": {"message": str(e)}}

    @route("/abort_request", methods=("POST",))
    async def abort_request(req: HTTPRequest):
        data = await body(req)
        worker.abort(data.get("rid") or "", bool(data.get("abort_all")))
        return Response(status_code=200)

    @route("/pause_generation", methods=("POST",))
    async def pause_generation(req: HTTPRequest):
        data = await body(req)
        mode = data.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _error(f"mode must be one of 'abort', 'retract', 'in_place', got {mode!r}")
        worker.resumed.clear()  # retract and in_place: the running batch finishes, the next waits
        if mode == "abort":
            worker.abort(abort_all=True)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @route("/continue_generation", methods=("POST",))
    async def continue_generation(req: HTTPRequest):
        worker.resumed.set()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @route("/flush_cache", methods=("GET", "POST"))
    async def flush_cache(req: HTTPRequest):
        if worker.running:
            return PlainTextResponse("Flush cache failed.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    @route("/health")
    async def health(req: HTTPRequest):
        return PlainTextResponse("")

    @route("/health_generate")
    async def health_generate(req: HTTPRequest):
        probe = Request(input_ids=[engine.pad_id], params=SamplingParams(max_new_tokens=1, temperature=0.0),
                        rid=f"HEALTH_CHECK_{time.time()}", epoch=worker.abort_epoch)
        try:
            await asyncio.wait_for(worker.submit("generate", probe), timeout=20)
        except Exception as e:  # noqa: BLE001
            return PlainTextResponse(f"unhealthy: {e}", status_code=503)
        return PlainTextResponse("")

    def info() -> Dict[str, Any]:
        return {**server_args, "weight_version": engine.weight_version, "version": VERSION,
                "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "disaggregation_mode": "null",
                "released_tags": sorted(engine.released),
                "internal_states": [{"max_batch": max_batch, "recent_batches": list(worker.recent)}]}

    @route("/server_info", "/get_server_info")
    async def server_info(req: HTTPRequest):
        return JSONResponse(info())

    @route("/model_info", "/get_model_info")
    async def model_info(req: HTTPRequest):
        return JSONResponse({"model_path": engine.model_path, "tokenizer_path": server_args.get("tokenizer_path"),
                             "is_generation": True, "preferred_sampling_params": None,
                             "weight_version": engine.weight_version,
                             "has_image_understanding": False, "has_audio_understanding": False,
                             "model_type": engine.model.config.model_type,
                             "architectures": getattr(engine.model.config, "architectures", None)})

    @route("/get_weight_version", "/weight_version")
    async def get_weight_version(req: HTTPRequest):  # as SGLang 0.5.17 answers it (FastAPI's HTTPException)
        return JSONResponse({"detail": "Endpoint '/get_weight_version' or '/weight_version' is deprecated. "
                                       "Please use '/model_info' instead."}, status_code=404)

    @route("/update_weight_version", methods=("POST",))
    async def update_weight_version(req: HTTPRequest):
        data = await body(req)
        if data.get("abort_all_requests", True):
            worker.abort(abort_all=True)
        engine.weight_version = str(data["new_version"])
        return _ok(f"Weight version updated to {engine.weight_version}", new_version=engine.weight_version)

    def load() -> Dict[str, Any]:
        return {"dp_rank": 0, "num_running_reqs": len(worker.running), "num_waiting_reqs": worker.pending(),
                "num_reqs": len(worker.running) + worker.pending()}

    @route("/v1/loads")
    async def loads(req: HTTPRequest):
        return JSONResponse({"timestamp": time.time(), "version": VERSION, "loads": [load()]})

    @route("/get_load")
    async def get_load(req: HTTPRequest):  # SGLang's deprecated shim: one flat record per data-parallel rank
        now = load()
        return JSONResponse([{"dp_rank": 0, "num_reqs": now["num_reqs"], "num_waiting_reqs": now["num_waiting_reqs"],
                              "num_tokens": 0, "num_pending_tokens": 0, "ts_tic": time.perf_counter()}])

    async def weight_request(req: HTTPRequest) -> Tuple[Dict[str, Any], Optional[str]]:
        d = await body(req)
        if d.get("abort_all_requests"):
            worker.abort(abort_all=True)
        return d, d.get("weight_version")

    async def weight_call(fn: Callable[[], Any], what: str, version: Optional[str], **extra):
        try:
            await call(fn)
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which fails the run
            log.exception("%s failed", what)
            return _fail(f"Failed to {what}: {e}", **extra)
        return _ok(f"Succeeded to {what}." + (f" Weight version updated to {version}." if version is not None else ""),
                   **extra)

    @route("/init_weights_update_group", methods=("POST",))
    async def init_weights_update_group(req: HTTPRequest):
        d = await body(req)
        fn = lambda: engine.init_group(d["master_address"], int(d["master_port"]), int(d["rank_offset"]),  # noqa: E731
                                       int(d["world_size"]), d.get("group_name", "weight_update_group"),
                                       d.get("backend", "nccl"))
        # joining blocks until the trainer joins too: beside the worker, not on it
        try:
            await asyncio.to_thread(fn)
        except Exception as e:  # noqa: BLE001
            return _fail(f"Failed to initialize custom process group: {e}")
        return _ok("Succeeded to initialize custom process group.")

    @route("/destroy_weights_update_group", methods=("POST",))
    async def destroy_weights_update_group(req: HTTPRequest):
        d = await body(req)
        try:
            await call(lambda: engine.destroy_group(d.get("group_name", "weight_update_group")))
        except ValueError:
            return _fail("The group to be destroyed does not exist.")
        return _ok("Succeeded to destroy custom process group.")

    @route("/update_weights_from_distributed", methods=("POST",))
    async def update_weights_from_distributed(req: HTTPRequest):
        d, version = await weight_request(req)
        return await weight_call(
            lambda: engine.update_from_distributed(d["names"], d["dtypes"], d["shapes"],
                                                   d.get("group_name", "weight_update_group"), version,
                                                   d.get("load_format")),
            "update parameter online", version)

    @route("/update_weights_from_tensor", methods=("POST",))
    async def update_weights_from_tensor(req: HTTPRequest):
        d, version = await weight_request(req)

        def load_tensors():
            # SGLang: TP rank i reads entry i (this engine is one rank); load_format None or "direct": a list
            # of (name, tensor); "flattened_bucket": {"flattened_tensor": bytes, "metadata": [...]}
            payload = transport.deserialize(d["serialized_named_tensors"][0])
            fmt = d.get("load_format")
            if fmt == "flattened_bucket":
                named = transport.unflatten(payload["flattened_tensor"], payload["metadata"])
            elif fmt in (None, "direct"):
                named = list(payload)
            else:
                raise ValueError(f"Unknown load_format={fmt}")
            engine.load_weights(named, version)

        return await weight_call(load_tensors, "update weights from tensor", version)

    @route("/update_weights_from_disk", methods=("POST",))
    async def update_weights_from_disk(req: HTTPRequest):
        d, version = await weight_request(req)
        return await weight_call(lambda: engine.update_from_disk(d["model_path"], version),
                                 "update weights from disk", version, num_paused_requests=0)

    # without --enable-memory-saver, SGLang answers release and resume but keeps its memory: so does this server
    memory_saver = bool(server_args.get("enable_memory_saver"))

    @route("/release_memory_occupation", methods=("GET", "POST"))
    async def release_memory_occupation(req: HTTPRequest):
        d = await body(req)
        if memory_saver:
            await call(lambda: engine.release(d.get("tags")))
        return JSONResponse(None)

    @route("/resume_memory_occupation", methods=("GET", "POST"))
    async def resume_memory_occupation(req: HTTPRequest):
        d = await body(req)
        if memory_saver:
            await call(lambda: engine.resume(d.get("tags")))
        return JSONResponse(None)

    app = GenerateFirst(Starlette(routes=routes), generate)
    app.state.worker = worker
    return app


class GenerateFirst:
    """/generate straight on ASGI (Starlette's layers cost much on small requests), the rest through Starlette."""

    def __init__(self, app: Starlette, generate: Callable[[Any], Awaitable[Tuple[int, Any]]]):
        self.app, self.generate, self.state = app, generate, app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/generate" or scope["method"] not in ("POST", "PUT"):
            return await self.app(scope, receive, send)
        raw, more = b"", True
        while more:
            message = await receive()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            status, answer = await self.generate(json.loads(raw) if raw else {})
        except json.JSONDecodeError as e:
            status, answer = 400, {"error": {"message": f"the body is not JSON: {e}"}}
        body = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _parse_generate(data: Dict[str, Any], engine: EmbeddedModel, epoch: int):
    """GenerateReqInput -> (is_batch, [Request]), as SGLang 0.5.17's ``normalize_batch_and_arguments``: a batch
    is a list of prompts or n > 1; ``sampling_params``, ``rid`` and ``return_logprob`` are each one value for all
    prompts or a list with one per prompt (else a 400 naming the field); the answer lists n outputs per prompt."""
    if ("text" in data) == ("input_ids" in data):
        raise ValueError("exactly one of 'text' and 'input_ids' must be given")
    prompts = data.get("input_ids")
    if prompts is None:
        text = data["text"]
        texts = text if isinstance(text, list) else [text]
        prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        batch = isinstance(text, list)
    else:
        if not prompts:
            raise ValueError("input_ids cannot be empty")
        batch = isinstance(prompts[0], list)
        prompts = prompts if batch else [prompts]
    sps = _per_prompt(data, "sampling_params", len(prompts), {}, "one object for all")
    if not all(isinstance(p, dict) or p is None for p in sps):
        raise ValueError("sampling_params must be an object, or (a batch) a list of objects")
    sps = [p or {} for p in sps]
    ns = {int(p.get("n") or 1) for p in sps}
    if len(ns) > 1:
        raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")
    n = ns.pop()
    rid = data.get("rid")
    rids = _per_prompt(data, "rid", len(prompts), None, "or one string (SGLang appends _<i>)")
    if isinstance(rid, str) and batch:
        rids = [f"{rid}_{i}" if rid else None for i in range(len(prompts))]
    if not all(r is None or isinstance(r, str) for r in rids):
        raise ValueError("rid must be a string, or (a batch) a list of strings")
    duplicates = sorted({r for r in rids if r and rids.count(r) > 1})
    if duplicates:
        raise ValueError(f"Duplicate request IDs detected within the request: {duplicates}")
    logprobs = _per_prompt(data, "return_logprob", len(prompts), False, "or one bool for all")
    logprob_text = bool(data.get("return_text_in_logprobs", False))
    starts = [-1 if x is None else x for x in _per_prompt(data, "logprob_start_len", len(prompts), -1,
                                                           "or one int for all")]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in starts):
        raise ValueError("logprob_start_len must be an int, or (a batch) a list of ints")
    reqs = []
    parent = rid if isinstance(rid, str) and rid else None
    for ids, p, r, logprob, start in zip(prompts, sps, rids, logprobs, starts):
        if start >= len(ids):
            raise ValueError(f"logprob_start_len ({start}) is superior or equal to the input length ({len(ids)})")
        if not ids or not all(isinstance(t, int) and 0 <= t < engine.vocab_size for t in ids):
            raise ValueError(f"input_ids must be non-empty token ids in [0, {engine.vocab_size})")
        params = SamplingParams.from_dict(p)
        for k in range(n):
            child = (r if n == 1 else f"{r}_{k}") if r else f"req-{next(_RIDS)}"
            reqs.append(Request(list(ids), params, rid=child, return_logprob=bool(logprob),
                                return_text_in_logprobs=logprob_text, logprob_start_len=start, parent=parent,
                                epoch=epoch))
    return batch or n > 1, reqs


def _per_prompt(data: Dict[str, Any], key: str, prompts: int, default: Any, or_else: str) -> List[Any]:
    value = data.get(key, default)
    if not isinstance(value, list):
        return [value] * prompts
    if len(value) != prompts:
        raise ValueError(f"{key} has {len(value)} entries for {prompts} prompt(s): give one per prompt, {or_else}")
    return value


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--base-gpu-id", type=int, default=0)
    ap.add_argument("--random-seed", type=int, default=0)
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--enable-memory-saver", action="store_true",
                    help="release_memory_occupation frees the weights (colocated engines that offload)")
    ap.add_argument("--max-running-requests", type=int, default=256, help="most sequences decoded together")
    ap.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s [engine:%(process)d] %(message)s")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.multiprocessing.set_sharing_strategy("file_system")
    device = args.device if args.device == "cpu" else f"cuda:{args.base_gpu_id}"
    if args.device != "cpu":
        torch.cuda.set_device(args.base_gpu_id)  # NCCL weight-update groups use the current device
    engine = EmbeddedModel(args.model_path, args.tokenizer_path, args.dtype, device, args.random_seed,
                            args.trust_remote_code)
    app = build_app(engine, dict(vars(args)), args.max_running_requests)
    log.info("embedded engine serving %s on %s:%d (pid %d)", args.model_path, args.host, args.port, os.getpid())
    # a long keep-alive: the router's pooled connections must outlive the idle gaps (training)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_keep_alive=3600)


if __name__ == "__main__":
    main()
