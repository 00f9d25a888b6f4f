#!/usr/bin/env bash
# LoRA's weight push on one H200, one call (at most 8 minutes): the merged push against SGLang's adapter
# endpoints (from tensors over CUDA IPC, from /dev/shm), the rollout with the adapter against the base and
# against a server without LoRA, and the adapter's log-probs against the merged weights' (bench/lora_push_gpu.py
# says what each phase measures). Device set-up: bench/README.md (the SGLang bundle in one call; peft's wheel
# travels with .gpu-extra), then
#   bash bench/lora_push_gpu.sh                  # RANKS=16,64, BENCH_BUDGET_S=480, PHASES=build,lora,plain
# Results: $OUT/lora_push_gpu.{json,md}, each phase's results in $OUT/logs/lora_push_<phase>.json, the servers'
# log tails in $OUT/logs/; exits non-zero when a check failed or a phase did not finish.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu/env.sh
BENCH_SGLANG=1 source bench/gpu/env.sh || exit 1
python3 -c "import peft; print('peft', peft.__version__)" || { echo "peft is missing: add its wheel to .gpu-extra"; exit 1; }
python3 bench/lora_push_gpu.py --out "$OUT"
