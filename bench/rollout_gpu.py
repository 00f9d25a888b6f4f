"""Where the anchor's rollout could go faster on one GPU: raw SGLang servers (no run.py, no router) answering the
GRPO step's requests (8 prompts x 8 samples x 256 new tokens, one /generate each, as bench/gpu/sglang_server.py
sends them), in configurations side by side:

- ``one``: one server, all 64 requests (the reference: what a run's rollout does);
- ``one_gc_frozen``: one server whose processes were asked to ``POST /freeze_gc`` (Python's collector then skips
  the objects alive at that moment: SGLang's scheduler is a Python loop that holds millions of them);
- ``one_snapshot``: one server with ``load_snapshot_publish_interval`` raised from 15 decode iterations to 1000;
- ``two``, ``three``: the requests split evenly over two or three servers on the same GPU (two or three scheduler
  loops, each on a CPU of its own, their kernels sharing the GPU by time slices).

Every server starts once (the first alone: a fresh machine compiles SGLang's kernels there) and stays up; then
the configurations take turns, round after round, so that a host whose CPUs change speed changes them all alike.
Servers wait idle with ``sleep_on_idle`` (else each idle scheduler spins a CPU). Needs the SGLang bundle and
``.gpu-extra`` (bench/README.md):

    BENCH_SGLANG=1 source bench/gpu/env.sh && python3 bench/rollout_gpu.py --out $OUT     # about 4-5 minutes

Writes ``rollout_gpu.{json,md}``: each configuration's seconds per rollout (every round, the median), its tokens a
second, and each server's start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu import harness as h  # noqa: E402
from gpu.sglang_server import SERVER_ARGS, prompt_ids, timed_requests  # noqa: E402
from gpu.workload import Workload  # noqa: E402

# configuration -> the server-args changes of each of its servers
CONFIGS: Dict[str, List[Dict[str, Any]]] = {
    "one": [{}],
    "one_gc_frozen": [{}],
    "one_snapshot": [{"load_snapshot_publish_interval": 1000}],
    "two": [{}, {}],
    "three": [{}, {}, {}],
}
KV_TOKENS = 40_000  # each server's pool: the anchor needs 64 x (64 + 256) = 20,480 tokens


def spec_of(w: Workload, changes: Dict[str, Any], batch: int):
    from slime_hydra.rollout.engines import ServerSpec

    return ServerSpec(engine="sglang", model_path=w.ckpt, tokenizer_path=w.ckpt, dtype="bfloat16", device="cuda",
                      gpus=1, seed=0, memory_saver=True, decode_batch=batch, kv_tokens=KV_TOKENS, fast_start=True,
                      server_args={**SERVER_ARGS, "mem_fraction_static": 0.9, "sleep_on_idle": True, **changes})


class Server:
    """One SGLang server process on GPU 0, started as the engine actor starts one."""

    def __init__(self, name: str, spec, log_path: str):
        from slime_hydra.rollout.engines import make_engine
        from slime_hydra.utils.proc import free_port, spawn

        self.name, self.log_path = name, log_path
        engine = make_engine(spec)
        port = free_port()
        for key in engine.unset_env:
            os.environ.pop(key, None)
        self.url = f"http://127.0.0.1:{port}"
        cmd = engine.command("127.0.0.1", port, 0, nccl_port=free_port())
        self.command = " ".join(cmd[1:])
        self.t0 = time.perf_counter()
        self.proc = spawn(cmd, log_path, engine.env())
        self.startup_s = None

    def wait(self, timeout_s: float) -> float:
        from slime_hydra.utils.proc import wait_http

        wait_http(self.url + "/health_generate", self.proc, timeout_s, self.log_path)
        self.startup_s = time.perf_counter() - self.t0
        return self.startup_s

    def stop(self) -> None:
        from slime_hydra.utils.proc import kill_tree

        kill_tree(self.proc)


async def rollout(servers: List[Server], prompts: List[List[int]], w: Workload) -> Dict[str, Any]:
    """The step's requests, prompt by prompt dealt round the servers (a group stays on one server, as the router's
    cache-aware policy keeps it), all at once; seconds until the last answer."""
    t0 = time.perf_counter()
    shares = [prompts[i::len(servers)] for i in range(len(servers))]
    outs = await asyncio.gather(*(timed_requests(s.url, share, w.samples, w.new_tokens)
                                  for s, share in zip(servers, shares)))
    dt = time.perf_counter() - t0
    tokens = sum(o["tokens"] for o in outs)
    return {"seconds": dt, "tokens": tokens, "tokens_per_s": tokens / dt,
            "per_server_s": [round(o["seconds"], 4) for o in outs]}


def run(args, out: Dict[str, Any]) -> None:
    import httpx

    w = Workload(args.work)
    t = time.perf_counter()
    w.build()
    out["build_s"] = time.perf_counter() - t
    batch = w.prompts * w.samples
    wanted = [c for c in args.configs.split(",") if c]
    servers: Dict[str, List[Server]] = {}
    try:
        first = wanted[0]
        servers[first] = [Server(f"{first}0", spec_of(w, CONFIGS[first][0], batch),
                                 os.path.join(w.work, f"rollout_{first}0.log"))]
        h.log(f"{first}: up in {servers[first][0].wait(args.start_timeout):.1f}s (alone: a fresh machine compiles "
              "SGLang's kernels here)")
        for name in wanted[1:]:
            n = len(CONFIGS[name])
            servers[name] = [Server(f"{name}{i}", spec_of(w, CONFIGS[name][i], -(-batch // n)),
                                    os.path.join(w.work, f"rollout_{name}{i}.log")) for i in range(n)]
        for name in wanted[1:]:
            for s in servers[name]:
                h.log(f"{s.name}: up in {s.wait(args.start_timeout):.1f}s")
        out["servers"] = {s.name: {"startup_s": s.startup_s, "command": s.command}
                          for group in servers.values() for s in group}
        for s in servers.get("one_gc_frozen", []):
            httpx.post(s.url + "/freeze_gc", timeout=60).raise_for_status()
        prompts = prompt_ids(w, w.prompts)
        for name in wanted:  # a warm-up each
            asyncio.run(rollout(servers[name], prompts, w))
        rounds: Dict[str, List[Dict[str, Any]]] = {name: [] for name in wanted}
        out["rounds"] = rounds
        for r in range(args.rounds):
            order = wanted if r % 2 == 0 else wanted[::-1]
            for name in order:
                rounds[name].append(asyncio.run(rollout(servers[name], prompts, w)))
            h.log(f"round {r + 1}: " + ", ".join(f"{n} {rounds[n][-1]['seconds']:.3f}s" for n in wanted))
        out["median_s"] = {n: h.median([x["seconds"] for x in rounds[n]]) for n in wanted}
    finally:
        for group in servers.values():
            for s in group:
                s.stop()


def report(out: Dict[str, Any], path: str) -> None:
    lines = ["## The anchor's rollout on one GPU: raw SGLang, one server against several (" + out.get("gpu", "") + ")",
             "", "8 prompts x 8 samples x 256 new tokens, the Qwen3-0.6B shape (random bf16 weights), one /generate a "
             "sample; configurations in turns, round after round (`bench/rollout_gpu.py`).", ""]
    med = out.get("median_s") or {}
    rows = []
    for name, runs in (out.get("rounds") or {}).items():
        secs = [x["seconds"] for x in runs]
        rows.append([name, len(CONFIGS[name]), h.cell(med.get(name), ".3f"), h.cell(min(secs, default=None), ".3f"),
                     h.cell(max(secs, default=None), ".3f"), h.cell(h.median([x["tokens_per_s"] for x in runs]), ".0f"),
                     " ".join(f"{s:.3f}" for s in secs)])
    lines += h.table(["config", "servers", "median s", "min s", "max s", "tokens/s", "each round s"], rows)
    ups = out.get("servers") or {}
    if ups:
        lines += ["", "Start-up (s): " + ", ".join(f"{k} {v['startup_s']:.1f}" for k, v in ups.items())]
    if out.get("error"):
        lines += ["", f"Error: {out['error']}"]
    h.write_text(path + ".md", "\n".join(lines) + "\n")
    h.write_json(path + ".json", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated of {', '.join(CONFIGS)}; the "
                                                                 "first starts alone")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--work", default=os.environ.get("BENCH_WORK", "/tmp/bench_rollout"))
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--report", metavar="JSON", help="only write the report (.md beside it) of a result file")
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            return report(json.load(f), args.report[:-len(".json")])
    unknown = [c for c in args.configs.split(",") if c and c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown} (known: {', '.join(CONFIGS)})")
    os.makedirs(args.out, exist_ok=True)
    out: Dict[str, Any] = {"gpu": (h.gpu_names() or [""])[0], "host_cpus": h.host_cpus(), "cmdline": " ".join(sys.argv)}
    path = os.path.join(args.out, "rollout_gpu")
    try:
        run(args, out)
    except Exception as e:  # noqa: BLE001 - what was measured is written either way
        out["error"] = repr(e)
        raise
    finally:
        report(out, path)
        print(open(path + ".md").read())


if __name__ == "__main__":
    main()
