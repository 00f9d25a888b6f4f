"""Where a real SGLang server's start-up goes (issue 24: start in a minute), on one GPU.

    BENCH_SGLANG=1 source bench/gpu/env.sh && python3 bench/sglang_startup.py   # after bench/README.md's set-up

The server is started from the engine class's own command line (the run's: colocated, memory saver, the
run's server args and ``cuda_graph_max_bs_decode`` = the anchor's 64 requests), once per variant (env
``VARIANTS``, default ``colocated,colocated,no_cuda_graph``: the second ``colocated`` finds the JIT caches
the first one filled, as a user's second run does; ``colocated_fork`` is ``colocated`` with
``rollout.sglang_fast_start``: the server's workers forked from a process that imported most of their code
beside the server, instead of spawned to import it all again after the server did). Every
log line is stamped with the seconds since launch, so the gaps between SGLang's own milestones (imports, model
load, KV cache, CUDA-graph capture, ready) show where the time goes. Also (unless ``--no-import-profile``): the
seconds ``import sglang.srt.entrypoints.http_server`` takes alone.
Writes ``$OUT/sglang_startup.{json,md}`` and each server's stamped log under ``$OUT/logs/``.
``--cpu``: the embedded engine stands in (this script's own code paths, on a CPU machine).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from gpu.harness import log, table, write_json, write_text  # noqa: E402
from gpu.sglang_server import SERVER_ARGS  # noqa: E402
from gpu.workload import Workload  # noqa: E402

VARIANTS = {"colocated": {}, "no_cuda_graph": {"disable_cuda_graph": True}, "colocated_fork": {}}
# variants whose workers fork from a preloaded process (rollout.sglang_fast_start: rollout/engines/sglang/fast_start.py)
FORK_VARIANTS = {"colocated_fork"}
# SGLang log lines worth a column: the first line containing the text marks the milestone
MILESTONES = {"args_parsed": "server_args=", "init_torch_distributed": "Init torch distributed begin",
              "load_weight_begin": "Load weight begin", "load_weight_end": "Load weight end",
              "kv_cache": "KV Cache is allocated", "capture_begin": "Capture cuda graph begin",
              "capture_end": "Capture cuda graph end", "ready": "The server is fired up"}


def stamped(proc: subprocess.Popen, path: str, t0: float, seen: Dict[str, float]) -> threading.Thread:
    """Copies the server's output to ``path``, each line prefixed with the seconds since ``t0``; notes the
    first time each milestone's text appears."""
    def pump() -> None:
        with open(path, "w") as f:
            for line in proc.stdout:
                dt = time.perf_counter() - t0
                f.write(f"[+{dt:7.2f}s] {line}")
                f.flush()
                for name, text in MILESTONES.items():
                    if name not in seen and text.lower() in line.lower():
                        seen[name] = round(dt, 2)
    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def start_once(w: Workload, variant: str, index: int, logs: str, limit_s: float) -> Dict[str, Any]:
    from slime_hydra.rollout.engines import ServerSpec, make_engine
    from slime_hydra.utils.proc import free_port, kill_tree, wait_http

    cpu = w.device != "cuda"
    spec = ServerSpec(engine="embedded" if cpu else "sglang", model_path=w.ckpt, tokenizer_path=w.ckpt,
                      dtype="float32" if cpu else "bfloat16", device=w.device, gpus=1, seed=0, memory_saver=not cpu,
                      fast_start=variant in FORK_VARIANTS,
                      server_args={} if cpu else {**SERVER_ARGS, "cuda_graph_max_bs_decode": w.prompts * w.samples,
                                                   **VARIANTS[variant]})
    engine = make_engine(spec)
    port = free_port()
    cmd = engine.command("127.0.0.1", port, 0, nccl_port=free_port())
    env = {k: v for k, v in {**os.environ, **engine.env()}.items() if k not in engine.unset_env}
    path = os.path.join(logs, f"sglang_startup_{index}_{variant}.log")
    seen: Dict[str, float] = {}
    res: Dict[str, Any] = {"variant": variant, "command": " ".join(cmd[1:]), "milestones": seen}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    pump = stamped(proc, path, t0, seen)
    try:
        wait_http(f"http://127.0.0.1:{port}/health_generate", proc, limit_s, path)
        res["ready_s"] = round(time.perf_counter() - t0, 2)
    except Exception as e:  # noqa: BLE001 - a bench reports what failed and goes on to the next variant
        res["error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        kill_tree(proc, timeout=20)
        pump.join(timeout=5)
    log(f"{variant} #{index}: ready in {res.get('ready_s')}s; {seen}")
    return res


def importtime_summary(text: str, chains_of: int = 12) -> Dict[str, Any]:
    """``python -X importtime``'s report summed: the modules' own times in all, the slowest modules, the
    slowest top-level packages, and for the ``chains_of`` slowest packages the import chain that first brought
    each in (``[module, cumulative s]`` from the package up to the module the script imported)."""
    rows = []  # (own us, cumulative us, depth, module), children before their parent, as the report lists them
    for line in text.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((int(m[1]), int(m[2]), len(m[3]), m[4]))
    by_package: Counter = Counter()
    for own, _, _, name in rows:
        by_package[name.split(".")[0]] += own

    def chain(i: int) -> List[Any]:
        out = [[rows[i][3], round(rows[i][1] / 1e6, 2)]]
        for j in range(i + 1, len(rows)):  # the parent: the next row less indented
            if rows[j][2] < rows[i][2]:
                out.append([rows[j][3], round(rows[j][1] / 1e6, 2)])
                i = j
        return out

    first = {r[3]: i for i, r in reversed(list(enumerate(rows)))}  # a module's first (and only) import
    packages = [k for k, _ in by_package.most_common()]
    return {"importtime_total_s": round(sum(r[0] for r in rows) / 1e6, 2),
            "top_self": [[name, round(own / 1e6, 3)] for own, _, _, name in sorted(rows, reverse=True)[:25]],
            "top_packages": [[k, round(v / 1e6, 2)] for k, v in by_package.most_common(20)],
            "import_chains": {k: chain(first[k]) for k in packages[:chains_of] if k in first}}


def import_profile(cpu: bool, logs: str) -> Dict[str, Any]:
    """The server module's import alone, three ways: its seconds; ``python -X importtime`` (the modules that take
    longest, by their own time and by top-level package); and cProfile (the functions that take longest, which
    shows work done at import that is not importing: subprocesses, file-system scans, CUDA calls)."""
    mod = "slime_hydra.rollout.engines.embedded" if cpu else "sglang.srt.entrypoints.http_server"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {mod}"], check=True)
    res: Dict[str, Any] = {"import_s": round(time.perf_counter() - t0, 2)}
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {mod}"], check=True,
                         capture_output=True, text=True).stderr
    write_text(os.path.join(logs, "importtime.log"), out)
    res.update(importtime_summary(out))
    prof, script = os.path.join(logs, "import.prof"), os.path.join(logs, "import_only.py")
    write_text(script, f"import {mod}\n")
    subprocess.run([sys.executable, "-m", "cProfile", "-o", prof, script], check=True)
    report = "import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('tottime').print_stats(40); " \
             "s.sort_stats('cumulative').print_stats(60)"
    stats = subprocess.run([sys.executable, "-c", report, prof], capture_output=True, text=True).stdout
    write_text(os.path.join(logs, "import_cprofile.txt"), stats)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "results")))
    ap.add_argument("--variants", default=os.environ.get("VARIANTS", "colocated,colocated,no_cuda_graph"))
    ap.add_argument("--limit", type=float, default=240.0, help="seconds one start may take")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--no-import-profile", action="store_true",
                    help="skip the server module's import profile (three imports, about 80 s on an H200)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"--variants: unknown {sorted(unknown)} (known: {', '.join(VARIANTS)})")
    w = Workload("/tmp/startupbench", preset="tiny" if args.cpu else "qwen3_0_6b", device="cpu" if args.cpu else "cuda")
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    t0 = time.perf_counter()
    w.build()
    results: Dict[str, Any] = {"build_s": round(time.perf_counter() - t0, 1)}
    if not args.no_import_profile:
        results.update(import_profile(args.cpu, logs))
        log(f"checkpoint in {results['build_s']}s; server module import {results['import_s']}s; slowest modules "
            f"(own s): {results['top_self'][:10]}; by package: {results['top_packages'][:10]}")
    runs: List[Dict[str, Any]] = []
    for i, variant in enumerate(variants):
        runs.append(start_once(w, variant, i, logs, args.limit))
        results["runs"] = runs
        write_json(os.path.join(args.out, "sglang_startup.json"), results)
    cols = list(MILESTONES)
    profile = [f"server module import alone: {results['import_s']} s (`-X importtime`'s own times add up to "
               f"{results['importtime_total_s']} s)", "",
               "slowest packages, their modules' own import seconds: "
               + ", ".join(f"{k} {v}" for k, v in results["top_packages"][:12]), ""] if "import_s" in results else []
    lines = [f"# SGLang start-up, {w.preset} shape (seconds since launch)", "", *profile,
             *table(["variant", "ready s", *cols], [[r["variant"], r.get("ready_s", r.get("error")),
                                                    *(r["milestones"].get(c) for c in cols)] for r in runs])]
    write_text(os.path.join(args.out, "sglang_startup.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
