#!/usr/bin/env bash
# trainer=megatron through run.py on one GPU: Qwen3-0.6B shape (random weights, a synthetic tokenizer
# of its vocabulary), colocated with the embedded engine (bf16), GRPO with a KL loss (reference swap),
# packed micro-batches of <= 16k tokens, megatron DDP + distributed Adam, offload/onload around the
# rollouts, CUDA IPC weight pushes. No learning is expected (random labels); this checks and times the
# path, and the train/rollout log-prob gap must stay within bf16 tolerance (sync.max_logprob_diff fails
# the run otherwise). A checkpoint is saved at the last step (hf/ + megatron/, dist_checkpointing).
# Device set-up (.device-bundle carried): bench/README.md.
# LAYOUT= other parallelism overrides, e.g. two GPUs, megatron TP 2 and two 1-GPU engines behind the router:
#   LAYOUT="parallelism=colocate_4gpu_tp2 parallelism.name=colocate_2gpu_tp2 parallelism.gpus_per_node=2
#   parallelism.trainer_gpus=2 parallelism.rollout_gpus=2"
# Two engines need sglang-router, which needs the SGLang bundle's setproctitle and orjson: carry .sglang-bundle
# (and install it) in a call before, then .gpu-extra (the router wheel). Tried on 2 H200s on 2026-12-01 with
# the router wheel alone: the router exited at import (no setproctitle, then no orjson), before a step.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu/env.sh
source bench/gpu/env.sh || exit 1
python3 bench/gpu/workload.py /tmp/q06 --prompts /tmp/q06.jsonl
run=/tmp/q06_megatron; rm -rf "$run"  # a new run each time (a run dir holds one run's checkpoints)
timeout 420 python3 run.py trainer=megatron model=qwen3_0_6b model.path=/tmp/q06 model.dtype=bfloat16 \
  ${LAYOUT:-parallelism=1gpu rollout.router.enabled=false} data=jsonl data.path=/tmp/q06.jsonl data.apply_chat_template=false eval.datasets=[] \
  rollout.max_response_len=128 trainer.num_rollout=${STEPS:-6} \
  trainer.max_tokens_per_micro_batch=16384 trainer.save_interval=100 algo.kl_loss_coef=0.04 \
  sync.max_logprob_diff=0.05 logging.wandb=false logging.progress=false hydra.run.dir=$run 2>&1 \
  | grep -v "Loading weights" | tail -n 25
echo "rc=${PIPESTATUS[0]}"
python3 bench/gpu/harness.py $run/metrics.jsonl perf/train_time perf/weight_sync_time perf/rollout_wait_time \
  train/train_rollout_logprob_abs_diff train/grad_norm train/kl_loss
cp $run/metrics.jsonl "$OUT/q06_megatron_metrics.jsonl"; cp $run/summary.json "$OUT/q06_megatron_summary.json"
find $run -maxdepth 4 | grep -E "step_|megatron|/hf" | head -n 40 > "$OUT/q06_megatron_checkpoint.txt"
tail -n 15 $run/logs/engine_0.log > "$OUT/q06_megatron_engine.log"; tail -n 40 $run/logs/trainer_0.log > "$OUT/q06_megatron_trainer.log" 2>/dev/null
