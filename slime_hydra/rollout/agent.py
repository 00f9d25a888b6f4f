"""Any agent trains: ``rollout.agent`` is ordinary code that reaches the model through an OpenAI-compatible
endpoint, and the rollout records the exact tokens behind it.

    async def run(client, sample: dict) -> float | dict | None   # sample: prompt, label, index, metadata

A first parameter named ``client`` gets an ``openai.AsyncOpenAI`` on the sample's session whose transport calls the
endpoint in process (no socket, no HTTP parsing, one connection pool for all sessions); any other name gets the
session's base URL, for any HTTP client. A plain ``def`` agent (blocking code, the synchronous ``openai.OpenAI``,
``requests``) runs in a thread, up to ``rollout.concurrency`` at once, and its ``client`` is an ``openai.OpenAI``
handing each request to the endpoint's loop; the loop itself never blocks.

Each sample gets its own session, ``http://127.0.0.1:PORT/s/<id>/v1`` (``/chat/completions``, ``/completions``,
``/models``), served from the rollout manager's event loop in front of the engines. A chat request renders its new
messages with the chat template and generates one assistant turn through :class:`ChatRollout` (template diffs for
every token the model did not make, the engine's tokens and log-probs for the turns it made); the turn's tool-call
text becomes ``tool_calls`` (:mod:`slime_hydra.rollout.tool_calls`). A request whose messages do not extend the
session's conversation (the agent edited or summarized its history) starts a new segment: counted, logged, and
only the last segment is trained (segments are never merged). What the endpoint cannot honour (``n`` > 1,
streaming, forced tool choice, top log-probs, penalties) is answered with HTTP 400 naming the parameter.

The agent's reward is the sample's; None leaves it to the configured reward function (on the final conversation,
``metadata["messages"]``). An agent that raises or outlives ``rollout.agent_timeout`` fails its sample (kept out
of the loss, counted, traceback logged); one past ``rollout.agent_max_turns`` or ``rollout.max_response_len``
is answered 400 and its sample ends TRUNCATED. An aborted sample starts over (an agent's state cannot be resumed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import socket
import time
import uuid
from typing import Any, Dict, List, Optional

from slime_hydra.data.sample import Sample, Status
from slime_hydra.rewards import counters
from slime_hydra.rollout import tool_calls
from slime_hydra.rollout.multiturn import ChatRollout, initial_messages, render

log = logging.getLogger(__name__)

SUPPORTED = {"model", "messages", "prompt", "tools", "temperature", "top_p", "max_tokens", "max_completion_tokens",
             "stop", "logprobs", "user", "parallel_tool_calls"}
ONLY = {"n": [1], "stream": [False], "top_logprobs": [0], "presence_penalty": [0], "frequency_penalty": [0],
        "tool_choice": ["auto", "none"], "echo": [False], "best_of": [1]}


class RequestError(ValueError):
    """A request the endpoint refuses (HTTP 400)."""


def check_request(body: Any, key: str) -> None:
    """Raise :class:`RequestError` for a body the endpoint cannot honour exactly; ``key``: messages or prompt."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for k, v in body.items():
        if v is None:
            continue
        if k in ONLY and v not in ONLY[k]:
            raise RequestError(f"{k}={v!r} is not supported by the training endpoint (only {ONLY[k]})")
        if k not in ONLY and k not in SUPPORTED:
            raise RequestError(f"parameter {k!r} is not supported by the training endpoint; supported: "
                               f"{sorted(SUPPORTED - {'prompt', 'messages'} | {key} | set(ONLY))}")
    want = str if key == "prompt" else list
    if not isinstance(body.get(key), want) or not body[key]:
        raise RequestError(f"{key!r} must be a non-empty {want.__name__}")


def _text(content: Any) -> str:
    """A message's content as text (OpenAI's list of text parts joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def normalize(m: Dict[str, Any]) -> Dict[str, Any]:
    """An OpenAI message as the chat template takes it: text content, tool-call arguments as a dict."""
    if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
        raise RequestError(f"every message needs a role of system, user, assistant or tool; got {m!r:.200}")
    out = {"role": "system" if m["role"] == "developer" else m["role"], "content": _text(m.get("content"))}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {
            "name": c["function"]["name"], "arguments": json.loads(c["function"].get("arguments") or "{}")
            if isinstance(c["function"].get("arguments"), str) else c["function"].get("arguments") or {}}}
            for c in m["tool_calls"]]
    out.update({k: m[k] for k in ("name", "tool_call_id") if m.get(k)})
    return out


def key(m: Dict[str, Any]) -> tuple:
    """What must be equal for a message to be the session's: role, content, tool calls (not ids)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in m.get("tool_calls") or [])
    return m["role"], m["content"].strip(), calls


def restart(sample: Sample) -> None:
    """Empty the sample's tokens and conversation (a new segment, or an aborted sample starting over)."""
    sample.tokens, sample.response, sample.response_length = [], "", 0
    sample.loss_mask = sample.rollout_log_probs = None
    sample.status = Status.PENDING
    for k in ("messages", "turn_start", "pending_suffix", "num_turns", "tool_calls", "template_mismatch", "text"):
        sample.metadata.pop(k, None)


class Session:
    """One sample's conversation behind its base URL."""

    def __init__(self, endpoint: "Endpoint", ctx: Any, sample: Sample, sampling_params: Dict[str, Any]):
        self.endpoint, self.ctx, self.sample, self.sp = endpoint, ctx, sample, sampling_params
        self.id = uuid.uuid4().hex
        self.url = f"{endpoint.url}/s/{self.id}/v1"
        self.chat: Optional[ChatRollout] = None
        self.seen: List[tuple] = []  # the conversation as the agent sees it
        self.tools: Any = None
        self.aborted, self.turns = False, 0  # turns: chat requests answered, over all segments
        self.lock = asyncio.Lock()  # one request at a time: each extends the conversation
        self.inflight: set = set()

    async def call(self, method: str, body: Any) -> Dict[str, Any]:
        async with self.lock:
            task = asyncio.ensure_future(getattr(self, method)(body))
            self.inflight.add(task)
            try:
                return await task
            finally:
                self.inflight.discard(task)

    async def close(self) -> None:
        """The agent is done (or failed): a request still in flight no longer touches the sample."""
        for t in list(self.inflight):
            t.cancel()
        await asyncio.gather(*self.inflight, return_exceptions=True)

    def _segment(self, why: str) -> None:
        if self.sample.tokens:
            self.sample.metadata["segments"] = self.sample.metadata.get("segments", 1) + 1
            counters.count("agent_new_segment", f"{self.sample.identity()}: {why}: a new segment starts; only the "
                                                "last segment of a session is trained")
            restart(self.sample)

    def _parse(self, tools: Any, tool_choice: Any):
        name = self.endpoint.parser if tools and tool_choice != "none" else "none"
        fn = functools.partial(tool_calls.PARSERS[name], tools=tools)
        if name in tool_calls.SGLANG_NAMES and self.ctx.cfg is not None and self.ctx.cfg.rollout.engine == "sglang":
            fn = tool_calls.sglang_parser(name, tools)
        eos = self.endpoint.tokenizer.eos_token

        def parse(text: str) -> Dict[str, Any]:
            content, calls = fn(text[: -len(eos)] if eos and text.endswith(eos) else text)
            msg: Dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                msg["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                                      "function": {"name": n, "arguments": a}} for n, a in calls]
            return msg
        return parse

    def _budget(self) -> None:
        r = self.ctx.cfg.rollout if self.ctx.cfg is not None else None
        if r is not None and r.agent_max_turns is not None and self.turns >= r.agent_max_turns:
            self.sample.status = Status.TRUNCATED
            raise RequestError(f"the session has used its rollout.agent_max_turns={r.agent_max_turns} turns")

    def _params(self, body: Dict[str, Any]) -> Dict[str, Any]:
        sp = dict(self.sp)
        sp.update({k: body[k] for k in ("temperature", "top_p") if body.get(k) is not None})
        stop = body.get("stop")
        if stop:
            sp["stop"] = list(sp.get("stop") or []) + ([stop] if isinstance(stop, str) else list(stop))
        return sp

    async def chat_completion(self, body: Dict[str, Any]) -> Dict[str, Any]:
        check_request(body, "messages")
        msgs = [normalize(m) for m in body["messages"]]
        keys, n, tools, s = [key(m) for m in msgs], len(self.seen), body.get("tools") or None, self.sample
        extends = (self.chat is not None and tools == self.tools and keys[:n] == self.seen and len(keys) > n
                   and all(m["role"] != "assistant" for m in msgs[n:]))
        self._budget()
        if extends:
            self.chat.add_messages(msgs[n:])
        else:
            self._segment("the request's messages do not extend the session's conversation")
            self.chat = ChatRollout(self.endpoint.tokenizer, s, messages=msgs, tools=tools,
                                    parse=self._parse(tools, body.get("tool_choice")))
            self.tools = tools
        before = s.response_length
        max_new = body.get("max_completion_tokens") or body.get("max_tokens")
        msg = await self.chat.assistant_turn(self.ctx, self._params(body), max_new_tokens=max_new)
        if msg is None:
            return self._ended()
        self.turns += 1
        n_new = s.response_length - before
        ids, lps = s.tokens[len(s.tokens) - n_new :], s.rollout_log_probs[len(s.rollout_log_probs) - n_new :]
        out = {"role": "assistant", "content": msg["content"]}
        if msg.get("tool_calls"):
            out["tool_calls"] = [{**c, "function": {"name": c["function"]["name"],
                                                    "arguments": json.dumps(c["function"]["arguments"])}}
                                 for c in msg["tool_calls"]]
        self.seen = keys + [key(msg)]
        finish = ("tool_calls" if msg.get("tool_calls") else "length"
                  if s.status == Status.TRUNCATED or (max_new and len(ids) >= max_new) else "stop")
        choice = {"index": 0, "message": out, "finish_reason": finish,
                  "logprobs": {"content": self._logprobs(ids, lps)} if body.get("logprobs") else None}
        return self._reply("chat.completion", choice, len(s.tokens) - len(ids), len(ids))

    async def completion(self, body: Dict[str, Any]) -> Dict[str, Any]:
        """A raw completion: the prompt's tokens (masked past the session's text) and the engine's."""
        check_request(body, "prompt")
        s, prompt, tok = self.sample, body["prompt"], self.endpoint.tokenizer
        if self.chat is not None or not s.tokens or not prompt.startswith(s.metadata.get("text", "\0")):
            self._segment("the prompt does not extend the session's text")
            self.chat, s.tokens = None, tok.encode(prompt, add_special_tokens=False)
        elif prompt != s.metadata["text"]:
            extra = prompt[len(s.metadata["text"]) :]
            s.append_response(tok.encode(extra, add_special_tokens=False), trainable=False, text=extra)
        left = self.sp["max_new_tokens"] - s.response_length
        max_new = min(left, body.get("max_tokens") or left)
        if max_new <= 0:
            s.status = Status.TRUNCATED
            return self._ended()
        out = await self.ctx.post("/generate", {"input_ids": s.tokens, "return_logprob": True,
                                                "sampling_params": {**self._params(body), "max_new_tokens": max_new}})
        pairs = out["meta_info"].get("output_token_logprobs") or []
        ids, lps = [int(p[1]) for p in pairs], [float(p[0]) for p in pairs]
        text = tok.decode(ids, skip_special_tokens=False)
        s.append_response(ids, lps, trainable=True, text=text)
        finish = out["meta_info"]["finish_reason"]["type"]
        if finish == "abort":
            s.status = Status.ABORTED
            return self._ended()
        s.status = Status.TRUNCATED if finish == "length" and max_new >= left else Status.COMPLETED
        s.metadata["text"] = prompt + text
        choice = {"index": 0, "text": text, "finish_reason": finish,
                  "logprobs": {"tokens": [tok.decode([i]) for i in ids], "token_logprobs": lps}
                  if body.get("logprobs") else None}
        return self._reply("text_completion", choice, len(s.tokens) - len(ids), len(ids))

    def _ended(self) -> Dict[str, Any]:
        if self.sample.status == Status.ABORTED:
            self.aborted = True
            raise RequestError("the rollout was aborted; this session has ended")
        budget = self.sp["max_new_tokens"]
        raise RequestError(f"the session has spent its token budget (rollout.max_response_len={budget})")

    def _logprobs(self, ids: List[int], lps: List[float]) -> List[Dict[str, Any]]:
        toks = [self.endpoint.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
        return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in zip(toks, lps)]

    def _reply(self, obj: str, choice: Dict[str, Any], prompt_tokens: int, completion_tokens: int) -> Dict[str, Any]:
        return {"id": f"{obj}-{uuid.uuid4().hex[:16]}", "object": obj, "created": int(time.time()),
                "model": self.endpoint.model, "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}


class _Server:
    """uvicorn in the running loop on a free port, leaving the process's signal handlers alone."""

    @staticmethod
    async def start(app: Any, host: str) -> tuple:
        import uvicorn

        class Server(uvicorn.Server):
            def capture_signals(self):  # the run's SIGTERM / SIGINT handlers stay the run's
                return contextlib.nullcontext()

        sock = socket.socket()
        sock.bind((host, 0))
        server = Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                       timeout_keep_alive=600))
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        return server, task, sock.getsockname()[1]


class Endpoint:
    """The sessions' HTTP server, one per event loop (the rollout manager's)."""

    def __init__(self, tokenizer: Any, model: str, parser: str):
        self.tokenizer, self.model, self.parser = tokenizer, model, parser
        self.sessions: Dict[str, Session] = {}
        self.url = ""
        self.http = self.sync_http = self.slots = None

    async def start(self, host: str = "127.0.0.1") -> "Endpoint":
        from starlette.applications import Starlette
        from starlette.responses import Response
        from starlette.routing import Route

        async def handle(request):
            status, body = await self.dispatch(request.method, request.url.path, await request.body())
            return Response(body, status, media_type="application/json")

        self.app = Starlette(routes=[Route("/s/{rest:path}", handle, methods=["GET", "POST"])])
        self.server, self.task, port = await _Server.start(self.app, host)
        self.loop, self.url = asyncio.get_running_loop(), f"http://{host}:{port}"
        return self

    async def dispatch(self, method: str, path: str, raw: bytes) -> tuple:
        """``/s/<id>/v1/<route>`` -> (HTTP status, JSON bytes)."""
        parts = path.split("/", 4)
        sid, route = (parts[2], parts[4]) if len(parts) == 5 and parts[3] == "v1" else ("", "")
        session = self.sessions.get(sid)
        if session is None:
            return _error(404, "no such session (it ended with its sample)")
        if (method, route) == ("GET", "models"):
            return 200, json.dumps({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                                "owned_by": "slime_hydra"}]}).encode()
        call = {("POST", "chat/completions"): "chat_completion", ("POST", "completions"): "completion"}.get(
            (method, route))
        if call is None:
            return _error(404, f"no route {method} /v1/{route}")
        try:
            return 200, json.dumps(await session.call(call, json.loads(raw))).encode()
        except (RequestError, json.JSONDecodeError, KeyError, TypeError) as e:
            return _error(400, f"{type(e).__name__}: {e}" if not isinstance(e, RequestError) else str(e))

    def client(self, url: str, sync: bool = False) -> Any:
        """An ``AsyncOpenAI`` (``sync``: an ``OpenAI``, for an agent in a thread) on ``url`` calling :meth:`dispatch`
        in process (no socket, no HTTP parsing, no ASGI; no retries: a refused request must not be sent twice)."""
        import httpx
        import openai

        if sync:
            if self.sync_http is None:
                self.sync_http = httpx.Client(transport=_transport(sync=True)(self), timeout=None)
            return openai.OpenAI(base_url=url, api_key="slime_hydra", http_client=self.sync_http, max_retries=0)
        if self.http is None:
            self.http = httpx.AsyncClient(transport=_transport()(self), timeout=None)
        return openai.AsyncOpenAI(base_url=url, api_key="slime_hydra", http_client=self.http, max_retries=0)

    async def in_thread(self, slots: int, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in a daemon thread of its own (one that outlives its timeout cannot hold up the process's
        exit), at most ``slots`` at once."""
        import threading

        loop, done = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()

        def settle(result: Any, error: Optional[BaseException]) -> None:
            if not done.done():
                done.set_result(result) if error is None else done.set_exception(error)

        def target() -> None:
            try:
                out = fn(*args), None
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                out = None, e
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                loop.call_soon_threadsafe(settle, *out)

        if self.slots is None:
            self.slots = asyncio.Semaphore(slots)
        async with self.slots:
            threading.Thread(target=target, daemon=True, name="agent").start()
            return await done

    async def aclose(self) -> None:
        self.server.should_exit = True
        await self.task
        if self.http is not None:
            await self.http.aclose()
        if self.sync_http is not None:
            self.sync_http.close()


def _error(status: int, message: str) -> tuple:
    return status, json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                         "code": None}}).encode()


def _transport(sync: bool = False) -> type:
    """httpx transports that hand a request to :meth:`Endpoint.dispatch`; the sync one, from an agent's thread, on
    the endpoint's loop."""
    import httpx

    class InProcess(httpx.AsyncBaseTransport):
        def __init__(self, ep: Endpoint):
            self.ep = ep

        async def handle_async_request(self, request: Any) -> Any:
            status, body = await self.ep.dispatch(request.method, request.url.path, await request.aread())
            return httpx.Response(status, content=body, headers={"content-type": "application/json"})

    class InProcessSync(httpx.BaseTransport):
        def __init__(self, ep: Endpoint):
            self.ep = ep

        def handle_request(self, request: Any) -> Any:
            call = self.ep.dispatch(request.method, request.url.path, request.read())
            status, body = asyncio.run_coroutine_threadsafe(call, self.ep.loop).result()
            return httpx.Response(status, content=body, headers={"content-type": "application/json"})
    return InProcessSync if sync else InProcess


async def endpoint(ctx: Any) -> Endpoint:
    """The running loop's endpoint, started on first use."""
    ep = getattr(ctx, "endpoint", None)
    if ep is None or ep.loop is not asyncio.get_running_loop():
        r = ctx.cfg.rollout
        parser = r.tool_parser or tool_calls.guess(getattr(ctx.tokenizer, "chat_template", None))
        ep = ctx.endpoint = await Endpoint(ctx.tokenizer, ctx.cfg.model.name or "slime_hydra", parser).start()
        log.info("agent endpoint at %s/s/<session>/v1 (tool parser %s)", ep.url, parser)
    return ep


def _calling(agent: Any) -> tuple:
    """(whether its first parameter is ``client``, whether it is an ``async def``: through ``functools.partial``, or
    an object's ``__call__``), read once per agent (each time for an unhashable one)."""
    try:
        return _read_calling(agent)
    except TypeError:  # unhashable
        return _read_calling.__wrapped__(agent)


@functools.lru_cache(maxsize=64)
def _read_calling(agent: Any) -> tuple:
    params = list(inspect.signature(agent).parameters)
    fn = agent
    while isinstance(fn, functools.partial):
        fn = fn.func
    return bool(params) and params[0] == "client", inspect.iscoroutinefunction(
        fn if inspect.isroutine(fn) else type(fn).__call__)


def agent_input(sample: Sample) -> Dict[str, Any]:
    """What the agent sees of its sample: plain data."""
    return {"prompt": sample.prompt, "label": sample.label, "index": sample.index,
            "metadata": {k: v for k, v in sample.metadata.items() if k != "start_rollout_id"}}


async def generate(ctx: Any, sample: Sample, sampling_params: Dict[str, Any], evaluation: bool = False, *,
                   agent: Any) -> Sample:
    """The generate function behind ``rollout.agent``: one session, the agent, its reward."""
    import traceback

    ep = await endpoint(ctx)
    restart(sample)  # a sample aborted in an earlier rollout starts over
    session = Session(ep, ctx, sample, sampling_params)
    ep.sessions[session.id] = session
    timeout, (wants_client, is_async) = ctx.cfg.rollout.agent_timeout, _calling(agent)
    try:
        where = ep.client(session.url, sync=not is_async) if wants_client else session.url
        call = (agent(where, agent_input(sample)) if is_async
                else ep.in_thread(ctx.cfg.rollout.concurrency, agent, where, agent_input(sample)))
        reward = await asyncio.wait_for(call, timeout)
        if inspect.isawaitable(reward):
            raise TypeError("rollout.agent is a plain def that returned a coroutine: declare it `async def` (a plain "
                            "def runs in a thread, with a synchronous client)")
        if reward is not None and not isinstance(reward, (int, float, dict)):
            raise TypeError(f"rollout.agent returned {type(reward).__name__}; expected a float, a dict or None")
    except Exception as e:  # the sample ends, never the run
        reward = None
        if not session.aborted and sample.status != Status.TRUNCATED:
            what = (f"outlived rollout.agent_timeout={timeout}s" if isinstance(e, asyncio.TimeoutError)
                    else f"raised {type(e).__name__}: {e}")
            log.warning("%s: the agent %s; the sample fails\n%s", sample.identity(), what, traceback.format_exc())
            counters.count("agent_timeout" if isinstance(e, asyncio.TimeoutError) else "agent_error",
                           f"{sample.identity()}: the agent {what}")
            sample.status, sample.reward = Status.FAILED, 0.0
    finally:
        del ep.sessions[session.id]
        await session.close()
    if session.aborted:
        restart(sample)
        sample.status = Status.ABORTED
        return sample
    if not sample.tokens:  # the agent never asked: the sample holds its prompt
        try:
            prompt = render(ctx.tokenizer, initial_messages(sample), add_generation_prompt=True)
        except ValueError:  # no chat template
            prompt = sample.prompt if isinstance(sample.prompt, str) else json.dumps(sample.prompt)
        sample.tokens = ctx.encode(prompt)
        sample.metadata.update(messages=initial_messages(sample), num_turns=0)
        if sample.status == Status.PENDING:
            sample.status, sample.reward = Status.FAILED, 0.0
            counters.count("agent_no_request", f"{sample.identity()}: the agent returned without a request")
    if sample.status == Status.PENDING:
        sample.status = Status.COMPLETED
    if reward is not None and sample.status != Status.FAILED:
        sample.reward = float(reward) if not isinstance(reward, dict) else reward
    return sample


def load_agent(cfg: Any) -> Any:
    """``rollout.agent`` -> the agent callable."""
    from slime_hydra.utils.hooks import load_hook

    if cfg.rollout.agent == "verifiers":
        from slime_hydra.rollout import verifiers_env

        return verifiers_env.agent(cfg)
    return load_hook(cfg.rollout.agent)


def agent_generate(cfg: Any) -> Any:
    """The generate function of ``rollout.agent``."""
    return functools.partial(generate, agent=load_agent(cfg))
