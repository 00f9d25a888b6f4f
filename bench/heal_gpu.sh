#!/usr/bin/env bash
# Self-healing on one H200 with real SGLang, in one device call of at most 9 minutes (bench/heal_gpu.py says
# what it does): one run.py run, colocated, with three SIGKILLs: the SGLang server while it starts, the SGLang
# server inside a CUDA IPC weight push, the trainer rank mid-step. Per fault: seconds to heal, GPU memory
# before the fault and after the healing (nvidia-smi); the run must end with every step's row once.
# bench/README.md says how the device calls are set up (the SGLang bundle in one call, then this one).
# FAULTS= picks faults (startup,push,trainer), STEPS the run's steps (5), BENCH_BUDGET_S the seconds (510),
# HEAL_OVERRIDES more run.py overrides. Results: $OUT/heal_gpu.{json,md}, the logs' tails in
# $OUT/heal_gpu_logs.tar.gz; exits non-zero when a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu/env.sh
BENCH_SGLANG=1 source bench/gpu/env.sh || exit 1
python3 bench/heal_gpu.py --out "$OUT"
