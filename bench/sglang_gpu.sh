#!/usr/bin/env bash
# Real SGLang 0.5.17 on one H200 in one device call (at most 9 minutes): raw SGLang serving of the GRPO
# step's requests, the project's run.py with rollout=sglang colocated (CUDA IPC weight pushes, router on),
# the same with the embedded engine, and pass/fail checks against the live server (weight updates over
# disk and CUDA IPC, memory release/resume, abort). bench/sglang_gpu.py says what each phase does.
#
#   here:    ../shared/tools/sglang-bundle.sh .sglang-bundle; ../shared/tools/device-bundle.sh .device-bundle
#            (and .gpu-extra/: the sglang-router, datasets and math-verify wheels for Python 3.12)
#   device:  call 1 (carry .sglang-bundle):   source .sglang-bundle/install.sh
#            call 2 (carry .device-bundle .gpu-extra):
#                     source .device-bundle/install.sh && bash bench/sglang_gpu.sh
#
# Results: $OUT/sglang_gpu_colocated.{json,md}, the server and run logs' tails in $OUT/logs/. Exits non-zero
# when a check failed or a phase did not finish (what was measured is written anyway).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/sglang_gpu_env.sh
source bench/sglang_gpu_env.sh || exit 1
python3 bench/sglang_gpu.py --layout colocated --steps "${STEPS:-8}" --embedded-steps "${EMBEDDED_STEPS:-3}" \
  --out "$OUT"
rc=$?
bench_logs colocated
exit $rc
