#!/usr/bin/env bash
# GRPO with trainer=megatron and rollout=sglang on the GPUs of one machine, layout after layout
# (bench/scale_gpu.py says what is measured). Device set-up (the SGLang bundle in one call, then this with
# .device-bundle and .gpu-extra carried): bench/README.md.
# LAYOUTS (comma-separated, see LAYOUTS in scale_gpu.py), STEPS, BENCH_BUDGET_S, EXTRA (more run.py
# overrides for every layout) pick what runs. Results: $OUT/scale_gpu.{json,md}, every run's log tails
# inside the json.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu/env.sh
BENCH_SGLANG=1 source bench/gpu/env.sh || exit 1
python3 -c "import megatron.core; print('megatron-core', megatron.core.__version__)" || exit 1
python3 bench/scale_gpu.py --out "$OUT"
