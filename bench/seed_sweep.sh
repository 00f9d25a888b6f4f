#!/usr/bin/env bash
# Many seeds x recipe variants of the embedded default at once, each run on its own CPU cores
# (a many-core host: the GPU machine's 16 cores, CUDA hidden). Prints one line per run:
#   variant seed held-out-initial held-out-final wall_s
# and the held-out reward at every eval. Usage (after `source .device-bundle/install.sh` there):
#   PARALLEL=8 bash bench/seed_sweep.sh "base:" "ent01:algo.entropy_coef=0.01" ...  -- 1 2 3 4
set -uo pipefail
OUT=${OUT:-bench/results}/seed_sweep
mkdir -p "$OUT"
variants=(); seeds=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do variants+=("$1"); shift; done
shift; seeds=("$@")
jobs=()
for v in "${variants[@]}"; do for s in "${seeds[@]}"; do jobs+=("$v|$s"); done; done
run_one() {
  local name=${1%%:*} rest=${1#*:}; local over=${rest%|*} seed=${1##*|}
  local dir="$OUT/${name}_seed$seed"
  CUDA_VISIBLE_DEVICES= timeout ${RUN_TIMEOUT:-540} python3 run.py seed=$seed rollout.router.enabled=false \
    logging.progress=false logging.wandb=false hydra.run.dir="$dir" ${over//,/ } > "$dir.log" 2>&1
  python3 - "$dir" "$name" "$seed" <<'PY'
import json, sys
d, name, seed = sys.argv[1:]
try:
    s = json.load(open(f"{d}/summary.json"))
    evals = [(r["step"], round(r["eval/heldout/reward"], 3)) for r in map(json.loads, open(f"{d}/metrics.jsonl")) if "eval/heldout/reward" in r]
    print(f"{name:10s} seed={seed:3s} {s['eval_reward_initial']:.3f} -> {s['eval_reward_final']:.3f}  wall {s['wall_s']:.0f}s  {evals}")
except Exception as e:
    print(f"{name:10s} seed={seed:3s} FAILED ({e})")
PY
}
export -f run_one; export OUT
printf '%s\n' "${jobs[@]}" | xargs -P "${PARALLEL:-8}" -I{} bash -c 'run_one "$@"' _ {} | tee "$OUT/table.txt"
