#!/usr/bin/env bash
# trainer=megatron through run.py on one GPU: Qwen3-0.6B shape (random weights, a synthetic tokenizer
# of its vocabulary), colocated with the embedded engine (bf16), GRPO with a KL loss (reference swap),
# packed micro-batches of <= 16k tokens, megatron DDP + distributed Adam, offload/onload around the
# rollouts, CUDA IPC weight pushes. No learning is expected (random labels); this checks and times the
# path, and the train/rollout log-prob gap must stay within bf16 tolerance (sync.max_logprob_diff fails
# the run otherwise). A checkpoint is saved at the last step (hf/ + megatron/, dist_checkpointing).
#   device: source .device-bundle/install.sh && bash bench/megatron_run.sh     (carry .device-bundle)
# LAYOUT= other parallelism overrides, e.g. two GPUs, megatron TP 2 and two 1-GPU engines behind the router:
#   LAYOUT="parallelism=colocate_4gpu_tp2 parallelism.name=colocate_2gpu_tp2 parallelism.gpus_per_node=2
#   parallelism.trainer_gpus=2 parallelism.rollout_gpus=2"
# Two engines need sglang-router, which needs the SGLang bundle's setproctitle and orjson: carry .sglang-bundle
# (and install it) in a call before, then .gpu-extra (the router wheel). Tried on 2 H200s on 2026-12-01 with
# the router wheel alone: the router exited at import (no setproctitle, then no orjson), before a step.
set -uo pipefail
OUT=${OUT:-bench/results}; mkdir -p "$OUT"
export WANDB_MODE=disabled PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import sys; sys.path.insert(0, 'bench'); import gpu_components as g; g.build_checkpoint('/tmp/q06')"
python3 - <<'PY'
import json, random
rng = random.Random(0)
with open("/tmp/q06.jsonl", "w") as f:
    for _ in range(2048):
        f.write(json.dumps({"prompt": " ".join(f"t{rng.randrange(1000)}" for _ in range(64)), "label": f"t{rng.randrange(10)}"}) + "\n")
PY
run=/tmp/q06_megatron
timeout 420 python3 run.py trainer=megatron model=qwen3_0_6b model.path=/tmp/q06 model.dtype=bfloat16 \
  ${LAYOUT:-parallelism=1gpu rollout.router.enabled=false} data=jsonl data.path=/tmp/q06.jsonl data.apply_chat_template=false eval.datasets=[] \
  rollout.max_response_len=128 trainer.num_rollout=${STEPS:-6} \
  trainer.max_tokens_per_micro_batch=16384 trainer.save_interval=100 algo.kl_loss_coef=0.04 \
  sync.max_logprob_diff=0.05 logging.wandb=false logging.progress=false hydra.run.dir=$run 2>&1 \
  | grep -v "Loading weights" | tail -n 25
echo "rc=${PIPESTATUS[0]}"
python3 - "$run" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
print("step  train_s  sync_s  rollout_s  logprob_gap  grad_norm  kl_loss")
for r in rows:
    print(f"{r['step']:>4}  {r.get('perf/train_time', 0):7.2f}  {r.get('perf/weight_sync_time', 0):6.2f}  "
          f"{r.get('perf/rollout_wait_time', 0):9.2f}  {r.get('train/train_rollout_logprob_abs_diff', float('nan')):11.5f}  "
          f"{r.get('train/grad_norm', float('nan')):9.4f}  {r.get('train/kl_loss', float('nan')):.3g}")
PY
cp $run/metrics.jsonl "$OUT/q06_megatron_metrics.jsonl"; cp $run/summary.json "$OUT/q06_megatron_summary.json"
find $run -maxdepth 4 | grep -E "step_|megatron|/hf" | head -n 40 > "$OUT/q06_megatron_checkpoint.txt"
tail -n 15 $run/logs/engine_0.log > "$OUT/q06_megatron_engine.log"; tail -n 40 $run/logs/trainer_0.log > "$OUT/q06_megatron_trainer.log" 2>/dev/null
