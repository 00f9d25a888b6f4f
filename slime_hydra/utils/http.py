"""Control calls to SGLang-protocol servers (SGLang, the embedded engine, sglang-router): synchronous
requests, few per step (flush, abort, memory, weight updates), for the rollout side and the
trainer's weight sender alike. ``/generate`` has its own async client (``rollout.client``)."""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

import urllib3


class EngineError(RuntimeError):
    pass


class EngineUnreachable(EngineError):
    """No answer at all (connection refused or reset, a timeout): the server is dead or hung, not busy."""


_pool: Optional[urllib3.PoolManager] = None


def _client() -> urllib3.PoolManager:
    """One connection pool per process for control calls, urllib3's: it sends a request's headers
    and body in one write, where httpx's two writes wake the server twice."""
    global _pool
    if _pool is None:
        _pool = urllib3.PoolManager(maxsize=16, retries=False)
    return _pool


def control(
    url: str, path: str, payload: Optional[Dict[str, Any]] = None, *, method: str = "POST", timeout: float = 600.0
) -> Any:
    """One control call; raises EngineError on a non-2xx status or success=false, EngineUnreachable on a
    transport error."""
    body = json.dumps(payload).encode() if payload is not None and method != "GET" else None
    headers = {"Content-Type": "application/json"} if body is not None else None
    try:
        r = _client().request(method, url.rstrip("/") + path, body=body, headers=headers, timeout=timeout)
    except urllib3.exceptions.HTTPError as e:
        raise EngineUnreachable(f"{method} {url}{path} failed: {e!r}") from e
    answer: Any = None
    if r.data:
        try:
            answer = json.loads(r.data)
        except ValueError:
            answer = r.data.decode(errors="replace")
    if r.status >= 300 or (isinstance(answer, dict) and answer.get("success") is False):
        raise EngineError(f"{method} {url}{path} -> HTTP {r.status}: {answer}")
    return answer


def weight_version(url: str, timeout: float = 30.0) -> str:
    """The weight version the server runs (SGLang 0.5.17 reports it in ``/model_info``; its older
    ``/get_weight_version`` answers 404 there)."""
    return str(control(url, "/model_info", method="GET", timeout=timeout)["weight_version"])
