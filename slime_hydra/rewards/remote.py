"""Remote reward: POST the sample to a reward server, with retries and exponential backoff. One
``httpx.AsyncClient`` per event loop (a client is bound to the loop that opened its connections)."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Dict, Optional, Union

import httpx

BACKOFF_S = 0.5  # first retry delay; doubles each retry
MAX_BACKOFF_S = 10.0
_clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient]" = weakref.WeakKeyDictionary()


class RewardError(RuntimeError):
    """A reward that cannot be computed (server down, bad answer, bad hook)."""


def shared_client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None or client.is_closed:
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=512, max_keepalive_connections=64))
        _clients[loop] = client
    return client


async def aclose_shared_client() -> None:
    """Close the running loop's client (call before the loop ends to release its sockets)."""
    client = _clients.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()


async def remote_reward(url: str, payload: Dict[str, Any], *, timeout_s: float, max_retries: int,
                        backoff_s: Optional[float] = None) -> Union[float, Dict[str, Any]]:
    """POST ``payload`` to ``url``; the JSON answer is a number (returned as float) or an object.
    Connection errors, timeouts, 5xx, 408 and 429 are retried ``max_retries`` times; other 4xx are not."""
    client, last = shared_client(), "none"
    backoff_s = BACKOFF_S if backoff_s is None else backoff_s
    for attempt in range(max_retries + 1):
        if attempt:
            await asyncio.sleep(min(backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
        try:
            r = await client.post(url, json=payload, timeout=timeout_s)
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}".rstrip(": ")
            continue
        except TypeError as e:  # the payload is not JSON-serialisable
            raise RewardError(f"remote reward {url}: cannot send the sample as JSON: {e}") from e
        if r.status_code >= 500 or r.status_code in (408, 429):
            last = f"HTTP {r.status_code}: {r.text[:200]}"
            continue
        if r.status_code >= 400:
            raise RewardError(f"remote reward {url}: HTTP {r.status_code} (not retried): {r.text[:500]}")
        return _check_answer(url, r)
    raise RewardError(f"remote reward {url}: no answer after {max_retries + 1} attempts "
                      f"(timeout {timeout_s}s each); last failure: {last}")


def _check_answer(url: str, r: httpx.Response) -> Union[float, Dict[str, Any]]:
    try:
        value = r.json()
    except ValueError:
        raise RewardError(f"remote reward {url}: the answer is not JSON: {r.text[:200]!r}") from None
    if isinstance(value, dict):
        return value
    if isinstance(value, (int, float)):  # bool included: true/false -> 1.0/0.0
        return float(value)
    raise RewardError(f"remote reward {url}: expected a JSON number or object, got {type(value).__name__}: "
                      f"{str(value)[:200]}")
