"""Requests per second of the agent endpoint (slime_hydra/rollout/agent.py) with many concurrent sessions, against
the same /generate calls made directly (ChatRollout, no HTTP in between), on the embedded engine and the
calculator task: each session is the calculator agent, at most three one-token turns. Three paths:

- ``direct``: examples/calculator/direct.py, the conversation through ChatRollout;
- ``endpoint``: examples/calculator/agent.py, the openai SDK's client on the session (what a user's agent pays);
- ``endpoint_json``: the same agent as JSON bodies handed to the endpoint's dispatch (:func:`json_agent`): the
  endpoint's own cost, without the SDK's building and parsing of each request.

    python bench/agent_sessions.py --sessions 64 --rounds 3 --out DIR    # writes DIR/result.json, DIR/result.md
"""

from __future__ import annotations

import argparse
import asyncio
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

    for name, fn in [("direct", lambda s, p: direct(ctx, s, p, max_turns=3, turn_max_tokens=1)),
                     ("endpoint", lambda s, p: via_endpoint(ctx, s, p, agent=agent)),
                     ("endpoint_json", lambda s, p: via_endpoint(ctx, s, p, agent=raw))] * 2:  # the first: warm-up
        t0, ctx.requests = time.perf_counter(), 0
        for r in range(rounds):
            samples = [Sample(prompt=f"{10 + i}*11-{(10 + i) * 11 - 3}", label="3", index=r * sessions + i)
                       for i in range(sessions)]
            await asyncio.gather(*(fn(s, seeded(ctx, s, sp, False)) for s in samples))
        wall = time.perf_counter() - t0
        out[name] = {"requests": ctx.requests, "wall_s": round(wall, 3),
                     "requests_per_s": round(ctx.requests / wall, 1)}
    await ep.aclose()
    await ctx.client.aclose()
    for k in ("endpoint", "endpoint_json"):
        out[f"{k}_over_direct"] = round(out["direct"]["requests_per_s"] / out[k]["requests_per_s"], 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
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
             f"direct / endpoint: {got['endpoint_over_direct']}"]
    (out / "result.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
