"""The rollout client when the server closes a pooled connection as the next request arrives. SGLang's uvicorn
closes connections idle for 5 s; when a step's training and weight sync take about that long (the Qwen3-4B shape
on the H200), the next rollout's requests race the close and fail with "Server disconnected": each was retried
after a logged warning and a sleep, 1.5 s of that step. The request must go again at once, on a new connection.

The server here answers the first request of every connection (keep-alive) and closes the connection when a
second request comes on it: the race, made deterministic. A server that dies with a request closes its connection in
the same way; that request goes again at once to the same server, is refused there, and the fleet is asked whether
its engine failed (fault tolerance re-queues and counts it), not sent silently to another engine."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

from slime_hydra.rollout.client import GenerateClient


def _serve(sock: socket.socket) -> None:
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        threading.Thread(target=_connection, args=(conn,), daemon=True).start()


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return body


def _connection(conn: socket.socket) -> None:
    with conn:
        body = _read_request(conn)
        if not body:
            return
        reply = json.dumps({"text": "ok", "echo": json.loads(body)["text"]}).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(reply), reply))
        _read_request(conn)  # the next request on this connection: closed unanswered (the keep-alive race)


async def _rollout(client: GenerateClient, texts):
    return await asyncio.gather(*(client.post("/generate", {"text": t}) for t in texts))


async def _client(url: str) -> GenerateClient:
    return GenerateClient(url, concurrency=4, retries=2, retry_interval=5.0)


def test_a_connection_closed_as_the_request_arrives_is_tried_again_at_once(caplog):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    threading.Thread(target=_serve, args=(sock,), daemon=True).start()
    loop = asyncio.new_event_loop()
    try:
        client = loop.run_until_complete(_client(f"http://127.0.0.1:{sock.getsockname()[1]}"))
        caplog.set_level(logging.WARNING, logger="slime_hydra.rollout.client")
        for i in range(3):  # rollouts 2 and 3 find every pooled connection closed on them
            t0 = time.monotonic()
            out = loop.run_until_complete(_rollout(client, [f"{i}-{j}" for j in range(4)]))
            assert [o["echo"] for o in out] == [f"{i}-{j}" for j in range(4)]
            assert time.monotonic() - t0 < 3.0  # a logged retry sleeps retry_interval (5 s) first
        assert not [r for r in caplog.records if "retry" in r.getMessage()], caplog.text
        loop.run_until_complete(client.aclose())
    finally:
        loop.close()
        sock.close()


def test_a_request_whose_engine_died_with_it_is_asked_about():
    """An engine the fleet killed (SIGSTOPped, then taken out) with a group request on it: the request's
    connection closes unanswered and its port is gone. The fleet is asked about it (with the time it was
    first sent), and it goes again once the fleet says so, to the engine that serves."""
    dying, alive = socket.socket(), socket.socket()
    for sock in (dying, alive):
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
    threading.Thread(target=_serve, args=(alive,), daemon=True).start()
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in (dying, alive)]
    asked = []

    def die() -> None:
        conn, _ = dying.accept()
        _read_request(conn)
        dying.close()  # killed with the request: its port refuses connections,
        conn.close()  # and the request's connection closes unanswered

    picks = []

    async def engine_url() -> str:  # the dying engine first; once it is out, the one that serves
        picks.append(urls[min(len(picks), 1)])
        return picks[-1]

    async def requeue(sent: float) -> bool:
        asked.append(sent)
        return True

    async def scenario():
        client = GenerateClient(urls[0], concurrency=4, retries=0, requeue=requeue, engine_url=engine_url)
        try:
            t0 = time.monotonic()
            out = await client.post("/generate", {"text": ["a group"]})
            return t0, out
        finally:
            await client.aclose()

    threading.Thread(target=die, daemon=True).start()
    try:
        t0, out = asyncio.run(scenario())
    finally:
        alive.close()
    assert out["echo"] == ["a group"]
    assert len(asked) == 1 and t0 <= asked[0] < t0 + 1.0  # asked once, about its first send
    assert picks == urls  # sent again to the dying engine's port only on a new connection, not picked again


def test_a_closed_connection_does_not_pick_another_engine():
    """Batched requests over two engines: rollouts 2 and 3 find every pooled connection closed, and each request
    goes again to the engine it was sent to (one pick a request), at once."""
    socks = [socket.socket(), socket.socket()]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        threading.Thread(target=_serve, args=(sock,), daemon=True).start()
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    picks = []

    async def engine_url() -> str:
        picks.append(urls[len(picks) % 2])
        return picks[-1]

    async def scenario():
        client = GenerateClient(urls[0], concurrency=4, retries=2, retry_interval=5.0, engine_url=engine_url)
        try:
            for i in range(3):
                t0 = time.monotonic()
                out = await _rollout(client, [[f"{i}-{j}"] for j in range(4)])
                assert [o["echo"] for o in out] == [[f"{i}-{j}"] for j in range(4)]
                assert time.monotonic() - t0 < 3.0  # a logged retry sleeps retry_interval (5 s) first
        finally:
            await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        for sock in socks:
            sock.close()
    assert len(picks) == 12, picks  # 3 rollouts x 4 requests, none picked again
