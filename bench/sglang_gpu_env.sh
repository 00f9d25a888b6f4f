# Sourced by bench/sglang_gpu.sh and bench/sglang_gpu_split.sh: the SGLang stack first on PYTHONPATH (its
# pinned transformers, fastapi and pydantic before the device bundle's), the wheels of .gpu-extra/, and
# bench_logs, which copies the logs' tails to $OUT/logs.
OUT=${OUT:-bench/results}
mkdir -p "$OUT/logs"
export WANDB_MODE=disabled PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled \
       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ ! -d /tmp/sglang-site/site/sglang ]; then
  if [ -f .sglang-bundle/install.sh ]; then source .sglang-bundle/install.sh
  else echo "no SGLang stack: run 'source .sglang-bundle/install.sh' first (carry .sglang-bundle)"; return 1; fi
fi
export PYTHONPATH=/tmp/sglang-site/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .gpu-extra/*.whl >/dev/null 2>&1; then  # carried in this call, or installed by an earlier one
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu-extra/*.whl || return 1
fi
[ -d /tmp/site ] && export PYTHONPATH=$PYTHONPATH:/tmp/site
python3 -c "import sglang, sglang_router, ray, hydra, torch, transformers; \
print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, \
'ray', ray.__version__)" || { echo "the stack does not import (see above)"; return 1; }
nvidia-smi -L

bench_logs() {  # $1: layout
  local w=/tmp/sglbench f d
  for f in "$w"/raw_"$1"_server.log "$w"/run_"$1"_*.out; do
    [ -f "$f" ] && tail -n 80 "$f" > "$OUT/logs/$(basename "$f")"
  done
  for d in "$w"/run_"$1"_*/; do
    [ -d "$d" ] || continue
    for f in "$d"run.log "$d"logs/*.log; do
      [ -f "$f" ] && tail -n 80 "$f" > "$OUT/logs/$(basename "$d")_$(basename "$f")"
    done
    [ -f "$d"metrics.jsonl ] && cp "$d"metrics.jsonl "$OUT/logs/$(basename "$d")_metrics.jsonl"
  done
  return 0
}
