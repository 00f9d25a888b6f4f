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
    assert fleet.endpoints() == [{"url": a, "gpus": 2, "first_gpu": 0}, {"url": b, "gpus": 2, "first_gpu": 0}]

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


def test_restart_budget_turns_a_crash_loop_into_an_error():
    from slime_hydra.rollout.fleet import FaultTolerance
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

    from slime_hydra.rollout.fleet import RESTARTING, FaultTolerance

    fleet = EngineFleet([EngineHandle(0, "http://a"), EngineHandle(1, "http://b")], fault_tolerance=FaultTolerance())
    assert EngineFleet([EngineHandle(0, "http://a")]).take_counters() == {
        "rollout/engine_restarts": 0.0, "rollout/requeued_requests": 0.0}

    async def scenario():
        assert not await fleet.requeue(time.monotonic())
        sent = time.monotonic()
        for e in fleet.engines:  # both failed and were taken out
            e.state = RESTARTING
        fleet._last_out = time.monotonic()
        fleet._update_serving()
        waiting = asyncio.ensure_future(fleet.requeue(sent))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # no engine serves
        fleet.engines[0].state = "serving"  # restarted and given the weights
        fleet._update_serving()
        return await asyncio.wait_for(waiting, 5)

    assert asyncio.run(scenario()) is True
    assert fleet.take_counters()["rollout/requeued_requests"] == 1.0
    assert fleet.urls == ["http://a"] and fleet.endpoints() == [{"url": "http://a", "gpus": 1, "first_gpu": 0}]
