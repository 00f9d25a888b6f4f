#!/usr/bin/env bash
# One table in one device call (one H200, at most 9 minutes): seconds per GRPO step split into rollout,
# train and sync for run.py with SGLang colocated without offload and with offload and TRL 1.16's
# GRPOTrainer (HF generate), against raw SGLang serving the same requests; plus pass/fail checks against
# the live server (weight updates over disk and CUDA IPC, memory release/resume, a group as one batched
# request, aborts). run.py with the embedded engine is a sixth phase that one call has no room for
# (three SGLang start-ups take 100-135 s each): PHASES=build,embedded in a call of its own.
# bench/sglang_gpu.py says what each phase does; bench/README.md how the device call is set up (the SGLang
# bundle in one call, then this with .device-bundle and .gpu-extra carried).
#
# WORKLOAD=256x256 (32 prompts x 8 samples x 256 tokens) instead of TRL's anchor (8 x 8 x 256); PHASES=
# picks phases (build,raw,sglang,sglang_offload,trl,embedded); STEPS, OFFLOAD_STEPS, EMBEDDED_STEPS,
# TRL_STEPS set each run's steps. Results: $OUT/sglang_gpu_colocated[_256x256].{json,md}, the server and
# run logs' tails in $OUT/logs/. Exits non-zero when a check failed or a phase did not finish (what was
# measured is written anyway). CPU dry run of every phase (tiny model, the embedded engine for SGLang):
#   python bench/sglang_gpu.py --cpu --budget 1500 --phases build,raw,sglang,sglang_offload,trl,embedded
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu/env.sh
BENCH_SGLANG=1 source bench/gpu/env.sh || exit 1
python3 bench/sglang_gpu.py --layout colocated --steps "${STEPS:-6}" --offload-steps "${OFFLOAD_STEPS:-4}" \
  --embedded-steps "${EMBEDDED_STEPS:-2}" --trl-steps "${TRL_STEPS:-3}" --out "$OUT"
