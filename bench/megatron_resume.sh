#!/usr/bin/env bash
# trainer=megatron save and resume on one GPU: bench/megatron_run.sh's Qwen3-0.6B-shaped run for 3 steps
# (a checkpoint at the last: hf/ + megatron/, a megatron.core.dist_checkpointing checkpoint written from
# the Ray trainer actor), then the same run dir resumed (trainer.resume=auto) to step 5. Prints the
# checkpoint's files, the "resumed from" line and the steps' metrics; rc=0 twice is the pass.
#   device: source .device-bundle/install.sh && bash bench/megatron_resume.sh     (carry .device-bundle)
set -uo pipefail
OUT=${OUT:-bench/results}; mkdir -p "$OUT"
export WANDB_MODE=disabled PYTHONUNBUFFERED=1
python3 -c "import sys; sys.path.insert(0, 'bench'); import gpu_components as g; g.build_checkpoint('/tmp/q06')"
python3 - <<'PY'
import json, random
rng = random.Random(0)
with open("/tmp/q06.jsonl", "w") as f:
    for _ in range(2048):
        f.write(json.dumps({"prompt": " ".join(f"t{rng.randrange(1000)}" for _ in range(64)), "label": f"t{rng.randrange(10)}"}) + "\n")
PY
run=/tmp/q06_megatron_resume
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
python3 - "$run" <<'PY' | tee -a "$OUT/q06_megatron_resume.txt"
import json, sys
for r in (json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")):
    print(r["step"], {k: r.get(k) for k in ("train/grad_norm", "train/kl_loss", "train/train_rollout_logprob_abs_diff")})
PY
