"""The engine fleet (slime_hydra/rollout/fleet.py) over engines it did not start, so without Ray: its
addresses, and against real embedded engines, sglang-router registration, aborts, the colocated
memory calls, and two engines behind the router taking requests (group requests straight to them)
and weight pushes over every transport that runs on CPU. (Watching engine actors:
test_engine_watchdog.py.)"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
import torch

from slime_hydra.config.schema import RouterConfig
from slime_hydra.rollout.client import GenerateClient
from slime_hydra.rollout.fleet import EngineFleet
from slime_hydra.rollout.health import EngineHandle

LONG = {"input_ids": [3, 4, 5, 12], "sampling_params": {"max_new_tokens": 100000, "ignore_eos": True},
        "return_logprob": True}


def test_addresses_without_router():
    a, b = "http://10.0.0.1:30000", "http://10.0.0.2:30000"
    fleet = EngineFleet([EngineHandle(0, a, gpus=2), EngineHandle(1, b, gpus=2)])
    assert fleet.urls == [a, b] and fleet.base_url == a
    assert fleet.endpoints() == [{"url": a, "gpus": 2, "first_gpu": 0}, {"url": b, "gpus": 2, "first_gpu": 0}]

    async def work():
        return 7

    assert asyncio.run(fleet.watched(work())) == 7  # no actors to watch: awaited as it is

    async def picks(n):
        return [await fleet.engine_url() for _ in range(n)]

    assert sorted(asyncio.run(picks(4))) == [a, a, b, b]  # group requests: round robin over the engines
    assert fleet.dead_engines() == []
    fleet.shutdown()  # nothing it started


@pytest.mark.integration
def test_router_and_abort(engine_url, tmp_path):
    fleet = EngineFleet([EngineHandle(0, engine_url)])
    fleet.start_router(RouterConfig(policy="round_robin"), str(tmp_path / "router.log"))
    router = fleet.router
    try:
        assert fleet.base_url == router.url != engine_url
        assert [w["url"] for w in router.workers()] == [engine_url]

        async def cut_off():
            client = GenerateClient(fleet.base_url, 4)
            try:
                request = asyncio.ensure_future(client.post("/generate", LONG))
                await asyncio.sleep(1.0)
                assert not request.done()
                await fleet.abort()
                return await asyncio.wait_for(request, 30)
            finally:
                await client.aclose()

        out = asyncio.run(cut_off())  # through the router, cut off on the engine
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(out["output_ids"]) < 100000
    finally:
        fleet.shutdown()
    assert router.proc.poll() is not None  # the router is gone, the engine it served is not
    assert httpx.get(engine_url + "/health").status_code == 200


@contextlib.contextmanager
def embedded_engines(ckpt: str, log_dir, count: int):
    """``count`` embedded engine servers of ``ckpt`` (seeds 0, 1, ... as a fleet gives them), as the
    conftest's ``engine_url`` starts one; yields their URLs."""
    from slime_hydra.rollout.engines import ServerSpec
    from slime_hydra.rollout.engines.embedded import EmbeddedEngine
    from slime_hydra.utils.proc import free_port, kill_tree, spawn, wait_http

    procs, urls = [], []
    try:
        for i in range(count):
            spec = ServerSpec(engine="embedded", model_path=ckpt, tokenizer_path=ckpt, dtype="float32", device="cpu",
                              gpus=1, seed=i, num_threads=1)
            port, log = free_port(), str(log_dir / f"engine_{i}.log")
            procs.append(spawn(EmbeddedEngine(spec).command("127.0.0.1", port), log))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url, i in zip(procs, urls, range(count)):
            wait_http(url + "/health_generate", proc, 120, str(log_dir / f"engine_{i}.log"))
        yield urls
    finally:
        for proc in procs:
            kill_tree(proc)


def served(url: str) -> int:
    """Generate requests the engine has run (its recent batches' sizes; it keeps the last 64)."""
    batches = httpx.get(url + "/server_info", timeout=30).json()["internal_states"][0]["recent_batches"]
    assert len(batches) < 64, "the engine forgot older batches: count with fewer requests"
    return sum(b["size"] for b in batches)


def greedy(url: str, prompt, tokens: int) -> list:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def local_greedy(model, prompt, tokens: int) -> list:
    """Greedy decoding with the model in this process, one full forward per token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(tokens):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def group_requests(fleet: EngineFleet, prompt) -> list:
    """Four groups of two samples in SGLang's batched form: the router refuses it (its /generate reads
    one sampling_params object and one rid: 422), the client sends it to ``fleet.engine_url``.
    Returns how many samples each engine ran."""
    def group(k):
        return {"input_ids": [prompt] * 2, "rid": [f"g{k}-0", f"g{k}-1"], "return_logprob": True,
                "sampling_params": [{"max_new_tokens": 2, "sampling_seed": 2 * k + i} for i in range(2)]}

    r = httpx.post(fleet.base_url + "/generate", json=group(0), timeout=60)
    assert r.status_code == 422 and "Failed to deserialize" in r.text, (r.status_code, r.text)
    before = [served(u) for u in fleet.urls]

    async def send():
        client = GenerateClient(fleet.base_url, 8, engine_url=fleet.engine_url)
        try:
            return await asyncio.gather(*(client.post("/generate", group(k)) for k in range(4)))
        finally:
            await client.aclose()

    outs = asyncio.run(send())
    assert [[o["meta_info"]["id"] for o in out] for out in outs] == [[f"g{k}-0", f"g{k}-1"] for k in range(4)]
    return [served(u) - b for u, b in zip(fleet.urls, before)]


@pytest.mark.integration
def test_two_engines_behind_the_router_share_requests_and_weights(tiny_ckpt, tmp_path):
    """Two engines behind the real sglang-router (round robin): requests reach both (a group's batched
    request goes straight to one, round robin too: the router cannot forward it); then weights
    are pushed to both over each transport that runs on CPU (gloo broadcast, shared-memory handles,
    safetensors on disk), each push different, and after each both engines report its version and
    decode a prompt greedily to the same tokens as the pushed model does here, directly and through
    the router."""
    from transformers import AutoModelForCausalLM

    from slime_hydra.sync.sender import Endpoint, WeightSender
    from slime_hydra.utils.http import weight_version

    prompt, tokens = [5, 12, 3, 9, 4, 12], 6  # token ids of the builtin:digits vocabulary
    with embedded_engines(tiny_ckpt, tmp_path, 2) as urls:
        fleet = EngineFleet([EngineHandle(i, u) for i, u in enumerate(urls)])
        fleet.start_router(RouterConfig(policy="round_robin"), str(tmp_path / "router.log"))
        try:
            assert sorted(w["url"] for w in fleet.router.workers()) == sorted(urls)
            before = [served(u) for u in urls]
            first = {tuple(greedy(fleet.base_url, prompt, tokens)) for _ in range(8)}
            counts = [served(u) - b for u, b in zip(urls, before)]
            assert counts == [4, 4], counts  # round robin: half each
            assert len(first) == 1  # the same checkpoint on both
            assert group_requests(fleet, prompt) == [4, 4]
            previous = first.pop()
            for version, transport in enumerate(["distributed", "tensor", "disk"], start=1):
                # noise at 3x the initial std (0.02): each push decodes the prompt differently
                model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
                gen = torch.Generator().manual_seed(version)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen) * 0.06)
                expected = local_greedy(model, prompt, tokens)
                assert expected != list(previous), "the push would not change the output: perturb more"
                sender = WeightSender(transport, [Endpoint(**e) for e in fleet.endpoints()], torch.device("cpu"),
                                      bucket_mb=1, disk_dir=str(tmp_path / "push"), model_path=tiny_ckpt)
                sender.connect()
                try:
                    sender.push(list(model.state_dict().items()), version=version)
                finally:
                    sender.close()
                assert [weight_version(u) for u in urls] == [str(version)] * 2, transport
                assert [greedy(u, prompt, tokens) for u in urls] == [expected] * 2, transport
                before = [served(u) for u in urls]
                assert [greedy(fleet.base_url, prompt, tokens) for _ in range(4)] == [expected] * 4, transport
                assert [served(u) - b for u, b in zip(urls, before)] == [2, 2], transport
                previous = expected
        finally:
            fleet.shutdown()


@pytest.mark.integration
def test_offload_and_onload(engine_url):
    fleet = EngineFleet([EngineHandle(0, engine_url)])
    fleet.offload()
    assert set(httpx.get(engine_url + "/server_info").json()["released_tags"]) >= {"weights", "kv_cache"}
    fleet.onload_weights()
    assert set(httpx.get(engine_url + "/server_info").json()["released_tags"]) & {"weights"} == set()
    fleet.onload_kv()
    assert httpx.get(engine_url + "/server_info").json()["released_tags"] == []


def test_restart_budget_turns_a_crash_loop_into_an_error():
    from slime_hydra.rollout.health import FaultTolerance
    from slime_hydra.utils.http import EngineError

    fleet = EngineFleet([EngineHandle(0, "http://a"), EngineHandle(1, "http://b")],
                        fault_tolerance=FaultTolerance(max_restarts_per_hour=2))
    e = fleet.engines[1]
    fleet._charge_restart(e, "engine 1 exited with code -9; last lines of engine_1.log:\nCUDA error: out of memory")
    fleet._charge_restart(e, "again")
    e.restarts[0] -= 3600  # an hour ago: no longer counted
    fleet._charge_restart(e, "again")
    with pytest.raises(EngineError, match=r"engine 1 failed 3 times within an hour, more than "
                                          r"rollout.max_engine_restarts_per_hour=2; the last time:\nboom"):
        fleet._charge_restart(e, "boom")

    async def requeue():
        return await fleet.requeue(0.0)

    with pytest.raises(EngineError, match="engine 1 failed 3 times"):  # every later request fails with it
        asyncio.run(requeue())


def test_requeue_only_requests_of_failed_engines():
    """A request that failed while every engine serves is a plain failure (retried as usual); one
    sent before an engine was taken out is sent again once an engine serves."""
    import time

    from slime_hydra.rollout.health import RESTARTING, FaultTolerance

    fleet = EngineFleet([EngineHandle(0, "http://a"), EngineHandle(1, "http://b")], fault_tolerance=FaultTolerance())
    assert EngineFleet([EngineHandle(0, "http://a")]).take_counters() == {
        "rollout/engine_restarts": 0.0, "rollout/requeued_requests": 0.0, "heal/router_restarts": 0.0}

    async def scenario():
        assert not await fleet.requeue(time.monotonic())
        sent = time.monotonic()
        for e in fleet.engines:  # both failed and were taken out
            e.state = RESTARTING
        fleet._last_out = time.monotonic()
        fleet._update_serving()
        waiting = asyncio.ensure_future(fleet.requeue(sent))
        picking = asyncio.ensure_future(fleet.engine_url())  # where a group request goes next
        await asyncio.sleep(0.2)
        assert not waiting.done() and not picking.done()  # no engine serves
        fleet.engines[0].state = "serving"  # restarted and given the weights
        fleet._update_serving()
        assert await asyncio.wait_for(picking, 5) == "http://a"
        return await asyncio.wait_for(waiting, 5)

    assert asyncio.run(scenario()) is True
    assert fleet.take_counters()["rollout/requeued_requests"] == 1.0
    assert fleet.urls == ["http://a"] and fleet.endpoints() == [{"url": "http://a", "gpus": 1, "first_gpu": 0}]


def test_a_starting_engine_is_reported_with_its_last_log_line(tmp_path, caplog):
    log = tmp_path / "engine_0.log"
    log.write_text("Load weight end. mem usage=1.13 GB\nCapture cuda graph bs [1, 2, 4, 8]\n\n")
    fleet = EngineFleet([EngineHandle(0, "http://127.0.0.1:1", logs=[str(log)])])
    with caplog.at_level("INFO", logger="slime_hydra"):
        fleet._report_startup(fleet.engines[0])
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("waiting for ") and "engine 0 (" in line
    assert line.endswith("s): Capture cuda graph bs [1, 2, 4, 8]")
