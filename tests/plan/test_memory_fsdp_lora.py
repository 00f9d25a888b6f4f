"""The memory plan of the torch backend's FSDP2 strategy and LoRA (slime_hydra/plan/memory.py,
``torch_trainer_memory``): sharded state, gather buffers, adapter counts checked against PEFT, what
``dry_run`` prints, and the DDP refusal naming the ones that would fit."""

from __future__ import annotations

import pytest
from test_memory import ROOT, hf_model, small_arch

from conftest import resolved
from slime_hydra.plan import memory as M, params as P
from slime_hydra.plan.resources import make_plan

JSONL = [f"data.path={ROOT / 'tests/fixtures/tiny.jsonl'}", "data=jsonl", "eval.datasets=[]", "rollout=sglang",
         "trainer.micro_batch_size=1", "trainer.gradient_checkpointing=true"]


def est(*overrides):
    cfg = resolved([*JSONL, *overrides])
    return M.estimate(cfg, make_plan(cfg)), cfg


@pytest.mark.parametrize("kind", ["qwen3", "llama", "glm4", "qwen3_moe", "deepseek_v3"])
def test_lora_parameter_count_is_pefts(kind):
    """r x (in + out) per adapted linear layer, for each family's default target modules: PEFT's own count
    of trainable parameters on the Hugging Face model."""
    from peft import LoraConfig, get_peft_model

    from slime_hydra.train.backends.torch.lora import LORA_TARGET_MODULES

    cfg = resolved(["trainer.lora.rank=8"])
    cfg.model.arch = small_arch(kind)
    model = get_peft_model(hf_model(cfg.model.arch), LoraConfig(r=8, target_modules=LORA_TARGET_MODULES[kind]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert P.lora_params(cfg) == trainable > 0


def test_fsdp_shards_weights_grads_and_adam_over_the_data_parallel_ranks():
    ddp, _ = est("model=qwen3_8b", "parallelism=colocate_8gpu")
    fsdp, cfg = est("model=qwen3_8b", "parallelism=colocate_8gpu", "trainer.strategy=fsdp")
    n = P.param_count(cfg.model.arch).total
    assert fsdp.backend == "torch (fsdp)"
    for part, per_param in (("weights", 4), ("grads", 4), ("adam", 8)):
        assert fsdp.trainer[part] == pytest.approx(per_param * n / 8 / M.GIB)
        assert fsdp.trainer[part] == pytest.approx(ddp.trainer[part] / 8)
    assert fsdp.trainer.get("ddp_buckets", 0) == 0 and fsdp.trainer.get("autocast_copies", 0) == 0
    # two bf16 decoder layers and the root gathered, the root's and one layer's gradients unsharded
    a = cfg.model.arch
    root = 2 * a.vocab_size * a.hidden_size + a.hidden_size  # untied embedding + LM head, final norm
    layer = (n - root) / a.num_layers
    assert fsdp.trainer["gather_buffers"] == pytest.approx((2 * (2 * layer + root) + 2 * root + 6 * layer) / M.GIB)
    assert fsdp.trainer_total < ddp.trainer_total / 2


def test_fsdp_cpu_offload_keeps_the_state_on_the_host():
    on_gpu, _ = est("model=qwen3_8b", "parallelism=colocate_8gpu", "trainer.strategy=fsdp")
    off, _ = est("model=qwen3_8b", "parallelism=colocate_8gpu", "trainer.strategy=fsdp",
                 "trainer.fsdp_cpu_offload=true")
    state = ("weights", "grads", "adam", "reference")
    assert all(off.trainer.get(k, 0) == 0 for k in state)
    assert off.trainer["gather_buffers"] == on_gpu.trainer["gather_buffers"]
    held = sum(on_gpu.trainer[k] for k in state)
    assert off.host_per_node["fsdp_cpu_offload"] == pytest.approx(8 * held)  # 8 ranks on the node
    assert off.backend == "torch (fsdp, CPU offload)"


def test_lora_keeps_the_base_in_model_dtype_and_trains_the_adapters_in_float32():
    lora, cfg = est("model=qwen3_4b", "parallelism=1gpu", "trainer.lora.rank=16", "algo.kl_loss_coef=0.01")
    n, adapters = P.param_count(cfg.model.arch).total, P.lora_params(cfg)
    assert adapters == 16 * 36 * (2 * (2560 + 4096) + 2 * (2560 + 1024) + 3 * (2560 + 9728))  # per-layer shapes
    assert lora.trainer["weights"] == pytest.approx((2 * n + 4 * adapters) / M.GIB)
    assert lora.trainer["grads"] == pytest.approx(4 * adapters / M.GIB)
    assert lora.trainer["adam"] == pytest.approx(8 * adapters / M.GIB)
    assert "reference" not in lora.trainer or lora.trainer["reference"] == 0  # the base is the reference
    assert lora.backend == "torch (ddp, LoRA rank 16)"
    both, _ = est("model=qwen3_4b", "parallelism=colocate_8gpu", "trainer.lora.rank=16", "trainer.strategy=fsdp")
    assert both.trainer["weights"] == pytest.approx((2 * n + 4 * adapters) / 8 / M.GIB)


def test_dry_run_prints_the_strategy_and_lora():
    cfg = resolved([*JSONL, "model=qwen3_8b", "parallelism=1gpu", "trainer.lora.rank=64"])
    text = make_plan(cfg).describe()
    assert "Memory estimate, GiB per GPU (torch (ddp, LoRA rank 64) trainer;" in text


def test_the_ddp_refusal_names_what_would_fit():
    """Qwen3-8B with full weights on one H200 does not fit (16 bytes a parameter and a reference copy);
    LoRA does, and FSDP2 is not offered on one GPU (it would shard nothing) except with its CPU offload.
    On eight GPUs Qwen3-30B-A3B fits with FSDP2 or LoRA."""
    cfg = resolved([*JSONL, "model=qwen3_8b", "parallelism=1gpu", "algo.kl_loss_coef=0.01"])
    (problem,) = M.memory_problems(cfg, make_plan(cfg), 140.0)
    assert "the torch backend with DDP replicates them on every GPU" in problem
    fits = problem.split("these would fit: ")[1]
    assert "trainer.lora.rank=16 (trainer ~" in fits and "trainer.strategy=fsdp trainer.fsdp_cpu_offload=true" in fits
    assert "trainer.strategy=fsdp (" not in fits
    cfg = resolved([*JSONL, "model=qwen3_30b_a3b", "parallelism=colocate_8gpu", "parallelism.offload_train=true"])
    problem = M.memory_problems(cfg, make_plan(cfg), 140.0)[0]
    assert problem.startswith("parallelism: colocated GPU, training needs")
    assert "trainer.strategy=fsdp (trainer ~" in problem and "trainer.lora.rank=16 (trainer ~" in problem
    # what it names does fit
    alt = resolved([*JSONL, "model=qwen3_30b_a3b", "parallelism=colocate_8gpu", "parallelism.offload_train=true",
                    "trainer.strategy=fsdp"])
    assert M.memory_problems(alt, make_plan(alt), 140.0) == []
