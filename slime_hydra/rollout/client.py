"""HTTP calls to SGLang-protocol servers (SGLang itself, the embedded engine, sglang-router).

Control calls are synchronous httpx calls (the trainer and the manager make few of them);
``/generate`` goes through one shared aiohttp session with retries, like slime's http_utils.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict, Optional

import httpx

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    pass


_http: Optional[httpx.Client] = None


def _client() -> httpx.Client:
    """One client per process for control calls: building an httpx client loads the TLS
    certificates (about 25 ms, measured), which made each weight push's four calls cost 0.1 s."""
    global _http
    if _http is None:
        _http = httpx.Client()
    return _http


def control(url: str, path: str, payload: Optional[Dict[str, Any]] = None, *, method: str = "POST",
            timeout: float = 600.0) -> Any:
    """One control call; raises EngineError on a transport error, a non-2xx status or success=false."""
    try:
        r = _client().request(method, url.rstrip("/") + path, json=payload if method != "GET" else None,
                              timeout=timeout)
    except httpx.HTTPError as e:
        raise EngineError(f"{method} {url}{path} failed: {e!r}") from e
    body: Any = None
    if r.content:
        try:
            body = r.json()
        except ValueError:
            body = r.text
    if r.status_code >= 300 or (isinstance(body, dict) and body.get("success") is False):
        raise EngineError(f"{method} {url}{path} -> HTTP {r.status_code}: {body}")
    return body


# /generate timeouts. A reply (the whole response: it is not streamed) may take hours under load, so
# the read timeout only catches an engine that hangs (the manager's watchdog catches a dead one within
# seconds); the manager passes rollout.router.request_timeout_secs, when the router gives up too.
READ_TIMEOUT_S = 14400.0
CONNECT_TIMEOUT_S = 30.0  # a server that is up accepts in milliseconds


def weight_version(url: str) -> str:
    return str(control(url, "/get_weight_version", method="GET", timeout=30)["weight_version"])


class GenerateClient:
    """POST /generate with retries on transport errors and 5xx (not on 4xx: those are our bugs, nor
    on a read timeout: the engine may still be working on it).

    aiohttp, not httpx: with hundreds of concurrent requests httpx's connection pool dominated a
    rollout (256 tiny requests: 2-7 s with httpx, 0.2-0.35 s with aiohttp, same server)."""

    def __init__(self, base_url: str, concurrency: int, retries: int = 60, retry_interval: float = 1.0,
                 read_timeout: float = READ_TIMEOUT_S):
        import aiohttp

        self.base_url = base_url.rstrip("/")
        self.sem = asyncio.Semaphore(concurrency)
        self.retries = retries
        self.retry_interval = retry_interval
        self.read_timeout = read_timeout
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                          timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                                                        sock_read=read_timeout))

    async def post(self, path: str, payload: Dict[str, Any]) -> Any:
        import aiohttp

        last: Any = None
        async with self.sem:
            for attempt in range(self.retries + 1):
                try:
                    async with self.http.post(self.base_url + path, json=payload) as r:
                        if r.status < 400:
                            return await r.json(content_type=None)
                        text = await r.text()
                        if r.status < 500:
                            raise EngineError(f"POST {self.base_url}{path} -> HTTP {r.status}: {text[:500]}")
                        last = f"HTTP {r.status}: {text[:200]}"
                except aiohttp.SocketTimeoutError as e:
                    raise EngineError(f"POST {self.base_url}{path}: no reply within {self.read_timeout:g}s "
                                      f"({e!r})") from e
                except aiohttp.ClientError as e:
                    last = repr(e)
                if attempt < self.retries:
                    log.warning("POST %s%s failed (%s); retry %d/%d", self.base_url, path, last, attempt + 1, self.retries)
                    await asyncio.sleep(self.retry_interval)
        raise EngineError(f"POST {self.base_url}{path} failed after {self.retries} retries: {last}")

    async def aclose(self) -> None:
        await self.http.close()
