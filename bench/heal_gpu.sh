#!/usr/bin/env bash
# Self-healing on one H200 with real SGLang (bench/heal_gpu.py says what it does): the SGLang server killed
# inside a CUDA IPC weight push, one killed while it starts, the trainer rank killed mid-step; each run must
# finish with every row once and GPU memory back to its level before the fault. Each fault is one run.py run
# with one or two SGLang start-ups (about 3 minutes with the prefill CUDA graph off): one device call per
# fault is safe (FAULTS=push, FAULTS=startup, FAULTS=trainer); all three in one call may pass 10 minutes.
#
#   here:    the bundles of bench/sglang_gpu.sh (.sglang-bundle, .device-bundle, .gpu-extra)
#   device:  call 1 (carry .sglang-bundle): source .sglang-bundle/install.sh
#            call 2 (carry .device-bundle): source .device-bundle/install.sh
#            call 3 (carry .gpu-extra):     bash bench/heal_gpu.sh
#   CPU dry run: python bench/heal_gpu.py --cpu
# Results: $OUT/heal_gpu_<fault>.json (pass, heal_s, first_row_after_s, memory before/after), logs in $OUT/logs/.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/sglang_gpu_env.sh
source bench/sglang_gpu_env.sh || exit 1
python3 bench/heal_gpu.py --faults "${FAULTS:-push,startup,trainer}" --out "$OUT"
rc=$?
for d in /tmp/sglbench/heal_*/; do
  [ -d "$d" ] || continue
  n=$(basename "$d")
  tail -n 120 "/tmp/sglbench/$n.out" > "$OUT/logs/$n.out" 2>/dev/null
  for f in "$d"logs/*.log; do [ -f "$f" ] && tail -n 80 "$f" > "$OUT/logs/${n}_$(basename "$f")"; done
  for f in metrics.jsonl heal.jsonl; do [ -f "$d$f" ] && cp "$d$f" "$OUT/logs/${n}_$f"; done
done
exit $rc
