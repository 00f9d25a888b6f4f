"""trainer=megatron composes, validates and plans (no megatron-core import), and its rules fire with their
keys: the torch backend's data-parallel-only rule does not apply to it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, resolved
from slime_hydra.launch.validate import validate

TINY = ROOT / "tests/fixtures/tiny.jsonl"
MEGATRON = ["trainer=megatron", "model=qwen3_0_6b", "data=jsonl", f"data.path={TINY}", "eval.datasets=[]"]


def errors(overrides):
    os.chdir(ROOT)
    return validate(resolved(overrides))


def test_megatron_config_composes_with_its_defaults():
    cfg = resolved(["trainer=megatron"])
    t = cfg.trainer
    assert (t.backend, t.max_tokens_per_micro_batch, t.recompute, t.use_distributed_optimizer, t.megatron) == \
        ("megatron", 16384, "none", True, {})
    assert t.micro_batch_size == resolved([]).trainer.micro_batch_size  # the other trainer settings are kept


@pytest.mark.parametrize("overrides", [
    ["parallelism=1gpu"],
    ["parallelism=colocate_8gpu", "parallelism.gpus_per_engine=1", "parallelism.tensor_parallel=2",
     "parallelism.pipeline_parallel=2", "parallelism.virtual_pipeline_parallel=2", "trainer.recompute=full",
     "+trainer.megatron.apply_rope_fusion=false"],
])
def test_model_parallel_megatron_layouts_are_valid(overrides):
    assert errors([*MEGATRON, *overrides]) == []


RULES = [
    (["parallelism=1gpu", "trainer.recompute=some"], "trainer.recompute: 'some' is not one of"),
    (["parallelism=1gpu", "trainer.max_tokens_per_micro_batch=0"], "trainer.max_tokens_per_micro_batch: must be"),
    (["parallelism=colocate_8gpu", "parallelism.context_parallel=2"], "parallelism.context_parallel: the megatron"),
    (["parallelism=1gpu", "parallelism.virtual_pipeline_parallel=2"], "parallelism.virtual_pipeline_parallel: 2 needs"),
    (["parallelism=colocate_8gpu", "parallelism.pipeline_parallel=4", "parallelism.virtual_pipeline_parallel=5"],
     "does not divide num_layers=28"),
    (["parallelism=1gpu", "trainer.gradient_checkpointing=true"], "trainer.gradient_checkpointing: the torch"),
    ([], "parallelism.device: the megatron backend needs GPUs"),
]


@pytest.mark.parametrize("overrides, expected", RULES, ids=[r[1][:40] for r in RULES])
def test_megatron_rules_fire(overrides, expected):
    errs = errors([*MEGATRON, *overrides])
    assert any(expected in e for e in errs), errs


def test_torch_backend_still_refuses_model_parallel_sizes():
    errs = errors([*MEGATRON[1:], "parallelism=colocate_8gpu", "parallelism.tensor_parallel=2"])
    assert any("the torch trainer backend is data-parallel only" in e for e in errs), errs


def test_dry_run_plans_a_megatron_run():
    out = subprocess.run([sys.executable, "run.py", *MEGATRON, "parallelism=1gpu", "dry_run=true"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "megatron trainer" in out.stdout + out.stderr and "config is valid" in out.stdout + out.stderr
