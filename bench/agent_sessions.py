"""Requests per second of the agent endpoint (slime_hydra/rollout/agent.py) with many concurrent sessions, against
the same /generate calls made directly (ChatRollout, no HTTP in between), on the embedded engine and the
calculator task: each session is the calculator agent (examples/calculator/agent.py), three one-token turns.

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


async def measure(cfg, url: str, sessions: int, rounds: int) -> dict:
    from examples.calculator.agent import run as agent
    from examples.calculator.direct import generate as direct
    from slime_hydra.data.sample import Sample
    from slime_hydra.data.tokenizer import load_tokenizer
    from slime_hydra.rollout.agent import generate as via_endpoint
    from slime_hydra.rollout.client import GenerateClient
    from slime_hydra.rollout.generate import GenerateContext, seeded
    from slime_hydra.rollout.sampling import sampling_params

    ctx = GenerateContext(cfg, load_tokenizer(cfg.model.tokenizer), GenerateClient(url, sessions))
    sp = sampling_params(cfg.rollout)
    out = {}
    for name, fn in [("direct", lambda s, p: direct(ctx, s, p, max_turns=3, turn_max_tokens=1)),
                     ("endpoint", lambda s, p: via_endpoint(ctx, s, p, agent=agent))] * 2:  # the first is warm-up
        t0, ctx.requests = time.perf_counter(), 0
        for r in range(rounds):
            samples = [Sample(prompt=f"{10 + i}*11-{(10 + i) * 11 - 3}", label="3", index=r * sessions + i)
                       for i in range(sessions)]
            await asyncio.gather(*(fn(s, seeded(ctx, s, sp, False)) for s in samples))
        wall = time.perf_counter() - t0
        out[name] = {"requests": ctx.requests, "wall_s": round(wall, 3),
                     "requests_per_s": round(ctx.requests / wall, 1)}
    await ctx.client.aclose()
    out["endpoint_over_direct"] = round(out["direct"]["requests_per_s"] / out["endpoint"]["requests_per_s"], 3)
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
               for k in ("direct", "endpoint")), "", f"direct / endpoint: {got['endpoint_over_direct']}"]
    (out / "result.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
