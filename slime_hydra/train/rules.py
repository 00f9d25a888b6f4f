"""Config rules of the trainer: its backend, parameter dtype and model-parallel sizes, and the batch
arithmetic of its optimiser steps. The algorithm's rules are in ``train/algorithms/rules.py``."""

from __future__ import annotations

from typing import List

from slime_hydra.config.rules import choice
from slime_hydra.config.schema import RunConfig
from slime_hydra.train.backend import BACKENDS
from slime_hydra.train.backends.torch.lora import LORA_LINEAR_MODULES, LORA_TARGET_MODULES, unknown_targets

DTYPES = ["float32", "bfloat16", "float16"]


def check(cfg: RunConfig) -> List[str]:
    errs: List[str] = []
    t, p, arch = cfg.trainer, cfg.parallelism, cfg.model.arch
    choice(errs, "trainer.backend", t.backend, BACKENDS)
    choice(errs, "model.dtype", cfg.model.dtype, DTYPES)
    _positive_or_auto(errs, "trainer.micro_batch_size", t.micro_batch_size)
    for key in ("gradient_checkpointing", "warm_up"):
        if getattr(t, key) not in (True, False, "auto"):
            errs.append(f"trainer.{key}: must be true, false or auto, got {getattr(t, key)!r}")
    if t.max_restarts_per_hour < 0:
        errs.append(f"trainer.max_restarts_per_hour: must be >= 0 (0: no rebuild), got {t.max_restarts_per_hour}")
    if t.hang_timeout_s is not None and t.hang_timeout_s <= 0:
        errs.append(f"trainer.hang_timeout_s: must be > 0 seconds, or null for none; got {t.hang_timeout_s}")
    sizes = {"tensor_parallel": p.tensor_parallel, "pipeline_parallel": p.pipeline_parallel,
             "context_parallel": p.context_parallel, "expert_parallel": p.expert_parallel,
             "expert_tensor_parallel": p.expert_tensor_parallel or p.tensor_parallel}
    for name, size in sizes.items():
        if size < 1:
            errs.append(f"parallelism.{name}: must be >= 1, got {size}")
    if min(sizes.values()) < 1:
        return errs
    mp = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
    if p.trainer_gpus % mp:
        errs.append(f"parallelism.trainer_gpus: {p.trainer_gpus} is not divisible by tensor x pipeline x context "
                    f"parallel = {p.tensor_parallel} x {p.pipeline_parallel} x {p.context_parallel} = {mp}")
    kv_heads_split = arch.num_kv_heads % p.tensor_parallel == 0 or p.tensor_parallel % arch.num_kv_heads == 0
    if arch.num_heads % p.tensor_parallel or not kv_heads_split:
        errs.append(f"parallelism.tensor_parallel: {p.tensor_parallel} must divide num_heads={arch.num_heads} and "
                    f"divide or be a multiple of num_kv_heads={arch.num_kv_heads}")
    errs.extend(_check_pipeline_stages(cfg))
    if p.expert_parallel > 1 and (not arch.num_experts or arch.num_experts % p.expert_parallel):
        errs.append(f"parallelism.expert_parallel: {p.expert_parallel} must divide num_experts={arch.num_experts}")
    if p.sequence_parallel and p.tensor_parallel == 1:
        errs.append("parallelism.sequence_parallel: needs tensor_parallel > 1")
    if t.backend == "torch" and (mp > 1 or p.expert_parallel > 1 or sizes["expert_tensor_parallel"] > 1):
        errs.append("parallelism.tensor_parallel: the torch trainer backend is data-parallel only; "
                    "tensor/pipeline/context/expert parallel sizes must be 1")
    if t.backend == "megatron":
        errs.extend(_check_megatron(cfg))
    errs.extend(_check_strategy_and_lora(cfg))
    errs.extend(_check_batches(cfg, data_parallel=max(p.trainer_gpus // mp, 1)))
    return errs


def _positive_or_auto(errs: List[str], key: str, value, also: str = "") -> None:
    """``value`` must be an integer >= 1 or ``auto`` (left to the memory plan, ``plan/fit.py``)."""
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        errs.append(f"{key}: must be an integer >= 1, {also}or auto, got {value!r}")


def _check_pipeline_stages(cfg: RunConfig) -> List[str]:
    """The decoder layers split over the pipeline stages: evenly, or (megatron) with the first and/or last
    stage's count given in ``trainer.megatron`` and the rest evenly over the middle stages."""
    p, arch, m = cfg.parallelism, cfg.model.arch, cfg.trainer.megatron or {}
    pp, n = p.pipeline_parallel, arch.num_layers
    ends = {k: m.get(f"num_layers_in_{k}_pipeline_stage") for k in ("first", "last")}
    ends = {k: v for k, v in ends.items() if v is not None}
    if not ends or cfg.trainer.backend != "megatron":
        return [] if n % pp == 0 else [f"parallelism.pipeline_parallel: {pp} does not divide num_layers={n}"]
    given = " + ".join(f"{k} {v}" for k, v in ends.items())
    middle, rest = pp - len(ends), n - sum(ends.values())
    if pp < 2 or middle < 0 or rest < 0 or min(ends.values()) < 1 or (rest % middle if middle else rest):
        return [f"trainer.megatron.num_layers_in_{'_'.join(ends)}_pipeline_stage: num_layers={n} minus the {given} "
                f"layers given leaves {rest}, which must split evenly over the other {middle} of "
                f"pipeline_parallel={pp} stages"]
    return []


def _check_batches(cfg: RunConfig, data_parallel: int) -> List[str]:
    """A rollout's samples split into whole optimiser steps, each split evenly over the data-parallel ranks."""
    r, t = cfg.rollout, cfg.trainer
    if t.global_batch_size is None or t.num_steps_per_rollout is None:
        return []
    errs = []
    samples = r.batch_size * r.n_samples_per_prompt
    if samples != t.global_batch_size * t.num_steps_per_rollout:
        errs.append(
            f"trainer.global_batch_size: rollout.batch_size x rollout.n_samples_per_prompt = {r.batch_size} x "
            f"{r.n_samples_per_prompt} = {samples} must equal trainer.global_batch_size x "
            f"trainer.num_steps_per_rollout = {t.global_batch_size} x {t.num_steps_per_rollout} = "
            f"{t.global_batch_size * t.num_steps_per_rollout}")
    if t.global_batch_size % data_parallel:
        errs.append(f"trainer.global_batch_size: {t.global_batch_size} is not divisible by the data-parallel size "
                    f"{data_parallel}")
    return errs


STRATEGIES = ["ddp", "fsdp"]
LORA_PUSH = ["merged"]  # "adapter" (SGLang's LoRA endpoints) would be the next: see train/backends/torch/lora.py


def _check_strategy_and_lora(cfg: RunConfig) -> List[str]:
    """The torch backend's data-parallel strategy (DDP or FSDP2) and LoRA: what they do not combine with."""
    errs: List[str] = []
    t, lora = cfg.trainer, cfg.trainer.lora
    choice(errs, "trainer.strategy", t.strategy, STRATEGIES)
    if t.backend != "torch":
        if t.strategy != "ddp" or t.fsdp_cpu_offload:
            errs.append(f"trainer.strategy: {t.strategy!r} (and trainer.fsdp_cpu_offload) belong to the torch backend; "
                        f"trainer.backend={t.backend!r} shards with its own parallelism.* sizes")
        if lora.rank:
            errs.append(f"trainer.lora.rank: LoRA runs on the torch backend only (trainer.backend={t.backend!r} has "
                        "no adapters); use trainer=torch with trainer.lora.rank, or trainer.lora.rank=0")
        return errs
    if t.fsdp_cpu_offload and (t.strategy != "fsdp" or cfg.parallelism.device != "cuda"):
        errs.append("trainer.fsdp_cpu_offload: needs trainer.strategy=fsdp on GPUs (parallelism.device=cuda): it keeps "
                    "the shards in host memory instead of the GPU's")
    if cfg.algo.advantage_estimator == "ppo" and (t.strategy == "fsdp" or lora.rank):
        key = "trainer.lora.rank" if lora.rank else "trainer.strategy"
        errs.append(f"{key}: PPO's critic is trained with DDP and full weights only; use trainer.strategy=ddp and "
                    "trainer.lora.rank=0 with advantage_estimator=ppo")
    if lora.rank < 0:
        errs.append(f"trainer.lora.rank: must be >= 0 (0: no LoRA), got {lora.rank}")
    if lora.rank:
        if lora.alpha <= 0:
            errs.append(f"trainer.lora.alpha: must be > 0, got {lora.alpha}")
        if not 0 <= lora.dropout < 1:
            errs.append(f"trainer.lora.dropout: must be in [0, 1), got {lora.dropout}")
        choice(errs, "trainer.lora.push", lora.push, LORA_PUSH)
        if lora.target_modules is not None and not lora.target_modules:
            errs.append("trainer.lora.target_modules: an empty list adapts nothing; null takes the family's default")
        if lora.target_modules is None and cfg.model.arch.type not in LORA_TARGET_MODULES:
            errs.append(f"trainer.lora.target_modules: no default for model.arch.type={cfg.model.arch.type!r} "
                        f"(known: {', '.join(LORA_TARGET_MODULES)}); list the module names to adapt")
        linear = LORA_LINEAR_MODULES.get(cfg.model.arch.type)  # (an unknown arch.type: model/rules.py)
        if lora.target_modules and linear is not None:  # the wrap checks them against the model itself too
            bad = [str(n) for n in lora.target_modules if str(n).rpartition(".")[2] not in linear]
            if bad:
                errs.append(unknown_targets(bad, linear))
    return errs


RECOMPUTE = ["none", "selective", "full", "auto"]


def _check_megatron(cfg: RunConfig) -> List[str]:
    """The megatron backend's own fields, and what it does not do (yet)."""
    errs: List[str] = []
    t, p, arch = cfg.trainer, cfg.parallelism, cfg.model.arch
    choice(errs, "trainer.recompute", t.recompute, RECOMPUTE)
    if p.device != "cuda":
        errs.append("parallelism.device: the megatron backend needs GPUs (megatron-core's DDP, optimizer and "
                    "schedules assume CUDA); use parallelism.device=cuda or trainer=torch")
    if t.max_tokens_per_micro_batch is not None:
        _positive_or_auto(errs, "trainer.max_tokens_per_micro_batch", t.max_tokens_per_micro_batch, "null, ")
    if p.context_parallel > 1:
        errs.append("parallelism.context_parallel: the megatron backend does not split sequences over context "
                    "parallel ranks yet (our attention spec has no context parallelism); use 1")
    vpp = p.virtual_pipeline_parallel
    if vpp is not None:
        if vpp < 1 or p.pipeline_parallel < 2:
            errs.append(f"parallelism.virtual_pipeline_parallel: {vpp} needs pipeline_parallel > 1 and a value >= 1 "
                        "(null: off)")
        elif arch.num_layers % (p.pipeline_parallel * vpp):
            errs.append(f"parallelism.virtual_pipeline_parallel: pipeline_parallel x virtual = "
                        f"{p.pipeline_parallel * vpp} does not divide num_layers={arch.num_layers}")
    etp = p.expert_tensor_parallel or p.tensor_parallel
    experts = p.expert_parallel * etp * p.pipeline_parallel
    if p.trainer_gpus % experts:
        errs.append(f"parallelism.expert_parallel: the experts' grid, expert_parallel x expert_tensor_parallel x "
                    f"pipeline_parallel = {p.expert_parallel} x {etp} x {p.pipeline_parallel} = {experts}, must divide "
                    f"trainer_gpus={p.trainer_gpus} (expert_tensor_parallel defaults to tensor_parallel)")
    if p.expert_parallel > 1 and p.tensor_parallel > 1 and not p.sequence_parallel:
        errs.append("parallelism.sequence_parallel: must be true with expert and tensor parallelism together "
                    "(megatron-core's ModelParallelConfig says so, as a warning; slime's MoE scripts set it)")
    if t.gradient_checkpointing is True:
        errs.append("trainer.gradient_checkpointing: the torch backend's switch; with trainer=megatron use "
                    "trainer.recompute=selective|full")
    return errs
