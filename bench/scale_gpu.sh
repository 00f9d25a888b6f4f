#!/usr/bin/env bash
# GRPO with trainer=megatron and rollout=sglang on the GPUs of one machine, layout after layout
# (bench/scale_gpu.py says what is measured). On a 4-GPU machine, in three device calls:
#   call 1 (carry .sglang-bundle):  source .sglang-bundle/install.sh
#   call 2 (carry .gpu-extra):      python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-extra/*.whl
#   call 3 (carry .device-bundle):  source .device-bundle/install.sh && bash bench/scale_gpu.sh
# LAYOUTS (comma-separated, see LAYOUTS in scale_gpu.py), STEPS, BENCH_BUDGET_S pick what runs.
# Results: $OUT/scale_gpu.{json,md}, every run's log tails inside the json.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/sglang_gpu_env.sh
source bench/sglang_gpu_env.sh || exit 1
python3 -c "import megatron.core; print('megatron-core', megatron.core.__version__)" || exit 1
python3 bench/scale_gpu.py --out "$OUT"
