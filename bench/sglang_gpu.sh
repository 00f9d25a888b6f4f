#!/usr/bin/env bash
# One table in one device call (one H200, at most 9 minutes): seconds per GRPO step (rollout, train, sync)
# for run.py with SGLang colocated, without and with offload, and for TRL's GRPOTrainer, against raw SGLang
# serving the same requests; checks against the live server. bench/sglang_gpu.py says what each phase does;
# bench/README.md how the device calls are set up (the SGLang bundle in one call, then this one).
# PHASES= picks phases (build,raw,sglang,sglang_warm,sglang_variant,sglang_offload,trl,embedded,stop: embedded needs a
# call of its own; stop SIGTERMs a run while SGLang starts and checks that the GPU is left empty; sglang_warm runs the sglang run again on the warm machine with WARM_OVERRIDES added, sglang_variant
# adds VARIANT_OVERRIDES to those);
# WORKLOAD=256x256 (32 prompts x 8 samples x 256 tokens) instead of TRL's anchor (8 x 8 x 256); SHAPE=qwen3_4b the
# model shape (with PHASES=build,trl: TRL on the 4B shape); STEPS,
# OFFLOAD_STEPS, EMBEDDED_STEPS, TRL_STEPS, WARM_STEPS set each run's steps; CPU_PROBE=1 times Python on every CPU over
# each run (bench/rollout_speed.py reads it); PROFILE_SCHEDULER=S: S seconds of py-spy on SGLang's scheduler from each
# run's step 3. Results: $OUT/sglang_gpu_colocated[_256x256]
# .{json,md}, logs' tails in $OUT/logs/; exits non-zero when a check failed or a phase did not finish.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu/env.sh
BENCH_SGLANG=1 source bench/gpu/env.sh || exit 1
python3 bench/sglang_gpu.py --layout colocated --steps "${STEPS:-6}" --offload-steps "${OFFLOAD_STEPS:-4}" \
  --embedded-steps "${EMBEDDED_STEPS:-2}" --trl-steps "${TRL_STEPS:-3}" --out "$OUT"
