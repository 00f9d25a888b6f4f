"""The seed models' experiment files (``conf/experiment/``): each composes with trainer=megatron and
rollout=sglang, validates, and ``dry_run=true`` prints the layout slime's run script uses, with a memory
estimate that fits the GPUs; layouts that cannot fit are refused with the numbers."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT, resolved
from slime_hydra.launch.validate import validate
from slime_hydra.plan.memory import memory_problems
from slime_hydra.plan.resources import make_plan

DATA = ROOT / "tests/fixtures/tiny.jsonl"

# experiment -> (model, GPUs, trainer ranks, their model-parallel line, data parallel, engines, GPUs per engine)
SEEDS = {
    "qwen3_4b_grpo_math": ("qwen3_4b", 8, 8, "tp 2 x pp 1 x cp 1", 4, 4, 2),
    "qwen3_30b_a3b_grpo_math": ("qwen3_30b_a3b", 8, 8, "tp 4 x pp 1 x cp 1 x ep 8 x etp 1", 2, 1, 8),
    "glm4_9b_grpo_math": ("glm4_9b", 8, 4, "tp 2 x pp 1 x cp 1", 2, 4, 1),  # split: 4 train, 4 serve
    "llama3_8b_grpo_gsm8k": ("llama3_8b", 4, 4, "tp 2 x pp 1 x cp 1", 2, 4, 1),
    "deepseek_v3_grpo_math": ("deepseek_v3", 128, 128, "tp 8 x pp 4 x cp 1 x ep 32 x etp 1", 4, 2, 64),
}


def _cfg(experiment, *overrides):
    return resolved([f"experiment={experiment}", f"data.path={DATA}", *overrides])


@pytest.mark.parametrize("experiment", sorted(SEEDS))
def test_seed_experiment_validates_on_megatron_and_sglang(experiment):
    cfg = _cfg(experiment)
    model, gpus, trainers, _, dp, engines, per_engine = SEEDS[experiment]
    assert (cfg.model.name, cfg.trainer.backend, cfg.rollout.engine) == (model, "megatron", "sglang")
    assert cfg.trainer.recompute == "full" and cfg.trainer.use_distributed_optimizer
    assert validate(cfg) == []
    plan = make_plan(cfg)
    assert (len(plan.bundles), len(plan.trainers), plan.data_parallel) == (gpus, trainers, dp)
    assert len(plan.engines) == engines
    assert all(len(e.bundles) == per_engine for e in plan.engines)
    est = plan.memory
    assert est is not None and est.backend == "megatron"
    assert 0 < est.peak <= cfg.parallelism.gpu_memory_gib
    # the trainer's state is sharded: far below the 18 bytes a parameter of an unsharded megatron rank
    from slime_hydra.plan.memory import GIB
    from slime_hydra.plan.params import param_count

    state = sum(est.trainer[k] for k in ("weights", "grads", "adam"))
    assert state < 18 * param_count(cfg.model.arch).total / GIB / 2


@pytest.mark.parametrize("experiment", sorted(SEEDS))
def test_dry_run_prints_the_plan(experiment):
    out = subprocess.run([sys.executable, "run.py", f"experiment={experiment}", f"data.path={DATA}", "dry_run=true",
                          "hydra.run.dir=/tmp/slime_hydra_dry_experiments"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    _, gpus, trainers, mp, dp, engines, per_engine = SEEDS[experiment]
    assert f"one placement group (PACK) of {gpus} bundles" in text
    assert f"trainers: {trainers} (data parallel {dp}; {mp})" in text
    assert f"engines: {engines} x {per_engine} GPU" in text
    assert "megatron trainer" in text and "DOES NOT FIT" not in text and "config is valid" in text
    peaks = [float(v) for v in re.findall(r"(?:colocated GPU, \w+|trainer GPU|engine GPU): ([\d.]+)", text)]
    assert peaks and max(peaks) <= 140


def test_qwen3_4b_fits_with_room_and_its_estimate_is_the_closed_form():
    """TP 2: each rank holds half of Qwen3-4B (its tied embedding whole: PP 1) in bf16, float32 gradients,
    and a quarter (data parallel 4) of the float32 main weights and Adam moments."""
    from slime_hydra.plan.memory import GIB
    from slime_hydra.plan.params import param_count

    cfg = _cfg("qwen3_4b_grpo_math")
    est = make_plan(cfg).memory
    n = param_count(cfg.model.arch).total
    assert est.trainer["weights"] == pytest.approx(2 * n / 2 / GIB)
    assert est.trainer["grads"] == pytest.approx(4 * n / 2 / GIB)
    assert est.trainer["adam"] == pytest.approx(12 * n / 2 / 4 / GIB)
    assert est.micro_batch.samples == 1 and est.micro_batch.positions == 8192  # 9216-token budget, 8192-token samples
    # nothing offloaded by default: trainer and engines side by side fit 90% of the GPU (measured 119 GiB)
    assert (cfg.parallelism.offload_train, cfg.parallelism.offload_rollout) == (False, False)
    assert 100 < est.gpus["colocated GPU, training"] <= 0.9 * 140
    both = make_plan(_cfg("qwen3_4b_grpo_math", "parallelism.offload_train=true",
                          "parallelism.offload_rollout=true")).memory
    assert both.gpus["colocated GPU, training"] < 40 and both.gpus["colocated GPU, rollout"] < 100


WRONG = [
    # Qwen3-30B-A3B with every expert on every GPU (no expert parallel) and no optimizer sharding
    (["experiment=qwen3_30b_a3b_grpo_math", "parallelism.expert_parallel=1", "trainer.use_distributed_optimizer=false"],
     r"colocated GPU, training needs ~(\d+) GiB .*Adam (\d+\.\d).*or trainer.use_distributed_optimizer=true"),
    # ... or with the distributed optimizer, still without expert parallel
    (["experiment=qwen3_30b_a3b_grpo_math", "parallelism.expert_parallel=1"],
     r"colocated GPU, training needs ~(\d+) GiB .*shard them further: tensor, pipeline or expert parallel"),
    # DeepSeek-V3 on one node
    (["experiment=deepseek_v3_grpo_math", "parallelism=colocate_8gpu_tp4_ep8", "cluster.address=null",
      "sync.transport=auto", "~trainer.megatron.num_layers_in_last_pipeline_stage"],
     r"colocated GPU, training needs ~(\d+) GiB"),
]


@pytest.mark.parametrize("overrides, pattern", WRONG, ids=["30b_no_ep_no_distopt", "30b_no_ep", "dsv3_8gpu"])
def test_layouts_that_cannot_fit_are_refused_with_numbers(overrides, pattern):
    cfg = resolved([*overrides, f"data.path={DATA}"])
    problems = validate(cfg)
    match = next((re.search(pattern, p) for p in problems if re.search(pattern, p)), None)
    assert match, problems
    assert int(match.group(1)) > cfg.parallelism.gpu_memory_gib


def test_expert_and_tensor_parallel_need_sequence_parallel():
    errs = validate(_cfg("qwen3_30b_a3b_grpo_math", "parallelism.sequence_parallel=false"))
    assert any(e.startswith("parallelism.sequence_parallel: must be true with expert") for e in errs), errs


def test_the_experts_grid_must_divide_the_trainer_gpus():
    errs = validate(_cfg("qwen3_30b_a3b_grpo_math", "parallelism.expert_tensor_parallel=null"))  # = TP 4
    assert any("expert_parallel x expert_tensor_parallel x pipeline_parallel = 8 x 4 x 1 = 32, must divide "
               "trainer_gpus=8" in e for e in errs), errs


@pytest.mark.parametrize("overrides, expected", [
    (["~trainer.megatron.num_layers_in_last_pipeline_stage"],
     "parallelism.pipeline_parallel: 4 does not divide num_layers=61"),
    (["trainer.megatron.num_layers_in_last_pipeline_stage=14"],
     "num_layers=61 minus the last 14 layers given leaves 47, which must split evenly over the other 3"),
])
def test_an_uneven_pipeline_needs_the_stage_sizes(overrides, expected):
    errs = validate(_cfg("deepseek_v3_grpo_math", *overrides))
    assert any(expected in e for e in errs), errs


def test_uneven_stages_are_megatrons():
    """The estimate's split of the layers over pipeline stages is megatron-core's own."""
    pytest.importorskip("megatron.core")
    from slime_hydra.model.hf import hf_config
    from slime_hydra.plan.memory import stage_layers
    from slime_hydra.train.backends.megatron.model import Parallel, transformer_config
    from slime_hydra.train.backends.megatron.spec import stage_layers as megatron_stage

    cfg = _cfg("deepseek_v3_grpo_math")
    p = cfg.parallelism
    parallel = Parallel(tp=p.tensor_parallel, pp=p.pipeline_parallel, ep=p.expert_parallel,
                        etp=p.expert_tensor_parallel, sequence_parallel=p.sequence_parallel)
    config = transformer_config(hf_config(cfg.model.arch), parallel, overrides=dict(cfg.trainer.megatron))
    ours = stage_layers(cfg.model.arch.num_layers, p.pipeline_parallel, cfg.trainer.megatron)
    assert ours == [16, 16, 16, 13]
    assert [len(megatron_stage(config, pp_rank=r)) for r in range(p.pipeline_parallel)] == ours
    assert memory_problems(cfg, make_plan(cfg), p.gpu_memory_gib) == []
