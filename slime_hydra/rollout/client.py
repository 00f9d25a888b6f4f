"""``/generate`` calls to SGLang-protocol servers (SGLang, the embedded engine, sglang-router) through one
shared aiohttp session with retries, like slime's http_utils. SGLang's batched ``/generate`` (one request per
group) goes straight to an engine: sglang-router answers 422 to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Dict, Optional

from slime_hydra.utils.http import EngineError

log = logging.getLogger(__name__)

# a reply (not streamed) may take hours under load: the read timeout only catches an engine that hangs
READ_TIMEOUT_S = 14400.0
CONNECT_TIMEOUT_S = 30.0  # a server that is up accepts in milliseconds


def is_batch(payload: Dict[str, Any]) -> bool:
    """SGLang's batched /generate: a list of prompts (``input_ids`` of lists, or ``text`` a list)."""
    ids = payload.get("input_ids")
    return isinstance(payload.get("text"), list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))


class GenerateClient:
    """POST /generate with retries on transport errors and 5xx (not on 4xx, nor on a read timeout).
    ``engine_url`` (async) names the engine for a batched /generate (:func:`is_batch`), asked at every attempt
    but after a pooled connection closed unanswered (then the same server again, on a new connection)."""

    def __init__(self, base_url: str, concurrency: int, retries: int = 60, retry_interval: float = 1.0,
                 read_timeout: float = READ_TIMEOUT_S, requeue: Optional[Callable[[float], Awaitable[bool]]] = None,
                 engine_url: Optional[Callable[[], Awaitable[str]]] = None):
        import aiohttp

        self.base_url = base_url.rstrip("/")
        self.sem = asyncio.Semaphore(concurrency)
        self.retries, self.retry_interval, self.read_timeout = retries, retry_interval, read_timeout
        # EngineFleet.requeue(sent_at): True when a failed request's engine failed (sent again, not a retry)
        self.requeue, self.engine_url = requeue, engine_url
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=read_timeout)
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout)
        # for a request whose pooled connection the server had closed (the pool could give another such one)
        self.fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency, force_close=True),
                                           timeout=timeout)

    async def post(self, path: str, payload: Dict[str, Any]) -> Any:
        import aiohttp

        last: Any = None
        attempt, session, again = 0, self.http, False
        direct = self.engine_url is not None and path == "/generate" and is_batch(payload)
        async with self.sem:
            while True:
                if not again:
                    base = await self.engine_url() if direct else self.base_url
                    sent = time.monotonic()
                again = False
                try:
                    async with session.post(base + path, json=payload) as r:
                        if r.status < 400:
                            return await r.json(content_type=None)
                        text = await r.text()
                        if r.status < 500:
                            raise EngineError(f"POST {base}{path} -> HTTP {r.status}: {text[:500]}")
                        last = f"HTTP {r.status}: {text[:200]}"
                except aiohttp.SocketTimeoutError as e:
                    raise EngineError(f"POST {base}{path}: no reply within {self.read_timeout:g}s ({e!r})") from e
                except aiohttp.ServerDisconnectedError as e:
                    last = repr(e)
                    if session is self.http:  # a pooled connection closed while idle: again, to the same server
                        log.debug("POST %s%s: the connection closed unanswered (%s); again on a new one", base, path,
                                  last)
                        session, again = self.fresh, True
                        continue
                except aiohttp.ClientError as e:
                    last = repr(e)
                if self.requeue is not None and await self.requeue(sent):
                    continue
                if attempt >= self.retries:
                    break
                attempt += 1
                log.warning("POST %s%s failed (%s); retry %d/%d", base, path, last, attempt, self.retries)
                await asyncio.sleep(self.retry_interval)
        raise EngineError(f"POST {base}{path} failed after {self.retries} retries: {last}")

    async def aclose(self) -> None:
        await self.http.close()
        await self.fresh.close()
