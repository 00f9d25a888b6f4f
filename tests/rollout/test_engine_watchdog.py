"""A rollout fails within seconds, naming the engine and showing its log, when an engine dies in the
middle of it (its server process, or the Ray actor that owns it); a /generate that gets no reply
fails after the client's read timeout instead of hanging."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest
import ray

from conftest import running
from rollout_harness import make_rollout
from slime_hydra.rollout.client import GenerateClient
from slime_hydra.rollout.engines import ServerSpec
from slime_hydra.rollout.engines.actor import EngineActor, engine_log_path
from slime_hydra.rollout.fleet import EngineFleet
from slime_hydra.rollout.generate import generate as default_generate
from slime_hydra.rollout.health import EngineHandle
from slime_hydra.utils.http import EngineError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.parametrize("kill", ["server", "actor"])
def test_rollout_fails_fast_when_an_engine_dies(local_ray, tiny_ckpt, tmp_path, kill):
    spec = ServerSpec(engine="embedded", model_path=tiny_ckpt, tokenizer_path=tiny_ckpt, dtype="float32",
                      device="cpu", gpus=1, seed=0, num_threads=1)
    actor = ray.remote(EngineActor).options(num_cpus=0).remote(spec, 0, str(tmp_path), 300)
    url = ray.get(actor.start.remote())
    pid = ray.get(actor.__ray_call__.remote(lambda self: self.proc.pid))
    log = engine_log_path(str(tmp_path), 0, spec)
    fleet = EngineFleet([EngineHandle(0, url, actors=[actor], logs=[log])])
    m = make_rollout(["rollout.batch_size=2", "rollout.n_samples_per_prompt=2", "rollout.max_response_len=100000"],
                     fleet=fleet)
    sent = asyncio.Event()

    async def long_generate(ctx, s, sp, evaluation=False):  # far longer than the test
        sent.set()
        return await default_generate(ctx, s, {**sp, "ignore_eos": True}, evaluation)

    async def rollout():
        client = m.ctx.sampler.ctx.client = GenerateClient(url, 64)
        try:
            task = asyncio.ensure_future(m.collect())
            await asyncio.wait_for(sent.wait(), 30)
            await asyncio.sleep(1.0)  # the engine is generating
            assert not task.done()
            if kill == "server":
                os.kill(pid, signal.SIGKILL)
            else:
                ray.kill(actor)
            t0 = time.monotonic()
            with pytest.raises(EngineError) as e:
                await task
            return time.monotonic() - t0, str(e.value)
        finally:
            await client.aclose()

    m.set_generate(long_generate)
    try:
        took, msg = asyncio.run(rollout())
    finally:
        ray.kill(actor)
        if running(pid):
            os.kill(pid, signal.SIGKILL)
    assert took < 5.0, msg
    assert ("engine 0 (" + url if kill == "server" else "engine_0: its actor died") in msg
    assert f"last lines of {log}:\n" in msg and open(log).read().strip().splitlines()[-1] in msg


def test_generate_without_reply_times_out():
    """A server that accepts the request and never answers: EngineError after the read timeout, no retries."""
    from aiohttp import web

    async def hang(request):
        await asyncio.sleep(600)

    async def main():
        app = web.Application()
        app.router.add_post("/generate", hang)
        runner = web.AppRunner(app, shutdown_timeout=0.1)  # do not wait for the hanging handler
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        client = GenerateClient(f"http://127.0.0.1:{port}", 4, read_timeout=1.0)
        t0 = time.monotonic()
        try:
            with pytest.raises(EngineError, match="no reply within 1s"):
                await client.post("/generate", {"input_ids": [1]})
            return time.monotonic() - t0
        finally:
            await client.aclose()
            await runner.cleanup()

    assert asyncio.run(main()) < 3.0
