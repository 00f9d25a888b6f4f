"""Remote reward against real local HTTP servers: success, flaky (fails twice), down, slow, rejected."""

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slime_hydra.config.schema import RewardConfig
from slime_hydra.data.sample import Sample
from slime_hydra.rewards import RewardError, aclose_shared_client, compute_reward, remote


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):  # keep test output quiet
        pass

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv.requests.append(body)
        mode = self.path.strip("/")
        if mode == "flaky" and len(srv.requests) <= 2:
            return self.reply(503, b'{"error": "warming up"}')
        if mode == "slow":
            time.sleep(0.5)
        if mode == "reject":
            return self.reply(422, b'{"detail": "label missing"}')
        if mode == "dict":
            return self.reply(200, json.dumps({"score": 0.25, "len": len(body["response"])}).encode())
        if mode == "text":
            return self.reply(200, b"not json")
        self.reply(200, json.dumps(1.0 if body["response"] == body["label"] else 0.0).encode())

    def reply(self, code, data):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # the default backlog of 5 drops concurrent connects (1 s SYN retry)

    def handle_error(self, request, client_address):
        pass  # the slow handler writes after the client gave up: a broken pipe, expected


@pytest.fixture
def server():
    srv = Server(("127.0.0.1", 0), Handler)
    srv.requests = []
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)


def score(cfg, sample):
    async def main():
        try:
            return await compute_reward(cfg, sample)
        finally:
            await aclose_shared_client()

    return asyncio.run(main())


def sample(resp="42", label="42"):
    return Sample(prompt="q?", response=resp, label=label, metadata={"rm_type": "remote", "k": 1})


def test_number_and_payload(server):
    srv, url = server
    cfg = RewardConfig(type="exact", url=url + "/ok", timeout_s=2, max_retries=0)  # rm_type in metadata wins
    assert score(cfg, sample()) == 1.0 and score(cfg, sample("41")) == 0.0
    assert srv.requests[0] == {
        "prompt": "q?",
        "response": "42",
        "label": "42",
        "metadata": {"rm_type": "remote", "k": 1},
    }


def test_dict_answer(server):
    _, url = server
    r = score(RewardConfig(type="remote", url=url + "/dict", key="score"), sample("abc"))
    assert r == {"score": 0.25, "len": 3}


def test_fails_twice_then_succeeds(server):
    srv, url = server
    assert score(RewardConfig(type="remote", url=url + "/flaky", timeout_s=2, max_retries=3), sample()) == 1.0
    assert len(srv.requests) == 3


def test_stays_down_names_url_and_last_failure():
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/rm"
    cfg = RewardConfig(type="remote", url=url, timeout_s=0.5, max_retries=2)
    with pytest.raises(RewardError) as e:
        score(cfg, sample())
    msg = str(e.value)
    assert url in msg and "after 3 attempts" in msg and "ConnectError" in msg


def test_slow_server_times_out(server):
    srv, url = server
    with pytest.raises(RewardError, match=r"after 2 attempts \(timeout 0.1s each\); last failure: ReadTimeout"):
        score(RewardConfig(type="remote", url=url + "/slow", timeout_s=0.1, max_retries=1), sample())


def test_rejections_are_not_retried(server):
    srv, url = server
    with pytest.raises(RewardError, match=r"HTTP 422 \(not retried\).*label missing"):
        score(RewardConfig(type="remote", url=url + "/reject", max_retries=3), sample())
    assert len(srv.requests) == 1
    with pytest.raises(RewardError, match="not JSON"):
        score(RewardConfig(type="remote", url=url + "/text", max_retries=0), sample())


def test_missing_url():
    with pytest.raises(RewardError, match="needs reward.url"):
        score(RewardConfig(type="remote"), sample())


def test_shared_client_per_loop(server):
    _, url = server
    cfg = RewardConfig(type="remote", url=url + "/ok", max_retries=0)

    async def main():
        c = remote.shared_client()
        await asyncio.gather(*(compute_reward(cfg, sample()) for _ in range(8)))
        same = remote.shared_client() is c
        await aclose_shared_client()
        return same

    assert asyncio.run(main())
    assert asyncio.run(main())  # a second loop gets its own client
