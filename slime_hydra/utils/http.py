"""Control calls to SGLang-protocol servers (SGLang, the embedded engine, sglang-router): synchronous
httpx requests, few per step (flush, abort, memory, weight updates), for the rollout side and the
trainer's weight sender alike. ``/generate`` has its own async client (``rollout.client``)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import httpx


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


def control(
    url: str, path: str, payload: Optional[Dict[str, Any]] = None, *, method: str = "POST", timeout: float = 600.0
) -> Any:
    """One control call; raises EngineError on a transport error, a non-2xx status or success=false."""
    try:
        r = _client().request(
            method, url.rstrip("/") + path, json=payload if method != "GET" else None, timeout=timeout
        )
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


def weight_version(url: str) -> str:
    """The weight version the server runs (SGLang 0.5.17 reports it in ``/model_info``; its older
    ``/get_weight_version`` answers 404 there)."""
    return str(control(url, "/model_info", method="GET", timeout=30)["weight_version"])
