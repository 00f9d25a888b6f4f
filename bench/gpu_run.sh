#!/usr/bin/env bash
# One GPU session (the lent H200): the embedded default, colocated on one GPU (trainer and
# embedded engine take turns; weights go over CUDA IPC), then the component timings
# (bench/gpu_components.py). Device set-up (.device-bundle carried): bench/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu/env.sh
source bench/gpu/env.sh || exit 1
python3 -c "import ray, hydra; print('ray', ray.__version__)"
run=/tmp/gpu_tiny; rm -rf "$run"  # a new run each time (a run dir holds one run's checkpoints)
timeout 300 python3 run.py parallelism=1gpu rollout.router.enabled=false logging.wandb=false logging.progress=false \
  trainer.num_rollout=${STEPS:-100} eval.interval=20 hydra.run.dir=$run 2>&1 | grep -v "Loading weights" | tail -n 30
cp $run/summary.json "$OUT/tiny_1gpu_summary.json"; cp $run/metrics.jsonl "$OUT/tiny_1gpu_metrics.jsonl"
cp $run/reward_curve.png "$OUT/tiny_1gpu_reward_curve.png"; tail -n 40 $run/logs/engine_0.log > "$OUT/tiny_1gpu_engine.log"
timeout 400 python3 bench/gpu_components.py --out "$OUT" 2>&1 | grep -v "Loading weights" | tail -n 20
