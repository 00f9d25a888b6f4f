"""Real SGLang 0.5.17 on the lent GPU machine, against raw SGLang, the embedded engine and TRL, in one call.
How a GPU run is set up (bundles, environment, results): bench/README.md.

    bash bench/sglang_gpu.sh                      # one H200 colocated, TRL's anchor workload (8 x 8 x 256)
    WORKLOAD=256x256 bash bench/sglang_gpu.sh     # the same table for 32 prompts x 8 samples x 256 tokens
    bash bench/sglang_gpu_split.sh                # two H200s: trainer on GPU 0, SGLang on GPU 1, async

Phases (``--phases``, in this order; each a child process with its own time limit, so one that hangs or dies
leaves the others, and one that the budget cannot fit is skipped and reported), on a Qwen3-0.6B-shaped
random checkpoint and prompts of 64 random words:
  raw       SGLang from the engine class's own command line, the GRPO step's requests sent straight to it:
            the reference time; then checks against the live server (bench/gpu/sglang_server.py).
  sglang    python run.py rollout=sglang algo=grpo (no KL loss, as TRL's default), colocated without
            offload (nothing moves, the push reads the trainer's GPU tensors; split: the layout's own):
            per-step rollout, train and sync seconds, the train/rollout log-prob gap, startup (to the first
            step) and its parts as the run reports them (``startup/*`` of its first row: launch/startup.py; the
            SGLang server's parts from its log's timestamps).
  sglang_offload  the same with both offloads (the trainer's state to the host while SGLang generates,
            SGLang's memory released while the trainer trains).
  sglang_warm     the sglang run again (``--warm-steps``, default 2): its start-up with what the first start left
            on the machine (Triton's kernel cache, Python's bytecode, the page cache); not a default phase.
            ``--warm-overrides`` (env WARM_OVERRIDES) adds run.py overrides to it (and to sglang_variant).
  sglang_variant  the same as sglang_warm with ``--variant-overrides`` (env VARIANT_OVERRIDES) added: a start-up
            flag tried against sglang_warm in the same call; not a default phase, skipped without overrides.
  trl       TRL's GRPOTrainer (HF generate) on the same checkpoint, prompts and batch (bench/gpu/trl_step.py).
  embedded  the run.py run with the embedded engine (fewer steps); not a default phase (one 10-minute call
            holds three SGLang start-ups, not a fourth run).
  stop      the sglang run stopped (SIGTERM, as Ctrl-C is) ``STOP_AFTER_S`` after its launch, while SGLang starts:
            a check that nothing of it is left on the GPU (nvidia-smi's processes) once run.py has exited; not a
            default phase.

Writes ``$OUT/sglang_gpu_<layout>[_<workload>].json`` and ``.md`` (a table) as it goes, the logs' tails to
``$OUT/logs/``, and exits non-zero when a check failed or a phase did not finish; speed goals (issue 24) are
reported as met or missed, not checked. ``--cpu``: a dry run of this script's own code on a CPU (the tiny
model, 16 new tokens, the embedded engine in place of SGLang: it speaks the same protocol).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import signal
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from gpu import harness as h  # noqa: E402 - bench/ is on the path from here
from gpu.sglang_server import SERVER_ARGS, phase_raw, sglang_batches, sglang_log_times  # noqa: E402
from gpu.trl_step import phase_trl  # noqa: E402
from gpu.workload import Workload  # noqa: E402

# issue 24, one H200 colocated, by workload: seconds a step and of training (medians after the first step), and
# from `python run.py` to the first step done; and the rollout against raw SGLang on the same requests (issue 10)
GOALS = {"anchor": {"step_s": 1.0, "train_s": 0.30, "start_s": 60.0}, "256x256": {"train_s": 1.5}}
ROLLOUT_VS_RAW = 1.5
WORKLOADS = {"anchor": (8, 8, 256), "256x256": (32, 8, 256)}  # prompts, samples per prompt, new tokens
MICRO_BATCH = 16  # samples per micro-batch, ours and TRL's
PHASES = ("build", "raw", "sglang", "sglang_warm", "sglang_variant", "sglang_offload", "trl", "embedded", "stop")
DEFAULT_PHASES = ("build", "raw", "sglang", "sglang_offload", "trl")
RUN_PHASES = ("sglang", "sglang_warm", "sglang_variant", "sglang_offload", "embedded")  # python run.py
# what each run phase adds to run.py's command line (colocated layout)
NO_OFFLOAD = ["parallelism.offload_train=false", "parallelism.offload_rollout=false"]
OFFLOAD = {"sglang": NO_OFFLOAD, "sglang_warm": NO_OFFLOAD, "sglang_variant": NO_OFFLOAD,
           "sglang_offload": ["parallelism.offload_train=true", "parallelism.offload_rollout=true"], "embedded": []}
# phase -> (the least it finishes in, the most it may take), seconds on one H200. Seen there on 2026-12-01:
# build 43 s, raw 145-156 s (SGLang up in 135-156 s), sglang 147-176 s and sglang_offload 120 s (run.py's
# first step after 96-131 s, the final checkpoint 22 s after the last step: the runs now save none,
# trainer.save_last=false), trl 45 s, embedded 150 s (2 steps of 26 s). Three SGLang start-ups do not leave room
# for the embedded run in one 10-minute call, so it runs only when asked for (PHASES=...,embedded).
PLAN = {"build": (20, 90), "raw": (150, 180), "sglang": (150, 230), "sglang_warm": (70, 150),
        "sglang_variant": (70, 170), "sglang_offload": (125, 160), "trl": (50, 120), "embedded": (120, 170),
        "stop": (70, 100)}
# the stop phase's SIGTERM: SGLang's scheduler is up by then, capturing its graphs (a server imports for 20-25 s, its
# start takes 40-130 s: bench/measured/h200_kv_cap.md)
STOP_AFTER_S = 40.0
# a larger shape (SHAPE=qwen3_4b) builds a larger checkpoint, and TRL's steps are longer: its build ran past 90 s
# on 2026-12-02 (the scale bench builds the same 4B checkpoint in about 50 s, without the tokenizer and prompts)
LARGE_SHAPE_PLAN = {"build": (60, 240), "trl": (120, 360)}


def workload(args) -> Workload:
    prompts, samples, new_tokens = WORKLOADS[args.workload]
    if args.cpu:  # the tiny model's context is short
        return Workload("/tmp/sglbench_cpu", "tiny", prompts, samples, 16, prompt_words=8, words=20, device="cpu")
    return Workload("/tmp/sglbench", args.shape, prompts, samples, new_tokens)


# ------------------------------------------------------------------------------ runs (phase)
def run_overrides(w: Workload, layout: str, phase: str, steps: int, extra: str = "") -> List[str]:
    """run.py's command line for a run phase; on CPU (--cpu) the embedded engine stands in for SGLang."""
    engine = "embedded" if phase == "embedded" or w.device == "cpu" else "sglang"
    common = [f"model={w.preset}", f"model.path={w.ckpt}", "model.tokenizer=null", "data=jsonl",
              f"data.path={w.data}", "data.apply_chat_template=false", "eval.datasets=[]",
              f"rollout.batch_size={w.prompts}", f"rollout.n_samples_per_prompt={w.samples}",
              f"rollout.max_response_len={w.new_tokens}", f"trainer.num_rollout={steps}",
              f"trainer.micro_batch_size={MICRO_BATCH}", "trainer.save_interval=0", "trainer.save_last=false",
              "logging.wandb=false", "logging.progress=false", "sync.max_logprob_diff=0.05",
              # no KL loss: TRL's default (beta 0), so both run the same objective; algo=grpo's KL 0.04 adds a
              # reference pass, which bench/train_gpu.py times
              "algo.kl_loss_coef=0"]
    if w.device == "cpu":
        common += ["parallelism=cpu_colocate"] if layout == "colocated" else ["parallelism=cpu", "trainer.mode=async"]
    elif layout == "colocated":
        common += ["parallelism=1gpu"]
    else:
        common += ["parallelism=1gpu", "parallelism.name=split_1_1", "parallelism.colocate=false",
                   "parallelism.gpus_per_node=2", "parallelism.rollout_gpus=1", "trainer.mode=async"]
    if layout == "colocated":
        common += OFFLOAD[phase]
    if engine == "sglang":
        # the CUDA graphs are slime_hydra's defaults (rollout/engines/sglang/launch.py startup_server_args): decode
        # graphs up to the plan's engine batch (64 here), no prefill graph
        common += ["rollout=sglang",
                   f"rollout.server_args.mem_fraction_static={SERVER_ARGS['mem_fraction_static']}",
                   *(f"+rollout.server_args.{k}={v}" for k, v in SERVER_ARGS.items() if k != "mem_fraction_static")]
    else:
        common += ["rollout=embedded", f"rollout.embedded_max_batch={w.prompts * w.samples}"]
    return common + extra.split()


def phase_run(w: Workload, layout: str, phase: str, steps: int, limit_s: float, out: Dict[str, Any],
              extra: str = "", cpu_probe: bool = False, profile_s: float = 0.0) -> None:
    """One run.py run (sglang, sglang_offload, embedded); after the second step, each GPU's SM clock and power while
    busy, and split, its idle share; each step's rollout (``rollout_windows``); with ``profile_s``, where the busiest
    process (SGLang's scheduler) spent ``profile_s`` seconds from step 3 on (py-spy)."""
    from slime_hydra.utils.proc import tail

    run_dir = os.path.join(w.work, f"run_{layout}_{phase}")
    console = os.path.join(w.work, f"run_{layout}_{phase}.out")
    overrides = run_overrides(w, layout, phase, steps, extra)
    out["command"] = "python run.py " + " ".join(overrides) + f" hydra.run.dir={run_dir}"
    out["extra_overrides"] = extra
    sampler = h.GpuSampler(os.path.join(w.work, f"gpu_{layout}_{phase}.csv")) if w.device == "cuda" else None
    cpu = h.CpuSampler()
    probe = h.CpuProbe(os.path.join(w.work, f"cpu_probe_{layout}_{phase}.txt")) if cpu_probe else None
    metrics = os.path.join(run_dir, "metrics.jsonl")
    # once the second step's row is written (from step 3 on), the busiest process: SGLang's scheduler, a CPU's worth
    # all run
    profile = h.StackProfile(os.path.join(w.work, f"stacks_{layout}_{phase}.txt"),
                             lambda: cpu.busiest() if len(h.read_rows(metrics)) >= 2 else None,
                             seconds=profile_s) if profile_s else None
    try:
        run = h.run_py(overrides, run_dir, console, limit_s)
    finally:
        cpu.stop()
        if probe is not None:
            probe.stop()
        if profile is not None:
            profile.stop()
            out["scheduler_profile"] = profile.summary()
    if sampler is not None:
        sampler.stop()
    rows = run.rows
    out.update(returncode=run.returncode, wall_s=run.wall_s, rows=rows)
    if rows:
        out["startup_s"] = run.seen[rows[0]["step"]] - rows[0]["perf/step_time"]  # launch -> first step begins
        out["after_last_step_s"] = run.wall_s - run.seen[rows[-1]["step"]]  # shutdown (the runs save no checkpoint)
        first = next((r for r in rows if "startup/total_s" in r), {})  # the run's own account (launch/startup.py)
        out["startup"] = {k.removeprefix("startup/"): v for k, v in first.items() if k.startswith("startup/")}
    out["log_times"] = run_log_times(run_dir)
    out["run_dir"] = run_dir
    if sampler is not None and len(rows) > 2:
        after_second = run.started + run.seen[rows[1]["step"]]
        out["gpu_busy"] = sampler.busy(after_second)  # SM clock and power while busy: a slow run's GPU, throttled?
        if layout != "colocated":
            out["gpu_idle"] = sampler.idle_share(after_second)
    out["rollouts"] = rollout_windows(run, sampler, cpu, probe, engine_batches(run_dir))
    out["console_tail"] = tail(console, 25)
    h.log(f"{phase}: rc={run.returncode}, {len(rows)} steps, wall {run.wall_s:.0f}s")


def phase_stop(w: Workload, layout: str, out: Dict[str, Any]) -> None:
    """run.py stopped while SGLang starts: what ran on the GPU just before the stop (SGLang's scheduler, if it was up
    by then), and what is left 5 s after run.py has exited (a scheduler forked from SGLang's forkserver once outlived
    such a stop with 70 GB of the H200). A python process left is then killed, so that it cannot spoil a later
    phase."""
    run_dir = os.path.join(w.work, f"run_{layout}_stop")
    console = os.path.join(w.work, f"run_{layout}_stop.out")
    run = h.run_py(run_overrides(w, layout, "sglang", 2), run_dir, console, STOP_AFTER_S,
                   before_stop=lambda: out.update(gpu_apps_before=h.gpu_apps()))
    time.sleep(5)
    left = h.gpu_apps()
    out.update(returncode=run.returncode, stopped_after_s=STOP_AFTER_S, exited_after_s=round(run.wall_s, 1),
               gpu_apps_left=left)
    for app in left or []:
        if app["here"] and "python" in app["cmd"]:
            with contextlib.suppress(OSError):
                os.kill(app["pid"], signal.SIGKILL)
    h.log(f"stop: run.py exited {run.wall_s:.1f}s after its launch (rc {run.returncode}); on the GPU before the "
          f"stop: {out.get('gpu_apps_before')}; left: {left}")


def engine_batches(run_dir: str) -> List[Dict[str, Any]]:
    """SGLang's batch lines from the run's engine logs (``sglang_batches``), in time order."""
    paths = [os.path.join(root, f) for root, _, files in os.walk(run_dir) for f in files
             if f.startswith("engine_") and f.endswith(".log")]
    return sorted((b for p in paths for b in sglang_batches(p)), key=lambda b: b["t"])


def rollout_windows(run: "h.Run", gpu: "h.GpuSampler | None", cpu: "h.CpuSampler", probe: "h.CpuProbe | None",
                    batches: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each step's rollout: its seconds, SGLang's batches (the new sequences of each prefill: one of 64 when the step's
    requests arrive together, more and smaller when they do not, and the decode lines' tokens a second), the GPU's
    clocks while busy, the busiest processes on the CPU over it (each with the CPU it ran on, that CPU's steal share and
    the process's involuntary context switches) and every CPU's load, and (``--cpu-probe``) how fast the busiest
    process's CPU and all CPUs ran Python then against the run's usual (``CpuProbe``). The rollout is the first part of
    a synchronous step, which ends when its row is written; rows are polled every 0.2 s, so a window may be up to 0.2 s
    late. Why one run's rollouts took 0.94 s where another's took 0.74 s (bench/measured/h200_kv_cap.md)."""
    out = []
    for row in run.rows:
        if row.get("step") not in run.seen or "perf/rollout_time" not in row:
            continue
        start = run.started + run.seen[row["step"]] - row.get("perf/step_time", 0.0)
        end = start + row["perf/rollout_time"]
        inside = [b for b in batches if start - 0.2 <= b["t"] <= end + 0.2]
        busiest = cpu.window(start, end)
        on_cpus = busiest[0].get("on_cpus", []) if busiest else []  # SGLang's scheduler, busy all the rollout
        out.append({"step": row["step"], "rollout_s": round(row["perf/rollout_time"], 3),
                    "prefills": [b["prefill_seqs"] for b in inside if "prefill_seqs" in b],
                    "decode_tokens_per_s": [b["tokens_per_s"] for b in inside if "tokens_per_s" in b],
                    "gpu": gpu.busy(start, end) if gpu is not None else None, "cpu": busiest,
                    "host": cpu.host(start, end),
                    "probe": probe.window(start, end, on_cpus) if probe is not None else None})
    return out


def run_log_times(run_dir: str) -> Dict[str, Any]:
    """Startup milestones from the run's logs: engines up (the fleet's own count), first weight push,
    SGLang's weight load and graph captures."""
    out: Dict[str, Any] = {}
    for root, _, files in os.walk(run_dir):
        for f in (f for f in files if f.endswith(".log")):
            text = open(os.path.join(root, f), errors="replace").read()
            m = re.search(r"engine\(s\) up in ([\d.]+)s", text)
            if m:
                out["engines_up_s"] = float(m.group(1))
            m = re.search(r"weights v0 pushed to the engines \(([\d.]+)s", text)
            if m:
                out["first_push_s"] = float(m.group(1))
            if f.startswith("engine_") and not any(k.startswith("capture_") for k in out):
                out.update(sglang_log_times(os.path.join(root, f)))
    out["logs"] = os.path.join(run_dir, "logs")
    return out


# ----------------------------------------------------------------------------------- report
def summarize_run(res: Dict[str, Any]) -> Dict[str, Any]:
    """Medians after the first step. sync_all: the weight push plus the memory moved before training
    (perf/offload_time), i.e. every offload and onload of the step (issue 10's goal counts them all)."""
    rows = res.get("rows") or []
    s = {k: h.steady(rows, f"perf/{k}") for k in ("step_time", "rollout_wait_time", "rollout_time", "train_time",
                                                "weight_sync_time", "offload_time", "weight_push_time",
                                                "weight_transfer_time", "train_actor_time")}
    s["sync_all"] = (s["weight_sync_time"] or 0.0) + (s["offload_time"] or 0.0) \
        if s["weight_sync_time"] is not None else None
    gaps = [r["train/train_rollout_logprob_abs_diff"] for r in rows if "train/train_rollout_logprob_abs_diff" in r]
    s["logprob_gap_max"] = max(gaps, default=None)
    s["logprob_gap_median"] = h.steady(rows, "train/train_rollout_logprob_abs_diff")
    gb = h.steady(rows, "perf/weight_sync_bytes")
    s["sync_gb"] = gb / 1e9 if gb else None
    s["sync_ms_per_gb"] = 1000 * s["sync_all"] / s["sync_gb"] if gb and s["sync_all"] else None
    s["steps"] = len(rows)
    return s


ROW_NAMES = {"sglang": "run.py sglang, no offload", "sglang_warm": "run.py sglang, again (warm caches)",
             "sglang_variant": "run.py sglang, warm, variant", "sglang_offload": "run.py sglang, offload",
             "embedded": "run.py embedded", "trl": "TRL GRPOTrainer (HF generate)"}


def report(results: Dict[str, Any], w: Workload, path: str) -> None:
    h.write_json(path + ".json", results)
    lines = [f"# SGLang on the GPU: {results['layout']}, workload {results.get('workload')} "
             f"({results.get('gpu', '?')})", "",
             "Seconds per GRPO step, medians of the steps after the first. rollout wait: the driver waiting for "
             "the rollout (async: it overlaps training); rollout: the rollout's own time; sync: the weight push "
             "with the memory moved around it, plus what moved before training (offload s); sync ms/GB counts "
             "both; log-prob gap: mean |engine - trainer| per step, the largest step. TRL: rollout = its "
             "generation and scoring, train = the rest of the step, no sync (one model).", "",
             f"{w.preset} shape, random bf16 weights; {w.prompts} prompts x {w.samples} samples x {w.new_tokens} "
             f"new tokens a step; `{results.get('cmdline', '')}`", ""]
    raw = results.get("raw", {})
    ref = (raw.get("grpo_step_requests") or {}).get("median_s")
    rows: List[List[Any]] = [["raw SGLang (same requests)", h.cell(raw.get("startup_s", 0), ".1f"), "", "",
                              h.cell(ref, ".3f")]] if ref else []
    summaries = {n: summarize_run(results[n]) for n in ROW_NAMES if (results.get(n) or {}).get("rows")}
    for name in ("sglang", "sglang_warm", "sglang_variant", "sglang_offload", "trl", "embedded"):
        res = results.get(name)
        if res and name not in summaries:
            why = res.get("skipped") or res.get("error") or f"rc {res.get('phase_rc')}"
            rows.append([ROW_NAMES[name], f"no steps: {str(why)[:80]}"])
        elif res:
            s = summaries[name]
            rows.append([ROW_NAMES[name], h.cell(res.get("startup_s"), ".1f"), h.cell(s["step_time"]),
                         h.cell(s["rollout_wait_time"]), h.cell(s["rollout_time"]), h.cell(s["train_time"]),
                         h.cell(s["weight_sync_time"]), h.cell(s["offload_time"]), h.cell(s["sync_ms_per_gb"], ".0f"),
                         h.cell(s["logprob_gap_max"], ".4f"), s["steps"]])
    lines += h.table(["", "startup s", "step s", "rollout wait s", "rollout s", "train s", "sync s", "offload s",
                    "sync ms/GB", "log-prob gap (max)", "steps"], rows)
    for name in RUN_PHASES:
        if (results.get(name) or {}).get("extra_overrides"):
            lines.append(f"- {ROW_NAMES[name]}: `{results[name]['extra_overrides']}`")
    trl_step = summaries["trl"]["step_time"] if "trl" in summaries else None
    for name in RUN_PHASES:
        if trl_step and name in summaries and summaries[name]["step_time"]:
            lines.append(f"- {ROW_NAMES[name]}: {trl_step / summaries[name]['step_time']:.1f}x as fast as TRL a step")
    for name in ("raw", *RUN_PHASES):
        res = results.get(name) or {}
        times = res.get("server_log_times") or res.get("log_times")
        if times:
            lines.append(f"- {name} startup parts: " + ", ".join(f"{k} {v}" for k, v in times.items() if k != "logs"))
        prof = res.get("scheduler_profile") or {}
        if prof.get("self"):
            lines.append(f"- {name} SGLang's scheduler (pid {prof['pid']}: {prof['cmd']}), where its samples were "
                         f"(py-spy, {prof['samples']} samples, self): "
                         + ", ".join(f"{f} {share:.1%}" for f, share in prof["self"][:8]))
        elif prof.get("error"):
            lines.append(f"- {name} scheduler profile: {prof['error']}")
        s = summaries.get(name, {})
        if s.get("weight_push_time") is not None:
            lines.append(f"- {name} sync parts (medians): the push {s['weight_push_time']:.3f} s, of which the "
                         f"weights' transfer {s['weight_transfer_time']:.3f} s (the rest: pause, cache flush, resume, "
                         "version check)")
        if s.get("train_actor_time") is not None and s.get("train_time") is not None:
            lines.append(f"- {name} train parts (medians): {s['train_actor_time']:.3f} s inside the trainer of "
                         f"{s['train_time']:.3f} s (the rest: Ray's hand-over of the data and the answer)")
        if res.get("gpu_idle"):
            lines.append(f"- {name} GPU idle share after step 2: {res['gpu_idle']}")
        for r in res.get("rollouts") or []:
            clocks = "; ".join(f"{g} SM {b.get('sm_mhz_mean', '?')} MHz, memory {b.get('mem_mhz_mean', '?')} MHz"
                               for g, b in (r.get("gpu") or {}).items())
            busiest = ", ".join(f"{c['cpu']:.2f} {c['cmd'][:40]!r}" for c in r["cpu"])
            lines.append(f"- {name} step {r['step']} rollout {r['rollout_s']:.2f} s: prefills of "
                         f"{'+'.join(map(str, r.get('prefills') or [])) or '?'} sequences, decode "
                         f"{', '.join(f'{x:.0f}' for x in r.get('decode_tokens_per_s') or []) or '?'} tokens/s; "
                         f"{clocks or 'no GPU samples'}; CPU: {busiest or 'no samples'}")
        for gpu, b in (res.get("gpu_busy") or {}).items():
            lines.append(f"- {name} {gpu} while busy after step 2 ({b['samples']} samples of 200 ms): SM clock "
                         f"{b.get('sm_mhz_mean', '?')} MHz mean, {b.get('sm_mhz_min', '?')} lowest; "
                         f"{b.get('power_w_mean', '?')} W; memory clock {b.get('mem_mhz_mean', '?')} MHz")
    lines += startup_table(results)
    if (results.get("trl") or {}).get("config"):
        lines.append(f"- trl: {results['trl'].get('versions')}, {results['trl']['config']}, "
                     f"peak {h.cell(results['trl'].get('peak_gib'), '.1f')} GiB")
    if results.get("goals"):
        lines += ["", "Goals (issue 24; the rollout against raw SGLang: issue 10):"]
        lines += [f"- {ROW_NAMES[n]}: " + "; ".join(f"{k} {v}" for k, v in g.items())
                  for n, g in results["goals"].items()]
    h.write_text(path + ".md", "\n".join(lines + ["", "Checks:"] + h.check_lines(results)) + "\n")


# the start-up parts shown, in order (the run's startup/* keys; engine_*: the slowest SGLang server's own parts)
STARTUP_COLUMNS = [("total", "to step 1 done"), ("before_train", "before train"), ("ray_init", "Ray"),
                   ("placement_group", "PG"), ("initial_checkpoint", "ckpt"), ("trainers", "trainers"),
                   ("trainer_warm_up", "warm-up"),
                   ("rollout_side", "rollout side"), ("engine_server", "SGLang"), ("engine_process", "process"),
                   ("engine_distributed_init", "dist"), ("engine_weights", "weights"),
                   ("engine_kv_cache", "KV"), ("engine_cuda_graphs", "graphs"), ("engine_http_server", "HTTP"),
                   ("engine_first_answer", "1st answer"), ("engine_prebuild", "kernels"),
                   ("wait_for_rollout_side", "wait"),
                   ("first_push", "push"), ("first_step", "step 1"), ("late_checks", "args check"),
                   ("engine_kv_tokens", "KV tokens")]


def startup_table(results: Dict[str, Any]) -> List[str]:
    """The run phases' start-up parts, seconds (issue 24's goal: 60 s to the first step done)."""
    def cell(start: Dict[str, Any], key: str) -> str:
        return h.cell(start.get(key), ",.0f") if key.endswith("_tokens") else h.cell(start.get(f"{key}_s"), ".1f")

    rows = [[ROW_NAMES[n], *(cell(results[n].get("startup") or {}, k) for k, _ in STARTUP_COLUMNS)]
            for n in RUN_PHASES if (results.get(n) or {}).get("startup")]
    if not rows:
        return []
    return ["", "Start-up, seconds from `python run.py` (launch/startup.py; the trainers build while the rollout "
            "side starts; SGLang: the slowest server from its process start to its first answer, and its parts "
            "from its log):", "", *h.table(["", *(name for _, name in STARTUP_COLUMNS)], rows)]


def goals(results: Dict[str, Any]) -> Dict[str, Dict[str, str]]:
    """Each run phase's numbers against the workload's goals (``GOALS``), "met" or "missed"."""
    targets = GOALS.get(results.get("workload", "anchor"), {})
    raw = (results.get("raw", {}).get("grpo_step_requests") or {}).get("median_s")
    out: Dict[str, Dict[str, str]] = {}
    for name in RUN_PHASES:
        if name == "embedded" or not (results.get(name) or {}).get("rows"):
            continue
        s = summarize_run(results[name])
        got = {"step_s": s["step_time"], "train_s": s["train_time"],
               "start_s": (results[name].get("startup") or {}).get("total_s")}
        row = {k: f"{got[k]:.2f} ({'met' if got[k] <= goal else 'missed'}, goal {goal:g})"
               for k, goal in targets.items() if got.get(k) is not None}
        if raw and s["rollout_time"]:
            r = s["rollout_time"] / raw
            row["rollout_vs_raw"] = f"{r:.2f}x ({'met' if r <= ROLLOUT_VS_RAW else 'missed'}, goal {ROLLOUT_VS_RAW:g}x)"
        out[name] = row
    return out


# ------------------------------------------------------------------------------------- main
def steps_of(phase: str, args) -> int:
    return {"sglang": args.steps, "sglang_warm": args.warm_steps, "sglang_variant": args.warm_steps,
            "sglang_offload": args.offload_steps, "embedded": args.embedded_steps, "trl": args.trl_steps}.get(phase, 0)


def phase_overrides(phase: str, args) -> str:
    """The run phase's extra overrides: SGLANG_OVERRIDES for every SGLang run, WARM_OVERRIDES on top for
    sglang_warm and sglang_variant, VARIANT_OVERRIDES on top of those for sglang_variant (three runs, each
    adding one change to the one before)."""
    if phase == "embedded":
        return ""
    extra = [args.warm_overrides] if phase in ("sglang_warm", "sglang_variant") else []
    extra += [args.variant_overrides] if phase == "sglang_variant" else []
    return " ".join([args.sglang_overrides, *extra]).strip()


def run_phase(args, w: Workload) -> None:
    """One phase, in the child process that ``run_child`` started."""
    with h.phase_output(os.path.join(w.work, f"phase_{args.layout}_{args.phase}.json")) as out:
        if args.phase == "build":
            t0 = time.perf_counter()
            w.build()
            out["build_s"] = time.perf_counter() - t0
        elif args.phase == "raw":
            phase_raw(w, args.layout, out)
        elif args.phase in RUN_PHASES:
            phase_run(w, args.layout, args.phase, steps_of(args.phase, args), args.limit - 15, out,
                      phase_overrides(args.phase, args), cpu_probe=args.cpu_probe, profile_s=args.profile_scheduler)
        elif args.phase == "trl":
            phase_trl(w, args.trl_steps, MICRO_BATCH, out)
        elif args.phase == "stop":
            phase_stop(w, args.layout, out)


def check_phase(results: Dict[str, Any], phase: str, args, w: Workload) -> None:
    """A run phase's own checks: all its steps, one request per group, the log-prob gap within bf16's."""
    res = results[phase]
    s = summarize_run(res) if res.get("rows") else {}
    want = steps_of(phase, args)
    h.check(results, f"run_{phase}", res.get("returncode") == 0 and s.get("steps") == want,
          f"rc {res.get('returncode')}, {s.get('steps', 0)}/{want} steps, wall {res.get('wall_s', 0):.0f}s"
          + (f"; {res['error']}" if res.get("error") else ""))
    reqs = [r["rollout/generate_requests"] for r in res.get("rows") or [] if "rollout/generate_requests" in r]
    if reqs:  # the default generate function sends a group as one batched request
        h.check(results, f"group_requests_{phase}", all(n == w.prompts for n in reqs),
              f"{reqs} generate requests a step for {w.prompts} groups of {w.samples}")
    if s.get("logprob_gap_max") is not None and phase != "trl":
        h.check(results, f"logprob_gap_{phase}", s["logprob_gap_max"] < 0.05,
              f"max {s['logprob_gap_max']:.4f}, median {s['logprob_gap_median']:.4f} (bf16 engine, "
              "fp32 master weights under autocast; limit 0.05)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", choices=["colocated", "split"], default="colocated")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default=os.environ.get("WORKLOAD", "anchor"),
                    help="anchor: 8 prompts x 8 samples x 256 tokens; 256x256: 32 x 8 x 256 (env WORKLOAD)")
    ap.add_argument("--shape", default=os.environ.get("SHAPE", "qwen3_0_6b"),
                    help="the model shape (conf/model/; env SHAPE): e.g. qwen3_4b with PHASES=build,trl for TRL on "
                         "the 4B shape (the run phases' memory settings are the 0.6B shape's)")
    ap.add_argument("--phases", default=os.environ.get("PHASES", ",".join(DEFAULT_PHASES)),
                    help=f"comma-separated, in this order: {','.join(PHASES)} (env PHASES; build always runs)")
    ap.add_argument("--steps", type=int, default=6, help="steps of the sglang run (no offload)")
    ap.add_argument("--offload-steps", type=int, default=4, help="steps of the sglang run with offload")
    ap.add_argument("--embedded-steps", type=int, default=2)
    ap.add_argument("--warm-steps", type=int, default=int(os.environ.get("WARM_STEPS", 2)),
                    help="steps of sglang_warm and sglang_variant (env WARM_STEPS)")
    ap.add_argument("--warm-overrides", default=os.environ.get("WARM_OVERRIDES", ""),
                    help="run.py overrides that sglang_warm and sglang_variant add to the sglang run's (env "
                         "WARM_OVERRIDES)")
    ap.add_argument("--variant-overrides", default=os.environ.get("VARIANT_OVERRIDES", ""),
                    help="run.py overrides that sglang_variant adds to sglang_warm's (env VARIANT_OVERRIDES)")
    ap.add_argument("--trl-steps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BENCH_BUDGET_S", 540)),
                    help="seconds for all phases (env BENCH_BUDGET_S; with the setup, within 9 minutes)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--cpu", action="store_true", help="a dry run of this script on a CPU machine (see above)")
    ap.add_argument("--sglang-overrides", default=os.environ.get("SGLANG_OVERRIDES", ""),
                    help="more run.py overrides for the sglang runs, space-separated (env SGLANG_OVERRIDES)")
    ap.add_argument("--skip-embedded", action="store_true", default=bool(os.environ.get("SKIP_EMBEDDED")),
                    help="no embedded run (env SKIP_EMBEDDED=1)")
    ap.add_argument("--profile-scheduler", type=float, default=float(os.environ.get("PROFILE_SCHEDULER") or 0),
                    help="seconds of py-spy on SGLang's scheduler from each run's step 3 (env PROFILE_SCHEDULER)")
    ap.add_argument("--cpu-probe", action="store_true", default=os.environ.get("CPU_PROBE", "0") not in ("", "0"),
                    help="time the same Python on every CPU over each run, h.CpuProbe (env CPU_PROBE=1)")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    w = workload(args)
    os.makedirs(w.work, exist_ok=True)
    if args.phase:
        return run_phase(args, w)
    wanted = {p.strip() for p in args.phases.split(",") if p.strip()} | {"build"}
    unknown = wanted - set(PHASES)
    if unknown:
        ap.error(f"--phases: unknown {sorted(unknown)} (known: {', '.join(PHASES)})")
    if args.layout == "split":
        wanted.discard("sglang_offload")  # nothing takes turns on a GPU of its own
    if args.skip_embedded:
        wanted.discard("embedded")
    if not args.variant_overrides.strip():
        wanted.discard("sglang_variant")
    phases = [p for p in PHASES if p in wanted]
    path = os.path.join(args.out, f"sglang_gpu_{args.layout}" + ("" if args.workload == "anchor" else
                                                                 f"_{args.workload}")
                        + ("" if args.shape == "qwen3_0_6b" else f"_{args.shape}"))
    names = ["cpu (dry run)"] if args.cpu else h.gpu_names()
    results: Dict[str, Any] = {"layout": args.layout, "workload": args.workload, "gpu": (names or [""])[0],
                               "gpus": len(names), "host_cpus": h.host_cpus(), "cmdline": " ".join(sys.argv)}
    # what the phases after this one need stays theirs (--cpu: only the budget counts)
    needs = {p: (0, args.budget) for p in phases} if args.cpu else \
        PLAN if args.shape == "qwen3_0_6b" else {**PLAN, **LARGE_SHAPE_PLAN}
    try:
        for phase, limit, skipped in h.Budget(args.budget).plan(phases, needs):
            if skipped:
                results[phase] = {"skipped": skipped}
                h.check(results, f"phase_{phase}", False, f"no time left ({skipped})")
                continue
            results[phase] = h.run_child(phase, limit, os.path.join(w.work, f"phase_{args.layout}_{phase}.json"))
            results.setdefault("checks", {}).update(results[phase].pop("checks", {}))
            rc = results[phase].get("phase_rc")
            if phase in ("build", "raw") and rc != 0:
                why = results[phase].get("error", "see the log above")
                h.check(results, f"phase_{phase}", False, f"rc {rc}: {why}")
                if phase == "build":
                    break
            if phase in RUN_PHASES or phase == "trl":
                check_phase(results, phase, args, w)
            if phase == "stop":
                left = results[phase].get("gpu_apps_left")
                res = results[phase]
                h.check(results, "stop_leaves_nothing", left == [] or (args.cpu and left is None),  # no nvidia-smi
                        f"run.py SIGTERMed {STOP_AFTER_S:g} s after launch, exited after {res.get('exited_after_s')} s "
                        f"(rc {res.get('returncode')}); on the GPU just before: {res.get('gpu_apps_before')}; "
                        f"5 s after: {left}")
            results["goals"] = goals(results)
            report(results, w, path)
        results["goals"] = goals(results)
        report(results, w, path)
        print(open(path + ".md").read())
    finally:
        h.copy_logs(os.path.join(args.out, "logs"), glob.glob(f"{w.work}/raw_{args.layout}_server.log") +
                  sorted(glob.glob(f"{w.work}/run_{args.layout}_*.out")),
                  sorted(glob.glob(f"{w.work}/run_{args.layout}_*/")))
    if h.failed(results):
        h.log(f"FAILED: {h.failed(results)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
