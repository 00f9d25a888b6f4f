#!/usr/bin/env bash
# Megatron training throughput on one H200, in one device call (bench/megatron_gpu.py, our module spec).
#   SET=4b (default): the Qwen3-4B shape as measured before (4 micro-batches of 4096 packed tokens, torch's
#     foreach Adam) with a kernel profile of one step, then torch's fused Adam, 8 micro-batches, 8192-token
#     micro-batches. Writes $OUT/megatron_mfu.{json,txt,log}.
#   SET=anchor: the anchor workload's training (Qwen3-0.6B shape, one packed micro-batch of 64 samples of
#     320 tokens, fused Adam): megatron's own packed RoPE (a host sync per layer), the packed RoPE, and that
#     with trainer.compile, each with a kernel profile. Writes $OUT/megatron_anchor.{json,txt,log}.
# Each run's JSON is also kept by name in the combined file; a summary line per run in the .txt.
# Device set-up (.device-bundle carried): bench/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu/env.sh
source bench/gpu/env.sh || exit 1
SET=${SET:-4b}
NAME=$([ "$SET" = 4b ] && echo mfu || echo "$SET")
TMP=/tmp/megatron_$NAME
rm -rf "$TMP" && mkdir -p "$TMP"
run() {  # $1: name, the rest: bench/megatron_gpu.py arguments
  local name=$1; shift
  echo "=== $name: $*" >> "$OUT/megatron_$NAME.log"
  timeout 240 python3 bench/megatron_gpu.py "$@" --out "$TMP/$name.json" >> "$OUT/megatron_$NAME.log" 2>&1
  echo "$name rc=$? ($*)"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('   ', {k: r[k] for k in ('median_step_s',
    'median_forward_backward_s', 'median_optimizer_s', 'tokens_per_s', 'tflops_per_s', 'mfu', 'peak_memory_gib')},
    r.get('gpu_time_by_kernel_kind', ''))" "$TMP/$name.json" 2>/dev/null
}
ANCHOR=(--shape qwen3_0_6b --tokens 20480 --micro-batches 1 --sample-lengths 320:320 --fused-adam --steps 8)
{
  case "$SET" in
    4b)
      run 4b_base --shape qwen3_4b --steps 8 --profile 25
      run 4b_fused --shape qwen3_4b --steps 8 --fused-adam
      run 4b_fused_mb8 --shape qwen3_4b --steps 8 --fused-adam --micro-batches 8
      run 4b_fused_8k --shape qwen3_4b --steps 8 --fused-adam --tokens 8192 ;;
    anchor)
      run anchor_megatron_rope "${ANCHOR[@]}" --unfused-rope --profile 15
      run anchor_packed_rope "${ANCHOR[@]}" --profile 15
      run anchor_compiled "${ANCHOR[@]}" --compile --profile 15 ;;
    *) echo "SET=$SET: 4b or anchor expected"; exit 2 ;;
  esac
} | tee "$OUT/megatron_$NAME.txt"
python3 - "$OUT/megatron_$NAME.json" "$TMP" <<'PY'
import json, pathlib, sys
runs = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[2]).glob("*.json"))}
pathlib.Path(sys.argv[1]).write_text(json.dumps(runs, indent=1) + "\n")
PY
