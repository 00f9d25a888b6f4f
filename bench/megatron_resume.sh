#!/usr/bin/env bash
# trainer=megatron save and resume on one GPU: bench/megatron_run.sh's Qwen3-0.6B-shaped run for 3 steps
# (a checkpoint at the last: hf/ + megatron/, a megatron.core.dist_checkpointing checkpoint written from
# the Ray trainer actor), then the same run dir resumed (trainer.resume=auto) to step 5. Prints the
# checkpoint's files, the "resumed from" line and the steps' metrics; rc=0 twice is the pass.
# Device set-up (.device-bundle carried): bench/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu/env.sh
source bench/gpu/env.sh || exit 1
python3 bench/gpu/workload.py /tmp/q06 --prompts /tmp/q06.jsonl
run=/tmp/q06_megatron_resume; rm -rf "$run"  # a new run each time (a run dir holds one run's checkpoints)
for steps in 3 5; do
  timeout 420 python3 run.py trainer=megatron model=qwen3_0_6b model.path=/tmp/q06 model.dtype=bfloat16 \
    parallelism=1gpu data=jsonl data.path=/tmp/q06.jsonl data.apply_chat_template=false eval.datasets=[] \
    rollout.router.enabled=false rollout.max_response_len=128 trainer.num_rollout=$steps \
    trainer.max_tokens_per_micro_batch=16384 trainer.save_interval=100 trainer.resume=auto \
    algo.kl_loss_coef=0.04 sync.max_logprob_diff=0.05 logging.wandb=false logging.progress=false \
    hydra.run.dir=$run 2>&1 | grep -v "Loading weights" | grep -E "resumed from|Error|error|step" | tail -n 20
  echo "steps=$steps rc=${PIPESTATUS[0]}"
  find $run/checkpoints -maxdepth 3 | sort | head -n 30
done | tee "$OUT/q06_megatron_resume.txt"
python3 bench/gpu/harness.py $run/metrics.jsonl train/grad_norm train/kl_loss train/train_rollout_logprob_abs_diff \
  | tee -a "$OUT/q06_megatron_resume.txt"
