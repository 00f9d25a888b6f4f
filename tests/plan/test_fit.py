"""What the plan chooses when the config leaves the micro-batch, recompute and offload to it
(``slime_hydra/plan/fit.py``): the largest micro-batch that fits, recompute only where needed, a value
the user sets kept (and refused with settings that fit), and CPU runs unchanged."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, compose, resolved
from slime_hydra.config import ConfigError, load, resolve
from slime_hydra.launch.validate import check, validate
from slime_hydra.plan import fit as F
from slime_hydra.plan.memory import estimate
from slime_hydra.plan.resources import make_plan

DATA = str(ROOT / "tests" / "fixtures" / "prompts.jsonl")
# the README's GPU example: Qwen3-4B, torch trainer, SGLang, 8 GPUs colocated, 32 x 8 samples of 8192 tokens
README_4B = ["model=qwen3_4b", "algo=gspo", "rollout=sglang", "parallelism=colocate_8gpu", "data=jsonl",
             f"data.path={DATA}", "reward=math"]
# TRL's anchor workload as `python bench/run.py anchor` runs it (SGLang keeps half of the H200)
ANCHOR = ["model=qwen3_0_6b", "parallelism=1gpu", "rollout=sglang", "rollout.batch_size=8",
          "rollout.server_args.mem_fraction_static=0.5",
          "rollout.n_samples_per_prompt=8", "rollout.max_response_len=256", "data=jsonl", f"data.path={DATA}"]


def peak_with(overrides) -> float:
    """The estimated peak of ``overrides`` (what they leave unset left to the plan)."""
    cfg = resolve(load(compose(overrides)))
    F.fit(cfg)
    return estimate(cfg, make_plan(cfg)).peak


def fitted(overrides):
    notes = []
    return check(compose(overrides), notes=notes), notes


def test_the_readme_4b_example_fits_with_the_largest_micro_batch_and_says_why():
    cfg, notes = fitted(README_4B)
    t = cfg.trainer
    (note,) = notes
    assert note.startswith(f"micro-batch (auto): micro_batch_size={t.micro_batch_size} ")
    assert "the largest whose peak fits 126 GiB (90% of the GPU)" in note
    limit = 0.9 * cfg.parallelism.gpu_memory_gib
    assert estimate(cfg, make_plan(cfg)).peak <= limit
    # one size up (twice the samples) with the same recompute does not fit: the choice is the largest
    bigger = peak_with([*README_4B, f"trainer.micro_batch_size={2 * t.micro_batch_size}",
                        f"trainer.gradient_checkpointing={t.gradient_checkpointing}"])
    assert bigger > limit
    # 8192-token sequences: not one sample fits without recompute, so the plan turns it on
    assert t.gradient_checkpointing is True
    assert peak_with([*README_4B, "trainer.micro_batch_size=1", "trainer.gradient_checkpointing=false"]) > limit


def test_the_anchor_workload_keeps_trainer_and_engine_together_with_the_largest_micro_batch():
    """With the logits head (trainer.fused_logprobs=false) 32 of the 64 samples fit (as measured on the H200,
    bench/measured/h200_sglang_colocated_auto.md), not 64; the fused head fits the whole step in one."""
    logits_head = [*ANCHOR, "trainer.fused_logprobs=false"]
    cfg, notes = fitted(logits_head)
    t = cfg.trainer
    assert t.gradient_checkpointing is False
    assert (cfg.parallelism.offload_train, cfg.parallelism.offload_rollout) == (False, False)
    assert 16 <= t.micro_batch_size < 64  # the offload was chosen for >= 4096 tokens (16 x 256), then it grew
    assert peak_with([*logits_head, f"trainer.micro_batch_size={2 * t.micro_batch_size}",
                      "parallelism.offload_train=false", "parallelism.offload_rollout=false",
                      "trainer.gradient_checkpointing=false"]) > 0.9 * 140
    assert f"micro_batch_size={t.micro_batch_size} ({t.micro_batch_size} samples of up to 256 tokens)" in notes[0]
    cfg, notes = fitted(ANCHOR)
    t = cfg.trainer
    assert (t.micro_batch_size, t.gradient_checkpointing) == (64, False)
    assert (cfg.parallelism.offload_train, cfg.parallelism.offload_rollout) == (False, False)
    assert "micro_batch_size=64 (64 samples of up to 256 tokens)" in notes[0]


def test_a_micro_batch_the_user_set_is_described_as_set():
    """Only the recompute left to the plan: the line names the user's micro-batch, not a size the plan tried."""
    cfg, notes = fitted([*ANCHOR, "trainer.micro_batch_size=16"])
    assert cfg.trainer.micro_batch_size == 16
    assert "micro_batch_size=16 (16 samples of up to 256 tokens)" in notes[0]
    assert "peak GiB by samples (+rc: recompute): 16 " in notes[0]


def test_megatron_gets_a_packed_budget_of_whole_sequences():
    cfg, notes = fitted([*ANCHOR, "trainer=megatron"])
    t = cfg.trainer
    seq = (cfg.rollout.max_prompt_len or 0) + cfg.rollout.max_response_len
    assert t.max_tokens_per_micro_batch % seq == 0 and t.max_tokens_per_micro_batch >= seq
    assert t.recompute == "none" and t.micro_batch_size == F.CPU_DEFAULTS["micro_batch_size"]
    assert notes[0].startswith(f"micro-batch (auto): max_tokens_per_micro_batch={t.max_tokens_per_micro_batch} ")


def test_a_value_the_user_sets_is_kept_or_refused_with_what_fits():
    cfg, _ = fitted([*README_4B, "trainer.micro_batch_size=1"])
    assert cfg.trainer.micro_batch_size == 1 and cfg.trainer.gradient_checkpointing is True
    with pytest.raises(ConfigError) as e:
        check(compose([*README_4B, "trainer.micro_batch_size=32", "trainer.gradient_checkpointing=false"]))
    msg = str(e.value)
    assert "training needs" in msg and "lower trainer.micro_batch_size (now 32 samples" in msg
    assert "trainer: trainer.micro_batch_size=" in msg and "trainer.gradient_checkpointing=True fits" in msg


def test_nothing_fits_is_refused_with_no_false_suggestion():
    with pytest.raises(ConfigError) as e:  # 4B with Adam on every rank on a 16 GiB GPU: no micro-batch helps
        check(compose([*README_4B, "parallelism.gpu_memory_gib=16"]))
    assert "alone take" in str(e.value) and " fits (~" not in str(e.value)


def test_async_on_a_colocated_gpu_offloads_nothing_and_is_refused_with_the_sync_loop_not_an_offload():
    """trainer.mode=async trains while the next rollout generates, so the plan offloads nothing: the anchor
    workload fits its whole step beside the engine's half of the H200. Where no micro-batch fits beside the
    engine, the suggestion is the sync loop with the offload it would choose; where a smaller one fits, that."""
    cfg, _ = fitted([*ANCHOR, "trainer.mode=async"])
    assert (cfg.parallelism.offload_train, cfg.parallelism.offload_rollout) == (False, False)
    assert (cfg.trainer.micro_batch_size, cfg.trainer.gradient_checkpointing) == (64, False)
    with pytest.raises(ConfigError) as e:  # the logits head's 64 samples (68 GiB of activations) beside 70 GiB
        check(compose([*ANCHOR, "trainer.mode=async", "trainer.fused_logprobs=false", "trainer.micro_batch_size=64",
                       "trainer.gradient_checkpointing=false"]))
    msg = str(e.value)
    assert "set trainer.mode=sync (async trains while the next rollout generates, so nothing can be offloaded" in msg
    assert "trainer: trainer.micro_batch_size=32 fits" in msg and "trainer.mode=sync trainer." not in msg
    with pytest.raises(ConfigError) as e:  # SGLang keeps 0.9 of the GPU: nothing of the trainer fits beside it
        check(compose([*ANCHOR, "trainer.mode=async", "rollout.server_args.mem_fraction_static=0.9",
                       "trainer.fused_logprobs=false", "trainer.micro_batch_size=64"]))
    msg = str(e.value)
    assert "set parallelism.offload_rollout=true (" not in msg
    assert "parallelism.offload_train=True parallelism.offload_rollout=True fits" in msg
    assert "trainer: trainer.mode=sync " in msg and "async on colocated GPUs keeps trainer and engine resident" in msg


def test_cpu_runs_take_the_old_defaults():
    cfg = resolved([])
    assert cfg.trainer.micro_batch_size == 128  # the built-in task's recipe sets it
    cfg = resolved(["trainer.micro_batch_size=auto"])
    assert cfg.trainer.micro_batch_size == F.CPU_DEFAULTS["micro_batch_size"]
    assert cfg.trainer.gradient_checkpointing is False


@pytest.mark.parametrize("key, value", [("micro_batch_size", "big"), ("micro_batch_size", 0),
                                        ("max_tokens_per_micro_batch", "lots"), ("gradient_checkpointing", "yes")])
def test_bad_values_name_the_key(key, value):
    cfg = resolve(load(compose(["trainer=megatron", f"trainer.{key}={value}"])))
    assert any(p.startswith(f"trainer.{key}: must be") for p in validate(cfg))


def test_dry_run_prints_the_choice():
    out = subprocess.run([sys.executable, "run.py", *ANCHOR, "dry_run=true"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "micro-batch (auto): micro_batch_size=64" in out.stdout
