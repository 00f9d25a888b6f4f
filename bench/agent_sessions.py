"""Requests per second of the agent endpoint (slime_hydra/rollout/agent.py) with many concurrent sessions, against
the same /generate calls made directly (ChatRollout, no HTTP in between), on the embedded engine and the
calculator task: each session is the calculator agent, at most three one-token turns. Three paths:

- ``direct``: examples/calculator/direct.py, the conversation through ChatRollout;
- ``endpoint``: examples/calculator/agent.py, the openai SDK's client on the session (what a user's agent pays);
- ``endpoint_json``: the same agent as JSON bodies handed to the endpoint's dispatch (:func:`json_agent`): the
  endpoint's own cost, without the SDK's building and parsing of each request;

and the SDK's own work for one request, against a transport that answers at once (:func:`sdk_alone`).

    python bench/agent_sessions.py --sessions 64 --rounds 10 --out DIR    # writes DIR/result.json, DIR/result.md
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def config():
    from hydra import compose, initialize_config_dir

    from slime_hydra.config import load, resolve
    from slime_hydra.config.store import register_configs
    from slime_hydra.plan.fit import fit

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = resolve(load(compose("config", overrides=["experiment=calculator_agent"])))
    fit(cfg)
    return cfg


async def json_agent(ep, url: str, sample: dict, max_turns: int = 3) -> float:
    """examples/calculator/agent.py's loop on JSON bodies sent to ``ep.dispatch`` (the endpoint's in-process entry)."""
    from examples.calculator.agent import TOOLS, calculate

    path, question = url.split("127.0.0.1", 1)[1].split("/", 1)[1], sample["prompt"]
    messages, called = [{"role": "user", "content": question}], False
    for _ in range(max_turns):
        body = {"model": "policy", "messages": messages, "tools": TOOLS, "max_tokens": 1}
        status, raw = await ep.dispatch("POST", f"/{path}/chat/completions", json.dumps(body).encode())
        assert status == 200, raw
        msg = json.loads(raw)["choices"][0]["message"]
        messages.append(msg)
        if not msg.get("tool_calls"):
            return float(called and (msg["content"] or "").strip() == str(sample["label"]))
        called = True
        for call in msg["tool_calls"]:
            expression = json.loads(call["function"]["arguments"] or "{}").get("expression") or question
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": calculate(expression)})
    return 0.0


async def sdk_alone(n: int = 1000) -> dict:
    """Milliseconds of the openai SDK's own work for one chat request (the calculator's tools, one and three
    messages), against an httpx transport that answers a fixed reply at once."""
    import httpx
    import openai

    from examples.calculator.agent import TOOLS

    reply = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "4"}, "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()

    class Answer(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            await request.aread()
            return httpx.Response(200, content=reply, headers={"content-type": "application/json"})

    call = {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "37*48-1772"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "4"}]
    async with httpx.AsyncClient(transport=Answer()) as http:
        client = openai.AsyncOpenAI(base_url="http://sdk/v1", api_key="none", http_client=http, max_retries=0)
        out = {}
        for k in (1, 3):
            for i in range(n // 10 + n):  # the first tenth warms up
                if i == n // 10:
                    t0 = time.perf_counter()
                await client.chat.completions.create(model="m", messages=msgs[:k], tools=TOOLS, max_tokens=1)
            out[f"{k}_messages_ms"] = round((time.perf_counter() - t0) / n * 1e3, 3)
    return out


async def measure(cfg, url: str, sessions: int, rounds: int) -> dict:
    from examples.calculator.agent import run as agent
    from examples.calculator.direct import generate as direct
    from slime_hydra.data.sample import Sample
    from slime_hydra.data.tokenizer import load_tokenizer
    from slime_hydra.rollout.agent import endpoint, generate as via_endpoint
    from slime_hydra.rollout.client import GenerateClient
    from slime_hydra.rollout.generate import GenerateContext, seeded
    from slime_hydra.rollout.sampling import sampling_params

    ctx = GenerateContext(cfg, load_tokenizer(cfg.model.tokenizer), GenerateClient(url, sessions))
    sp = sampling_params(cfg.rollout)
    ep, out = await endpoint(ctx), {}

    async def raw(base_url, sample):
        return await json_agent(ep, base_url, sample)

    paths = {"direct": lambda s, p: direct(ctx, s, p, max_turns=3, turn_max_tokens=1),
             "endpoint": lambda s, p: via_endpoint(ctx, s, p, agent=agent),
             "endpoint_json": lambda s, p: via_endpoint(ctx, s, p, agent=raw)}
    totals = {name: [0, 0.0] for name in paths}  # requests, seconds
    for r in range(rounds + 1):  # round 0 warms up; the paths take turns, so a slower stretch hits them alike
        samples = [Sample(prompt=f"{10 + i}*11-{(10 + i) * 11 - 3}", label="3", index=r * sessions + i)
                   for i in range(sessions)]
        for name, fn in paths.items():
            batch = [Sample(prompt=s.prompt, label=s.label, index=s.index) for s in samples]
            gc.collect()
            t0, ctx.requests = time.perf_counter(), 0
            await asyncio.gather(*(fn(s, seeded(ctx, s, sp, False)) for s in batch))
            if r:
                totals[name][0] += ctx.requests
                totals[name][1] += time.perf_counter() - t0
    for name, (n, wall) in totals.items():
        out[name] = {"requests": n, "wall_s": round(wall, 3), "requests_per_s": round(n / wall, 1)}
    await ep.aclose()
    await ctx.client.aclose()
    out["sdk_alone"] = await sdk_alone()
    for k in ("endpoint", "endpoint_json"):
        out[f"{k}_over_direct"] = round(out["direct"]["requests_per_s"] / out[k]["requests_per_s"], 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / time.strftime("agent_sessions-%Y%m%d-%H%M%S")))
    args = ap.parse_args()
    from slime_hydra.model.hf import build_random_checkpoint
    from slime_hydra.rollout.engines import ServerSpec
    from slime_hydra.rollout.engines.embedded import EmbeddedEngine
    from slime_hydra.utils.proc import free_port, kill_tree, spawn, wait_http

    cfg = config()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = build_random_checkpoint(cfg.model, tempfile.mkdtemp(prefix="agent_sessions_"))
    spec = ServerSpec(engine="embedded", model_path=ckpt, tokenizer_path=ckpt, dtype="float32", device="cpu", gpus=1,
                      seed=0, num_threads=1, memory_saver=False)
    port = free_port()
    proc = spawn(EmbeddedEngine(spec).command("127.0.0.1", port), str(out / "engine.log"))
    try:
        wait_http(f"http://127.0.0.1:{port}/health_generate", proc, 300, str(out / "engine.log"))
        got = asyncio.run(measure(cfg, f"http://127.0.0.1:{port}", args.sessions, args.rounds))
    finally:
        kill_tree(proc)
    record = {"scenario": "agent_sessions", "sessions": args.sessions, "rounds": args.rounds, **got}
    (out / "result.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# agent_sessions: {args.sessions} concurrent calculator sessions x {args.rounds} rounds", "",
             "| path | requests | wall s | requests/s |", "| --- | --- | --- | --- |",
             *(f"| {k} | {got[k]['requests']} | {got[k]['wall_s']} | {got[k]['requests_per_s']} |"
               for k in ("direct", "endpoint_json", "endpoint")), "",
             f"direct / endpoint_json: {got['endpoint_json_over_direct']}; "
             f"direct / endpoint: {got['endpoint_over_direct']}", "",
             f"the openai SDK alone, a request against a transport that answers at once: "
             f"{got['sdk_alone']['1_messages_ms']} ms (one message), {got['sdk_alone']['3_messages_ms']} ms (three)"]
    (out / "result.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
