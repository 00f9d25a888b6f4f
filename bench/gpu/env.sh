# Sourced by every GPU bench script, from the repo root: the environment of a run on the lent GPU machine,
# written once (bench/README.md says which bundles to carry in which call).
#   - NVLink multicast off (NCCL, torch symmetric memory, NVSHMEM); no other GPU setting is touched;
#   - the device bundle (.device-bundle: ray, hydra, megatron-core, ...) in /tmp/site, installed from this
#     call's carry or left there by an earlier call while the machine is warm;
#   - the wheels of .gpu-extra/ (sglang-router, datasets, math-verify, ...) into /tmp/site when carried;
#   - with BENCH_SGLANG=1: the SGLang stack (.sglang-bundle, unpacked once to /tmp/sglang-site) first on
#     PYTHONPATH (its pinned transformers, fastapi and pydantic before the device bundle's);
#   - the carried packages' Python bytecode compiled once per machine (as pip does when it installs);
#   - OUT (default bench/results) exists; the versions that run and the GPUs are printed;
#   - on a GPU, tests/gpu/test_megatron_offload.py passes (once per machine and code; SKIP_GPU_TESTS=1 skips it).
# Returns non-zero (the caller exits) when the stack does not import.
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export OUT WANDB_MODE=disabled PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled \
       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -f .device-bundle/install.sh ] && [ ! -d /tmp/site/hydra ]; then
  source .device-bundle/install.sh || return 1
fi
if ls .gpu-extra/*.whl >/dev/null 2>&1; then  # carried in this call (an earlier call's stay in /tmp/site)
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu-extra/*.whl || return 1
fi
_stack="import torch, transformers"
if [ "${BENCH_SGLANG:-0}" = 1 ]; then
  if [ ! -d /tmp/sglang-site/site/sglang ]; then
    if [ -f .sglang-bundle/install.sh ]; then source .sglang-bundle/install.sh
    else echo "no SGLang stack: run 'source .sglang-bundle/install.sh' first (carry .sglang-bundle)"; return 1; fi
  fi
  export PYTHONPATH=/tmp/sglang-site/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  _stack="import sglang, sglang_router, ray, hydra, torch, transformers; print('sglang', sglang.__version__, end=' ')"
  [ -d /tmp/site ] && export PYTHONPATH=$PYTHONPATH:/tmp/site
else  # as .device-bundle/install.sh orders it
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# Python's bytecode for the carried packages, once per machine, as pip writes it when it installs a package: the
# bundles are unpacked from tarballs or with --no-compile, so without this every first import compiles its
# modules from source, in the driver, in each Ray worker and in each SGLang process (sglang has 7,500 files)
for _d in /tmp/site /tmp/sglang-site/site; do
  if [ -d "$_d" ] && [ ! -f "$_d/.bytecode-compiled" ]; then
    _t0=$(date +%s.%N)
    python3 -m compileall -q -j 0 "$_d" >/dev/null 2>&1  # a few vendored files do not compile: harmless
    touch "$_d/.bytecode-compiled"
    echo "bytecode of $_d compiled in $(python3 -c "print(round($(date +%s.%N) - $_t0, 1))") s"
  fi
done
python3 -c "$_stack; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  || { echo "the stack does not import (see above)"; return 1; }
nvidia-smi -L || echo "nvidia-smi failed"
# issue 24: before any bench of this tree, megatron's optimizer offloaded, onloaded and stepped on the GPU
# (tests/gpu/test_megatron_offload.py, about 15 s); once per machine and per content of what it covers, so later
# calls on a warm machine with the same code skip it. A failure stops the bench. SKIP_GPU_TESTS=1 skips it.
if [ "${SKIP_GPU_TESTS:-0}" != 1 ] && nvidia-smi -L >/dev/null 2>&1; then
  _key=$(cat slime_hydra/train/*.py slime_hydra/train/backends/megatron/*.py tests/gpu/test_megatron_offload.py \
         | sha256sum | cut -c1-16)
  if [ ! -f "/tmp/gpu-offload-test-passed-$_key" ]; then
    # the device bundle's order (its transformers, not SGLang's pinned one): as tests/gpu runs in call 2
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -x -rs -p no:cacheprovider tests/gpu/test_megatron_offload.py
    _rc=$?  # 5: nothing ran (skipped: no CUDA, or no megatron-core)
    if [ $_rc != 0 ]; then
      echo "tests/gpu/test_megatron_offload.py $([ $_rc = 5 ] && echo 'did not run' || echo failed) (pytest exit" \
           "$_rc): no bench on this tree (SKIP_GPU_TESTS=1 to run anyway)"
      return 1
    fi
    touch "/tmp/gpu-offload-test-passed-$_key"
  fi
fi
