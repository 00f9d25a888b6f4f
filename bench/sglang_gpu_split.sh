#!/usr/bin/env bash
# Real SGLang 0.5.17 on two H200s in one device call (at most 9 minutes): the trainer on GPU 0, SGLang on
# GPU 1, weights over an NCCL broadcast group, trainer.mode=async (rollout n+1 while step n trains).
# Raw SGLang serving of the GRPO step's requests on GPU 1, checks against that live server (weight updates
# over disk, CUDA IPC across the two GPUs and NCCL broadcast; abort), then run.py with rollout=sglang and
# with the embedded engine, with each GPU's idle share sampled by nvidia-smi after the second step.
# Device set-up (nvidia-h200-x2; the SGLang bundle in an earlier call): bench/README.md.
#
# Results: $OUT/sglang_gpu_split.{json,md}, logs' tails in $OUT/logs/. Exits non-zero when a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu/env.sh
BENCH_SGLANG=1 source bench/gpu/env.sh || exit 1
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "sglang_gpu_split.sh needs two GPUs (nvidia-h200-x2)"; exit 1; }
python3 bench/sglang_gpu.py --layout split --steps "${STEPS:-8}" --embedded-steps "${EMBEDDED_STEPS:-3}" \
  --out "$OUT"
