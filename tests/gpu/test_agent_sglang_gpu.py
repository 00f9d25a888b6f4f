"""On a GPU: ``rollout.agent`` in front of a real SGLang server. The two-turn agent of bench/gpu/agent.py talks to
the endpoint with the real ``openai`` client; each session's trained tokens and log-probs equal the direct
ChatRollout path's (the same conversation sent to the same server, its cache flushed before each, so both are
computed alike), and the endpoint returns the engine's own log-probs. The model is the bench's random Qwen3-0.6B
shape with its word-level tokenizer (bench/gpu/workload.py). Skipped without CUDA or sglang; bench/README.md's
second GPU call runs tests/gpu."""

from __future__ import annotations

import asyncio
import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
pytest.importorskip("sglang")

import httpx  # noqa: E402
import openai  # noqa: E402

from bench.gpu.agent import FOLLOW_UP, generate as direct_generate, run as bench_agent  # noqa: E402
from bench.gpu.workload import Workload  # noqa: E402
from rollout_harness import make_rollout  # noqa: E402
from slime_hydra.data.sample import Sample, Status  # noqa: E402
from slime_hydra.rollout.agent import Session, endpoint, generate as agent_generate  # noqa: E402
from slime_hydra.rollout.client import GenerateClient  # noqa: E402

TURN = 32


@pytest.fixture(scope="module")
def server():
    from slime_hydra.rollout.engines import ServerSpec, make_engine
    from slime_hydra.utils.proc import free_port, kill_tree, spawn, wait_http

    w = Workload(work=os.environ.get("BENCH_WORK", "/tmp/slime_hydra_bench"))
    w.build()
    spec = ServerSpec(engine="sglang", model_path=w.ckpt, tokenizer_path=w.ckpt, dtype="bfloat16", device="cuda",
                      gpus=1, seed=0, server_args={"mem_fraction_static": 0.3, "attention_backend": "triton",
                                                   "sampling_backend": "pytorch", "grammar_backend": "none",
                                                   "disable_cuda_graph": True})
    engine, port = make_engine(spec), free_port()
    log_path = os.path.join(w.work, "agent_test_server.log")
    proc = spawn(engine.command("127.0.0.1", port, 0, nccl_port=free_port()), log_path, engine.env())
    try:
        wait_http(f"http://127.0.0.1:{port}/health_generate", proc, 600, log_path)
        yield w, f"http://127.0.0.1:{port}"
    finally:
        kill_tree(proc)


def _parts(w, url):
    m = make_rollout(["model=qwen3_0_6b", f"model.path={w.ckpt}", f"model.tokenizer={w.ckpt}", "data=jsonl",
                      f"data.path={w.data}", "data.apply_chat_template=false", "eval.datasets=[]",
                      "rollout=sglang", "parallelism=1gpu", f"rollout.max_response_len={3 * TURN}",
                      "rollout.agent=bench.gpu.agent.run"], urls=[url])
    return m.ctx.sampler.ctx, m.ctx.sampling_params


def test_sessions_on_sglang_train_the_engines_tokens(server):
    w, url = server
    ctx, sp = _parts(w, url)

    async def flush():
        async with httpx.AsyncClient() as h:
            assert (await h.post(url + "/flush_cache")).status_code == 200

    async def go():
        ctx.client = GenerateClient(url, 4, retries=0)
        pairs, greedy = [], {**sp, "temperature": 0.0}  # SGLang samples alike only without a seed's help
        try:
            for i in range(4):
                a, b = (Sample(prompt=" ".join(f"t{(i * 7 + j) % 900 + 10}" for j in range(16)), label="", index=i)
                        for _ in range(2))
                await flush()
                a = await agent_generate(ctx, a, greedy,
                                         agent=functools.partial(bench_agent, turn_max_tokens=TURN))
                await flush()
                b = await direct_generate(ctx, b, greedy, turn_max_tokens=TURN)
                pairs.append((a, b))
        finally:
            await ctx.client.aclose()
        return pairs

    for a, b in asyncio.run(go()):
        assert a.status == b.status != Status.FAILED and a.metadata["num_turns"] == b.metadata["num_turns"] == 2
        diff = next((k for k, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
        assert (a.tokens, a.loss_mask) == (b.tokens, b.loss_mask), (
            diff, len(a.tokens), len(b.tokens), a.tokens[diff - 3 : diff + 3] if diff else None,
            b.tokens[diff - 3 : diff + 3] if diff else None, a.loss_mask[diff - a.prompt_length] if diff else None)
        assert max(abs(x - y) for x, y in zip(a.rollout_log_probs, b.rollout_log_probs)) < 1e-3
        follow = ctx.tokenizer.encode(FOLLOW_UP["content"], add_special_tokens=False)
        assert any(a.tokens[k:k + len(follow)] == follow for k in range(len(a.tokens)))


def test_chat_completion_returns_the_engines_logprobs(server):
    w, url = server
    ctx, sp = _parts(w, url)

    async def go():
        ctx.client = GenerateClient(url, 4, retries=0)
        try:
            ep = await endpoint(ctx)
            sample = Sample(prompt="t11 t12 t13", label="", index=0)
            s = ep.sessions["x"] = Session(ep, ctx, sample, {**sp, "sampling_seed": 1})
            client = openai.AsyncOpenAI(base_url=s.url.replace(s.id, "x"), api_key="none", max_retries=0)
            r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "t11 t12 t13"}],
                                                     max_tokens=8, logprobs=True)
            assert r.usage.completion_tokens == len(r.choices[0].logprobs.content) == len(sample.rollout_log_probs)
            assert [t.logprob for t in r.choices[0].logprobs.content] == sample.rollout_log_probs
            with pytest.raises(openai.BadRequestError, match="n=2"):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "t1"}], n=2)
            await ep.aclose()
        finally:
            await ctx.client.aclose()

    asyncio.run(go())
