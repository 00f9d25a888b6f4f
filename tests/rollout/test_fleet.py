"""The engine fleet (slime_hydra/rollout/fleet.py) over engines it did not start, so without Ray: its
addresses, and against a real embedded engine, sglang-router registration, aborts and the
colocated memory calls. (Watching engine actors: test_engine_watchdog.py.)"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from slime_hydra.config.schema import RouterConfig
from slime_hydra.rollout.client import GenerateClient
from slime_hydra.rollout.fleet import EngineFleet, EngineHandle

LONG = {"input_ids": [3, 4, 5, 12], "sampling_params": {"max_new_tokens": 100000, "ignore_eos": True},
        "return_logprob": True}


def test_addresses_without_router():
    a, b = "http://10.0.0.1:30000", "http://10.0.0.2:30000"
    fleet = EngineFleet([EngineHandle(0, a, gpus=2), EngineHandle(1, b, gpus=2)])
    assert fleet.urls == [a, b] and fleet.base_url == a
    assert fleet.endpoints() == [{"url": a, "gpus": 2}, {"url": b, "gpus": 2}]

    async def work():
        return 7

    assert asyncio.run(fleet.watched(work())) == 7  # no actors to watch: awaited as it is
    assert fleet.dead_engines() == []
    fleet.shutdown()  # nothing it started


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_offload_and_onload(engine_url):
    fleet = EngineFleet([EngineHandle(0, engine_url)])
    fleet.offload()
    assert set(httpx.get(engine_url + "/server_info").json()["released_tags"]) >= {"weights", "kv_cache"}
    fleet.onload_weights()
    assert set(httpx.get(engine_url + "/server_info").json()["released_tags"]) & {"weights"} == set()
    fleet.onload_kv()
    assert httpx.get(engine_url + "/server_info").json()["released_tags"] == []
