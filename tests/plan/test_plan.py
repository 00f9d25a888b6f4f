"""The resource plan, without Ray: bundles, who sits where, colocated or split, multi-node engines."""

from __future__ import annotations

from conftest import resolved
from slime_hydra.plan.resources import make_plan
from slime_hydra.rollout.fleet import engine_specs


def test_embedded_default_is_split_on_two_cpu_slots():
    plan = make_plan(resolved([]))
    assert plan.device == "cpu" and not plan.colocate
    assert plan.bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert [t.bundle for t in plan.trainers] == [0]
    assert [e.bundles for e in plan.engines] == [[1]]
    text = plan.describe()
    assert "trainer 0" in text and "embedded engine 0" in text and "split" in text


def test_colocated_8_gpus_share_bundles():
    cfg = resolved(["model=qwen3_4b", "rollout=sglang", "parallelism=colocate_8gpu"])
    plan = make_plan(cfg)
    assert plan.colocate and len(plan.bundles) == 8 and plan.bundles[0] == {"GPU": 1.0, "CPU": 1.0}
    assert [t.bundle for t in plan.trainers] == list(range(8))
    assert [e.bundles for e in plan.engines] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.data_parallel == 8
    assert "trainer 0 (0.4), sglang engine 0 (0.2, 2 GPUs)" in plan.describe()


def test_split_puts_engines_after_trainers():
    plan = make_plan(resolved(["model=qwen3_4b", "rollout=sglang", "parallelism=split_4_4"]))
    assert len(plan.bundles) == 8 and not plan.colocate
    assert [t.bundle for t in plan.trainers] == [0, 1, 2, 3]
    assert [e.lead for e in plan.engines] == [4, 5, 6, 7]


def test_multi_node_engine_has_one_spec_per_node():
    cfg = resolved(["model=deepseek_v3", "rollout=sglang", "parallelism=split_4_4", "parallelism.num_nodes=4",
                    "parallelism.trainer_gpus=16", "parallelism.rollout_gpus=16", "parallelism.gpus_per_engine=16"])
    plan = make_plan(cfg)
    assert len(plan.bundles) == 32 and [e.bundles for e in plan.engines] == [list(range(16, 32))]
    assert [plan.node_of(b) for b in (0, 15, 16, 31)] == [0, 1, 2, 3]
    (specs,) = engine_specs(cfg, plan, "deepseek-ai/DeepSeek-V3")
    assert [(s.nnodes, s.node_rank, s.gpus) for s in specs] == [(2, 0, 16), (2, 1, 16)]


def test_cpu_colocate_and_data_parallel_trainers():
    plan = make_plan(resolved(["parallelism=cpu_colocate"]))
    assert plan.colocate and len(plan.bundles) == 1 and plan.engines[0].bundles == [0]
    assert "offload: train=True rollout=True" in plan.describe()  # CPU slots: unset offload = colocate
    plan = make_plan(resolved(["parallelism=cpu_colocate", "parallelism.offload_rollout=false"]))
    assert "offload: train=True rollout=False" in plan.describe()
    plan = make_plan(resolved(["parallelism.trainer_gpus=2", "parallelism.gpus_per_node=3"]))
    assert [t.bundle for t in plan.trainers] == [0, 1] and plan.engines[0].bundles == [2] and plan.data_parallel == 2


def test_sft_starts_engines_only_to_evaluate():
    """algo=sft trains on labels: without eval sets the plan has no engines (nor their GPUs, nor a push);
    with eval sets its engines serve the eval only, and the plan says so."""
    for extra in ([], ["model=qwen3_4b", "rollout=sglang", "parallelism=colocate_8gpu"]):
        none = make_plan(resolved(["algo=sft", "eval.datasets=[]", *extra]))
        assert none.engines == [] and not none.colocate and len(none.bundles) == len(none.trainers)
        assert "engines: 0" in none.describe() and "none (no engines)" in none.describe()
        if none.memory is not None:  # on GPUs the estimate counts the trainer alone
            assert list(none.memory.gpus) == ["trainer GPU"] and none.memory.engine == {}
    evals = make_plan(resolved(["algo=sft"]))
    assert evals.engine_use == "eval" and len(evals.engines) == 1
    assert "evaluation only" in evals.describe() and "before each eval" in evals.describe()
    assert make_plan(resolved(["algo=grpo", "eval.datasets=[]"])).engine_use == "rollout"
