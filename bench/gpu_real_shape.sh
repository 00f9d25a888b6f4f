#!/usr/bin/env bash
# The run.py path with a real model shape on one GPU: Qwen3-0.6B (random weights, a synthetic
# tokenizer of its vocabulary size), colocated, bf16 engine, float32 master weights + autocast,
# reference swap, CUDA IPC pushes of 1.4 GB. No learning is expected (random labels); this checks
# and times the production path. Device set-up (.device-bundle carried): bench/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu/env.sh
source bench/gpu/env.sh || exit 1
python3 bench/gpu/workload.py /tmp/q06 --prompts /tmp/q06.jsonl
rm -rf /tmp/q06run  # a new run each time (a run dir holds one run's checkpoints)
timeout 420 python3 run.py model=qwen3_0_6b model.path=/tmp/q06 parallelism=1gpu data=jsonl data.path=/tmp/q06.jsonl \
  data.apply_chat_template=false eval.datasets=[] rollout.router.enabled=false rollout.max_response_len=128 \
  trainer.num_rollout=${STEPS:-6} trainer.micro_batch_size=16 trainer.save_interval=100 algo.kl_loss_coef=0.04 \
  logging.wandb=false logging.progress=false hydra.run.dir=/tmp/q06run 2>&1 | grep -v "Loading weights" | tail -n 12
cp /tmp/q06run/metrics.jsonl "$OUT/q06_metrics.jsonl"; cp /tmp/q06run/summary.json "$OUT/q06_summary.json"
tail -n 15 /tmp/q06run/logs/engine_0.log > "$OUT/q06_engine.log"
