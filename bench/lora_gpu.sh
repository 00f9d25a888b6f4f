#!/usr/bin/env bash
# LoRA (rank 16, 64) against full fine-tuning, Qwen3-4B shape, and LoRA on the Qwen3-8B shape, through run.py
# with SGLang colocated on one H200 (bench/lora_gpu.py says what each run measures). Device set-up:
# bench/README.md (peft's wheel travels with .gpu-extra), then:
#   RUNS=4b_full,4b_lora16 bash bench/lora_gpu.sh      # one call (two SGLang start-ups and a 4B build)
#   RUNS=4b_lora64,8b_lora16 bash bench/lora_gpu.sh    # a second call (the 8B build)
#   RUNS=06b_fsdp,06b_fsdp_lora bash bench/lora_gpu.sh # FSDP2's GPU path (small: a third call, or the rest of one)
# Results: $OUT/lora_gpu.{json,md} (each call writes its runs), the runs' logs' tails in $OUT/logs/.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu/env.sh
BENCH_SGLANG=1 source bench/gpu/env.sh || exit 1
python3 -c "import peft; print('peft', peft.__version__)" || { echo "peft is missing: add its wheel to .gpu-extra"; exit 1; }
mkdir -p "$OUT/logs"
python3 bench/lora_gpu.py --out "$OUT"
rc=$?
for f in /tmp/lorabench/run_*.out; do [ -f "$f" ] && tail -n 80 "$f" > "$OUT/logs/$(basename "$f")"; done
for d in /tmp/lorabench/run_*/; do
  [ -d "$d" ] && [ -f "$d"run.log ] && tail -n 80 "$d"run.log > "$OUT/logs/$(basename "$d")_run.log"
  [ -f "$d"metrics.jsonl ] && cp "$d"metrics.jsonl "$OUT/logs/$(basename "$d")_metrics.jsonl"
done
exit $rc
