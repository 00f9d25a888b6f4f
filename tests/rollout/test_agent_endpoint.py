"""``rollout.agent`` on the embedded engine with the real ``openai`` client: chat, tool calls, log-probs and the
refusals of the per-sample endpoint; a session's trained tokens and log-probs equal the direct ChatRollout path's
(the same /generate calls, bitwise); an edited history starts a new segment; a raising, a hung and an
over-budget agent end their samples, not the rollout."""

from __future__ import annotations

import asyncio

import openai
import pytest

from examples.calculator.agent import run as calc_agent
from examples.calculator.direct import generate as direct_generate
from rollout_harness import make_rollout
from slime_hydra.data.sample import Sample, Status
from slime_hydra.rewards import counters
from slime_hydra.rollout.agent import Session, endpoint, generate as agent_generate
from slime_hydra.rollout.client import GenerateClient
from slime_hydra.rollout.generate import seeded

pytestmark = pytest.mark.integration
CALC = ["experiment=calculator_agent", "rollout.batch_size=4", "rollout.n_samples_per_prompt=2", "eval.interval=0"]


def parts(engine_url, *overrides):
    m = make_rollout([*CALC, *overrides], urls=[engine_url])
    return m, m.ctx.sampler.ctx


def with_client(engine_url, ctx, coro_fn):
    async def go():
        ctx.client = GenerateClient(engine_url, 16, retries=0)
        try:
            return await coro_fn()
        finally:
            await ctx.client.aclose()
    return asyncio.run(go())


def test_chat_tools_logprobs_and_refusals(engine_url):
    m, ctx = parts(engine_url)
    sp = m.ctx.sampling_params
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]

    async def go():
        ep = await endpoint(ctx)
        calls = None
        for seed in range(200):  # the random model calls the tool now and then; seeds make it reproducible
            sample = Sample(prompt="12*3-30", label="6", index=seed)
            s = ep.sessions["x"] = Session(ep, ctx, sample, {**sp, "sampling_seed": seed})
            client = openai.AsyncOpenAI(base_url=s.url.replace(s.id, "x"), api_key="none", max_retries=0)
            r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "12*3-30"}],
                                                     tools=tools, max_tokens=1, logprobs=True)
            c = r.choices[0]
            assert r.usage.completion_tokens == 1 == len(c.logprobs.content)
            assert [t.logprob for t in c.logprobs.content] == sample.rollout_log_probs  # the engine's own
            if c.message.tool_calls:
                calls = c
                break
        assert calls is not None and calls.finish_reason == "tool_calls"
        assert calls.message.tool_calls[0].function.name == "calculator"
        msgs = [{"role": "user", "content": "12*3-30"}, calls.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": calls.message.tool_calls[0].id, "content": "6"}]
        r2 = await client.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=1)
        text = ctx.tokenizer.decode(sample.tokens, skip_special_tokens=False)
        assert text.startswith("<user>12*3-30<assistant><call><eos><tool>6<assistant>"), text
        assert sample.loss_mask == [1, 0, 0, 0, 0, 1] and sample.metadata.get("segments") is None
        assert r2.choices[0].message.content == text.split("<assistant>")[-1]
        assert [x.id for x in (await client.models.list()).data] == [ctx.cfg.model.name]
        for bad, what in [({"n": 2}, "n=2"), ({"stream": True}, "stream=True"), ({"top_logprobs": 3}, "top_log")]:
            with pytest.raises(openai.BadRequestError, match=what):
                await client.chat.completions.create(model="m", messages=msgs, **bad)
        done = await client.completions.create(model="m", prompt="<user>1+1<assistant>", max_tokens=2, logprobs=1)
        assert done.usage.completion_tokens == len(done.choices[0].logprobs.token_logprobs) >= 1
        gone = openai.AsyncOpenAI(base_url=f"{ep.url}/s/nobody/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="no such session"):
            await gone.models.list()

    with_client(engine_url, ctx, go)


async def with_direct(ctx, sp, agent, n):
    """``n`` calculator samples through the endpoint with ``agent`` and through the direct path: (agent's, direct's)."""
    pairs = []
    for i in range(n):
        a, b = (Sample(prompt=f"{10 + i}*11-{(10 + i) * 11 - 3}", label="3", index=i) for _ in range(2))
        a = await agent_generate(ctx, a, seeded(ctx, a, sp, False), agent=agent)
        b = await direct_generate(ctx, b, seeded(ctx, b, sp, False), max_turns=3, turn_max_tokens=1)
        pairs.append((a, b))
    return pairs


def test_a_session_trains_exactly_what_the_direct_chat_rollout_does(engine_url):
    """The calculator as an OpenAI-SDK agent through the endpoint and as a ChatRollout generate function: the
    same /generate calls, so the same tokens, masks and log-probs, bitwise."""
    m, ctx = parts(engine_url)
    sp = m.ctx.sampling_params

    pairs = with_client(engine_url, ctx, lambda: with_direct(ctx, sp, calc_agent, 12))
    assert any(a.metadata["tool_calls"] for a, _ in pairs)  # multi-turn sessions among them
    for a, b in pairs:
        assert (a.tokens, a.loss_mask, a.rollout_log_probs) == (b.tokens, b.loss_mask, b.rollout_log_probs)
        assert a.status == b.status and a.metadata["num_turns"] == b.metadata["num_turns"]


async def edits_history(base_url, sample):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    first = [{"role": "user", "content": sample["prompt"]}]
    r = await client.chat.completions.create(model="m", messages=first, max_tokens=1)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1"}], max_tokens=1)
    return 0.5 if r.choices else 0.0


async def flaky(client, sample):
    """Raises, hangs, runs past its turns, or answers, by sample index."""
    kind = sample["index"] % 4
    if kind == 0:
        raise RuntimeError("the agent's own bug")
    if kind == 1:
        await asyncio.sleep(3600)
    return await calc_agent(client, sample, max_turns=3 if kind == 2 else 1)


def test_an_edited_history_starts_a_new_segment(engine_url):
    m, ctx = parts(engine_url, "rollout.agent=test_agent_endpoint.edits_history")
    counters.drain()
    groups, _ = with_client(engine_url, ctx, m.collect)
    for s in (s for g in groups for s in g):
        assert s.metadata["segments"] == 2 and s.reward == 0.5
        assert ctx.tokenizer.decode(s.tokens[: s.prompt_length], skip_special_tokens=False) == "<user>1+1<assistant>"
    assert counters.drain()["rollout/agent_new_segment_count"] == 8


def test_raising_hung_and_over_budget_agents_end_their_samples_not_the_rollout(engine_url, caplog):
    m, ctx = parts(engine_url, "rollout.agent=test_agent_endpoint.flaky", "rollout.agent_timeout=3",
                   "rollout.agent_max_turns=1")
    counters.drain()
    groups, _ = with_client(engine_url, ctx, m.collect)
    by_kind = {k: [s for g in groups for s in g if s.index % 4 == k] for k in range(4)}
    assert all(s.status == Status.FAILED and s.reward == 0.0 for s in by_kind[0] + by_kind[1])
    assert all(s.tokens and s.prompt_length == len(s.tokens) for s in by_kind[0] + by_kind[1])  # the prompt only
    # the kind-2 agent's second request is refused (agent_max_turns=1): truncated unless it answered at once
    assert all(s.status in (Status.TRUNCATED, Status.COMPLETED) and s.metadata["num_turns"] == 1
               for s in by_kind[2] + by_kind[3])
    n = counters.drain()
    assert n["rollout/agent_error_count"] == len(by_kind[0]) and n["rollout/agent_timeout_count"] == len(by_kind[1])
    assert "RuntimeError: the agent's own bug" in caplog.text and "Traceback" in caplog.text


def test_an_aborted_session_returns_its_sample_aborted_and_empty(engine_url):
    """While the manager aborts, the endpoint refuses the agent's request; the sample comes back ABORTED without
    tokens, so partial rollout starts it over (an agent's own state cannot be resumed)."""
    m, ctx = parts(engine_url)
    sp = m.ctx.sampling_params

    async def go():
        s = Sample(prompt="12*3-30", label="6", index=3, metadata={"start_rollout_id": 0})
        ctx.aborting = True
        try:
            return await agent_generate(ctx, s, seeded(ctx, s, sp, False), agent=calc_agent)
        finally:
            ctx.aborting = False

    s = with_client(engine_url, ctx, go)
    assert s.status == Status.ABORTED and s.tokens == [] and s.reward is None and "messages" not in s.metadata


def sync_calc(client, sample):
    """The calculator agent as blocking code with the synchronous ``openai.OpenAI`` (it runs in a thread)."""
    from examples.calculator.agent import TOOLS, calculate

    assert isinstance(client, openai.OpenAI)
    messages = [{"role": "user", "content": sample["prompt"]}]
    for _ in range(3):
        msg = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=1).choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        messages += [{"role": "tool", "tool_call_id": c.id, "content": calculate(sample["prompt"])}
                     for c in msg.tool_calls]
    return None  # the configured reward scores the conversation


def sync_http(base_url, sample):
    """Blocking HTTP over a real socket to the session's URL (the endpoint's loop must keep serving); index 0 hangs."""
    import time

    if sample["index"] % 8 == 0:
        time.sleep(3600)
    r = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": sample["prompt"]}], max_tokens=1)
    return 0.25 if r.choices[0].message.content is not None else 0.0


def test_a_plain_def_agent_runs_in_a_thread_with_the_sync_client(engine_url):
    """A blocking agent gets ``openai.OpenAI`` (its requests handed to the endpoint's loop) and trains the same
    tokens as the direct path."""
    m, ctx = parts(engine_url, "rollout.agent=test_agent_endpoint.sync_calc", "reward.type=custom",
                   "reward.custom=examples.calculator.direct.reward")
    sp = m.ctx.sampling_params

    async def go():
        pairs = await with_direct(ctx, sp, sync_calc, 8)
        groups, _ = await m.collect()
        return pairs, groups

    pairs, groups = with_client(engine_url, ctx, go)
    for a, b in pairs:
        assert (a.tokens, a.loss_mask, a.rollout_log_probs) == (b.tokens, b.loss_mask, b.rollout_log_probs)
    assert all(s.status != Status.FAILED for g in groups for s in g)


def test_a_blocking_agent_over_http_neither_blocks_the_endpoint_nor_outlives_its_timeout(engine_url):
    m, ctx = parts(engine_url, "rollout.agent=test_agent_endpoint.sync_http", "rollout.agent_timeout=5")
    counters.drain()
    groups, _ = with_client(engine_url, ctx, m.collect)
    samples = [s for g in groups for s in g]
    hung = [s for s in samples if s.index % 8 == 0]
    assert hung and all(s.status == Status.FAILED for s in hung)
    assert all(s.reward == 0.25 and s.response_length == 1 for s in samples if s.index % 8)
    assert counters.drain()["rollout/agent_timeout_count"] == len(hung)
