"""Control calls to SGLang-protocol servers (flush, abort, memory, weight updates): synchronous, few per
step. ``/generate`` has its own async client (``rollout.client``)."""

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
    """One urllib3 pool per process: it sends headers and body in one write (httpx's two wake the server twice)."""
    global _pool
    if _pool is None:
        _pool = urllib3.PoolManager(maxsize=16, retries=False)
    return _pool


def control(url: str, path: str, payload: Optional[Dict[str, Any]] = None, *, method: str = "POST",
            timeout: float = 600.0) -> Any:
    """One control call; EngineError on a non-2xx status or success=false, EngineUnreachable on no answer."""
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
    """The weight version the server runs (``/model_info``'s; SGLang's ``/get_weight_version`` is gone)."""
    return str(control(url, "/model_info", method="GET", timeout=timeout)["weight_version"])
