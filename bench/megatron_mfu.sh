#!/usr/bin/env bash
# Megatron training throughput on one H200, in one device call: the Qwen3-4B shape as measured before
# (4 micro-batches of 4096 packed tokens, torch's foreach Adam) with a kernel profile of one step, then
# the same with torch's fused Adam kernel, with 8 micro-batches a step, and with 8192-token micro-batches.
# Writes $OUT/megatron_mfu.json (every run's result by name), a summary line
# per run in $OUT/megatron_mfu.txt, and all runs' output in $OUT/megatron_mfu.log.
# Device set-up (.device-bundle carried): bench/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu/env.sh
source bench/gpu/env.sh || exit 1
mkdir -p /tmp/mfu
run() {  # $1: name, the rest: bench/megatron_gpu.py arguments
  local name=$1; shift
  echo "=== $name: $*" >> "$OUT/megatron_mfu.log"
  timeout 150 python3 bench/megatron_gpu.py "$@" --out "/tmp/mfu/$name.json" >> "$OUT/megatron_mfu.log" 2>&1
  echo "$name rc=$? ($*)"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('   ', {k: r[k] for k in ('median_step_s',
    'median_forward_backward_s', 'median_optimizer_s', 'tokens_per_s', 'tflops_per_s', 'mfu', 'peak_memory_gib')},
    r.get('gpu_time_by_kernel_kind', ''))" "/tmp/mfu/$name.json" 2>/dev/null
}
{
  run 4b_base --shape qwen3_4b --steps 8 --profile 25
  run 4b_fused --shape qwen3_4b --steps 8 --fused-adam
  run 4b_fused_mb8 --shape qwen3_4b --steps 8 --fused-adam --micro-batches 8
  run 4b_fused_8k --shape qwen3_4b --steps 8 --fused-adam --tokens 8192
} | tee "$OUT/megatron_mfu.txt"
python3 - "$OUT/megatron_mfu.json" <<'PY'
import json, pathlib, sys
runs = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path("/tmp/mfu").glob("*.json"))}
pathlib.Path(sys.argv[1]).write_text(json.dumps(runs, indent=1) + "\n")
PY
