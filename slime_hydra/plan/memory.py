"""Memory per GPU of a run, estimated from the config before anything starts (docs/memory.md):
``estimate`` adds up what the trainer and the engine hold on one GPU, ``memory_problems`` turns an estimate
that cannot fit into validation errors with the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Protocol, Tuple

from slime_hydra.plan.activations import (
    LOGPROB_CHUNK,
    MicroBatchShape,
    activation_bytes,
    micro_batch_shape,
    rank_step_samples,
)
from slime_hydra.plan.params import DTYPE_BYTES, dtype_bytes, head_dim, is_mla, lora_params, moe_layers, param_count

if TYPE_CHECKING:
    from slime_hydra.config.schema import ArchConfig, RunConfig


class Plan(Protocol):
    """What the estimate reads of :class:`slime_hydra.plan.resources.ResourcePlan` (this module is below it)."""

    data_parallel: int
    colocate: bool
    engines: list


GIB = 2 ** 30
KV_CACHE_DTYPE_BYTES = {"fp8_e4m3": 1, "fp8_e5m2": 1, "fp4_e2m1": 0.5, "bfloat16": 2, "float16": 2, "float32": 4}
SGLANG_MEM_FRACTION_DEFAULT = 0.9
# the share of a GPU choose_offload leaves free for what the estimate does not count (CUDA contexts, graphs)
AUTO_OFFLOAD_HEADROOM = 0.1
# (offload_train, offload_rollout) in the order choose_offload tries them, least memory moved first
OFFLOAD_CHOICES = ((False, False), (False, True), (True, False), (True, True))
# parallelism.push_before_offload's phase: the trainer's weights beside the engine's, and the push's buckets
PUSH_PHASE = "colocated GPU, push"
# parts held only during a training step
TRANSIENT = ("autocast_copies", "activations", "gather_buffers", "teacher_forward")
PART_NAMES = {"adam": "Adam", "ddp_buckets": "DDP buckets", "kv_cache": "KV cache"}
HOST_REFUSE, HOST_WARN = 0.9, 0.7  # shares of a node's memory: the estimate leaves out the processes' own memory
FSDP_LORA_RANK = 16  # the LoRA rank the DDP refusal tries
KV_MARGIN = 2.0  # kv_cache_hint sizes SGLang's KV pool at this many times the tokens a rollout keeps in flight


@dataclass
class TrainerMemory:
    """Bytes per trainer GPU by part, the parts ``offload_train`` moves off it, host bytes per trainer rank."""

    gpu: Dict[str, float]
    offloaded: Tuple[str, ...] = ()
    host: Dict[str, float] = field(default_factory=dict)
    micro_batch: Optional["MicroBatchShape"] = None  # the largest one a rank runs (None: micro_batch_shape's)


def torch_trainer_memory(cfg: "RunConfig", plan: "Plan") -> TrainerMemory:
    """The torch backend: DDP, FSDP2 and/or LoRA (docs/memory.md)."""
    a, p, t = cfg.model.arch, cfg.parallelism, cfg.trainer
    pc = param_count(a)
    n, gpu = pc.total, p.device == "cuda"
    compute = dtype_bytes(cfg.model.dtype)
    master = 4 if gpu else compute  # float32 master weights on GPUs; model.dtype throughout on CPU
    fsdp, lora = t.strategy == "fsdp", t.lora.rank > 0
    shards = max(plan.data_parallel, 1) if fsdp else 1
    adapters = lora_params(cfg) if lora else 0
    trainable, train_bytes = (adapters, 4) if lora else (n, master)  # adapters are float32 (PEFT upcasts them)
    base_bytes = compute if lora else master
    needs_ref = bool(cfg.algo.kl_coef or cfg.algo.kl_loss_coef) and not lora  # LoRA: the base is the reference
    # PPO's critic: a second backbone, trained with DDP and full weights (the rules refuse it with FSDP2 or LoRA)
    critic = n - pc.lm_head if cfg.algo.advantage_estimator == "ppo" and not (fsdp or lora) else 0
    gpu_parts = {"weights": (base_bytes * n + (4 * adapters if lora else 0)) / shards,
                 "grads": train_bytes * trainable / shards,
                 "adam": 2 * train_bytes * trainable / shards,
                 "reference": (compute if fsdp else master) * n / shards if needs_ref else 0,
                 "critic": 4 * master * critic,
                 "ddp_buckets": train_bytes * (trainable + critic) if not fsdp and plan.data_parallel > 1 else 0}
    if fsdp:
        root = a.vocab_size * a.hidden_size + pc.lm_head + a.hidden_size
        layer = (n - root) / a.num_layers
        grad_bytes = 0 if lora else compute + (4 if gpu and compute < 4 else 0)
        gpu_parts["gather_buffers"] = compute * (2 * layer + root) + (compute * root + grad_bytes * layer
                                                                      if not lora else 0)
    host: Dict[str, float] = {}
    state = ("weights", "grads", "adam", "reference", "critic")  # not DDP's buckets
    if fsdp and t.fsdp_cpu_offload:
        host["fsdp_cpu_offload"] = sum(gpu_parts[k] for k in state)
        for k in state:
            gpu_parts[k] = 0
    elif p.colocate and p.offload_train and gpu:  # gradients are dropped
        host["offloaded_state"] = sum(gpu_parts[k] for k in ("weights", "adam", "reference")) + 3 * master * critic
    autocast = gpu and compute < 4
    if autocast and not fsdp:  # DDP: autocast's model.dtype copies of the float32 weights (LoRA: the adapters)
        gpu_parts["autocast_copies"] = compute * ((adapters if lora else n) + critic)
    acts = activation_bytes(a, micro_batch_shape(cfg, plan.data_parallel), compute_bytes=compute, autocast=autocast,
                            residual_bytes=compute if (lora or fsdp) and gpu else master,
                            checkpointing=t.gradient_checkpointing, fused_head=t.fused_logprobs,
                            compiled=t.compile)
    gpu_parts["activations"] = acts["layers"] + acts["logits"]
    return TrainerMemory(gpu=gpu_parts, offloaded=state, host=host)


def torch_trainer_label(cfg: "RunConfig") -> str:
    t = cfg.trainer
    parts = [t.strategy] + ["CPU offload"] * t.fsdp_cpu_offload + [f"LoRA rank {t.lora.rank}"] * bool(t.lora.rank)
    return "torch" if parts == ["ddp"] else f"torch ({', '.join(parts)})"


def stage_layers(num_layers: int, pipeline_parallel: int, megatron: Optional[Dict] = None) -> List[int]:
    """Decoder layers per pipeline stage, as Megatron splits them: evenly, or the first / last stage's
    from ``trainer.megatron`` and the rest evenly over the middle stages (rounded down)."""
    pp, m = pipeline_parallel, megatron or {}
    if pp <= 1:
        return [num_layers]
    first, last = m.get("num_layers_in_first_pipeline_stage"), m.get("num_layers_in_last_pipeline_stage")
    middle = pp - (first is not None) - (last is not None)
    each = (num_layers - (first or 0) - (last or 0)) // middle if middle > 0 else 0
    stages = [each] * pp
    if first is not None:
        stages[0] = first
    if last is not None:
        stages[-1] = last
    return stages


def megatron_trainer_memory(cfg: "RunConfig", plan: "Plan") -> TrainerMemory:
    """A Megatron-core trainer (docs/memory.md)."""
    a, p, t = cfg.model.arch, cfg.parallelism, cfg.trainer
    n = param_count(a)
    tp, pp, cp, ep = p.tensor_parallel, p.pipeline_parallel, p.context_parallel, p.expert_parallel
    etp = p.expert_tensor_parallel or tp
    stages = stage_layers(a.num_layers, pp, t.megatron)
    most, n_moe = max(stages), moe_layers(a)
    vocab = a.vocab_size * a.hidden_size
    outside = vocab + n.lm_head + a.hidden_size  # embedding, output layer, final norm
    layers_dense = n.dense - outside
    dense = (n.dense if pp == 1 else layers_dense * most / a.num_layers + vocab + a.hidden_size) / tp
    experts = n.experts * (min(most, n_moe) / n_moe if n_moe else 0) / (ep * etp)
    sharded = t.use_distributed_optimizer  # over data x context parallel ranks
    dp_dense = max(1, p.trainer_gpus // (tp * pp)) if sharded else 1
    dp_experts = max(1, p.trainer_gpus // (ep * etp * pp)) if sharded else 1
    compute = dtype_bytes(cfg.model.dtype)
    critic = (n.total - n.lm_head) / n.total if cfg.algo.advantage_estimator == "ppo" else 0.0
    mb = micro_batch_shape(cfg, plan.data_parallel)
    budget = t.max_tokens_per_micro_batch
    if budget is not None:  # packed: the full-length samples the budget holds, up to the rank's step
        mb = MicroBatchShape(min(rank_step_samples(cfg, plan.data_parallel),
                                 max(1, budget // max(1, mb.prompt_len + mb.response_len))),
                             mb.prompt_len, mb.response_len)
    mb = MicroBatchShape(mb.samples, mb.prompt_len // cp, mb.response_len // cp)  # CP splits every sequence
    acts = activation_bytes(a, mb, compute_bytes=compute, autocast=True, residual_bytes=compute,
                            checkpointing=t.recompute != "none", tensor_parallel=tp,
                            sequence_parallel=p.sequence_parallel, layers_held=pp * stages[0] / a.num_layers,
                            vocab_parallel_head=True, compiled=t.compile and tp == 1)  # compiled tables: TP 1 only
    state = {"weights": compute * (dense + experts), "grads": 4 * (dense + experts),
             "adam": 12 * (dense / dp_dense + experts / dp_experts)}
    host = {}
    if p.colocate and p.offload_train and p.device == "cuda":
        host["offloaded_state"] = (1 + critic) * (state["weights"] + state["adam"])  # gradients are freed
    if sharded and p.device == "cuda" and saves(cfg):  # a save gathers the sharded optimizer state in host memory
        host["checkpoint_gather"] = (1 + critic) * state["adam"]
    if cfg.algo.kl_coef or cfg.algo.kl_loss_coef:
        host["reference_copy"] = 2 * state["weights"]  # the reference's shards and a staging copy
    return TrainerMemory(gpu={**state, "critic": critic * sum(state.values()),
                              "activations": acts["layers"] + acts["logits"]},
                         offloaded=("weights", "grads", "adam", "critic"), host=host, micro_batch=mb)


def teacher_memory(cfg: "RunConfig", plan: "Plan") -> Dict[str, float]:
    """On-policy distillation's teacher on every trainer GPU: its weights in ``teacher.dtype`` (kept there, not
    offloaded) and one no-grad micro-batch forward (the logits, the float32 log-softmax of a chunk of response rows
    and an MLP's width); none without a teacher or a known shape (``teacher.arch``; the rules ask for it on GPUs)."""
    a = cfg.teacher.arch
    if cfg.algo.advantage_estimator != "opd" or not a.num_layers:
        return {}
    elem, mb = dtype_bytes(cfg.teacher.dtype), micro_batch_shape(cfg, plan.data_parallel)
    forward = (mb.positions * elem * (a.vocab_size + 2 * a.intermediate_size)
               + 8 * min(LOGPROB_CHUNK, mb.response_tokens) * a.vocab_size)
    return {"teacher": elem * param_count(a).total, "teacher_forward": forward}


# trainer.backend -> its memory per GPU; a new backend adds its function here
TRAINER_MEMORY: Dict[str, Callable[["RunConfig", "Plan"], TrainerMemory]] = {"torch": torch_trainer_memory,
                                                                            "megatron": megatron_trainer_memory}


def kv_bytes_per_token(a: "ArchConfig", elem_bytes: float, *, sglang: bool, tp: int = 1) -> float:
    """KV cache bytes of one token on one GPU: SGLang keeps MLA's latent and splits heads over its TP ranks;
    Hugging Face's cache (the embedded engine) keeps MLA's full per-head keys and values."""
    if is_mla(a):
        width = (a.kv_lora_rank + a.qk_rope_head_dim) if sglang else \
            a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)
        return a.num_layers * width * elem_bytes
    heads = max(1, a.num_kv_heads // tp) if sglang else a.num_kv_heads
    return 2 * a.num_layers * heads * head_dim(a) * elem_bytes


def mem_fraction_static(cfg: "RunConfig") -> Optional[float]:
    """``rollout.server_args.mem_fraction_static`` (the default when unset); None when it is not a number."""
    value = (cfg.rollout.server_args or {}).get("mem_fraction_static")
    if value is None:
        return SGLANG_MEM_FRACTION_DEFAULT
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def engine_memory(cfg: "RunConfig", gpu_bytes: float) -> Tuple[Dict[str, float], Optional[int]]:
    """(bytes per engine GPU by part, tokens SGLang's KV pool holds per engine, or None)."""
    a, r, p = cfg.model.arch, cfg.rollout, cfg.parallelism
    sa = r.server_args or {}
    dtype = str(sa.get("dtype")) if sa.get("dtype") not in (None, "auto") else cfg.model.dtype
    elem = DTYPE_BYTES.get(dtype, 2)
    weights = param_count(a).total * elem / p.gpus_per_engine
    kv_elem = KV_CACHE_DTYPE_BYTES.get(str(sa.get("kv_cache_dtype")), elem)
    if r.engine == "sglang":
        pool = max(0.0, (mem_fraction_static(cfg) or SGLANG_MEM_FRACTION_DEFAULT) * gpu_bytes - weights)
        return {"weights": weights, "kv_cache": pool}, int(pool / kv_bytes_per_token(a, kv_elem, sglang=True,
                                                                                    tp=p.gpus_per_engine))
    seq = (r.max_prompt_len or 0) + r.max_response_len
    kv = r.embedded_max_batch * seq * kv_bytes_per_token(a, kv_elem, sglang=False)
    return {"weights": weights, "kv_cache": kv, "logits": r.embedded_max_batch * a.vocab_size * 4}, None


@dataclass
class MemoryEstimate:
    """GiB per GPU: what the trainer and the engine each hold on one of their GPUs, and the peak of each kind
    of GPU (colocated: in each phase)."""

    backend: str
    engine_kind: str
    gpu_memory_gib: float
    trainer: Dict[str, float]
    engine: Dict[str, float]
    gpus: Dict[str, float]  # "trainer GPU", "engine GPU" or "colocated GPU, training", "colocated GPU, rollout"
    kv_cache_tokens: Optional[int] = None  # SGLang: tokens its KV pool holds per engine
    host_per_node: Dict[str, float] = field(default_factory=dict)  # GiB of host memory the trainers pin
    micro_batch: Optional[MicroBatchShape] = None
    notes: List[str] = field(default_factory=list)
    checkpoint: Dict[str, float] = field(default_factory=dict)  # GiB one run checkpoint writes, by part
    keep_checkpoints: int = 1

    @property
    def trainer_total(self) -> float:
        return sum(self.trainer.values())

    @property
    def engine_total(self) -> float:
        return sum(self.engine.values())

    @property
    def peak(self) -> float:
        return max(self.gpus.values())

    def describe(self) -> str:
        mb = self.micro_batch
        shape = f"; micro-batch {mb.samples} x {mb.prompt_len + mb.response_len} tokens" if mb else ""
        kv = f" (~{self.kv_cache_tokens:,} tokens of KV cache per engine)" if self.kv_cache_tokens is not None else ""
        lines = [f"Memory estimate, GiB per GPU ({self.backend} trainer{shape}; a GPU has {self.gpu_memory_gib:g})",
                 f"  trainer: {self.trainer_total:.1f} = {_parts(self.trainer)}"]
        if self.engine:
            lines.append(f"  {self.engine_kind} engine: {self.engine_total:.1f} = {_parts(self.engine)}{kv}")
        for k, v in self.gpus.items():
            lines.append(f"  {k}: {v:.1f}" + ("  DOES NOT FIT" if v > self.gpu_memory_gib else ""))
        if host := self.host_per_node:
            lines.append(f"  host memory per node: {sum(host.values()):.1f} = {_parts(host)}")
        if self.checkpoint:
            lines.append(f"  a run checkpoint on disk: {sum(self.checkpoint.values()):.1f} = {_parts(self.checkpoint)} "
                         f"(the newest {self.keep_checkpoints} kept, one more while the next is written)")
        lines += [f"  {n}" for n in self.notes]
        return "\n".join(lines)


def _parts(d: Dict[str, float]) -> str:
    return ", ".join(f"{PART_NAMES.get(k, k.replace('_', ' '))} {v:.1f}" for k, v in d.items() if v)


def estimate(cfg: "RunConfig", plan: "Plan", gpu_memory_gib: Optional[float] = None) -> MemoryEstimate:
    """Memory per GPU of ``cfg`` (resolved) laid out by ``plan`` (docs/memory.md), on GPUs of
    ``gpu_memory_gib`` (default ``parallelism.gpu_memory_gib``)."""
    p = cfg.parallelism
    gpu_gib = p.gpu_memory_gib if gpu_memory_gib is None else gpu_memory_gib
    backend = cfg.trainer.backend
    if backend not in TRAINER_MEMORY:
        raise ValueError(f"trainer.backend: no memory estimate for {backend!r} (known: {', '.join(TRAINER_MEMORY)}); "
                         "add its function to slime_hydra.plan.memory.TRAINER_MEMORY")
    tm = TRAINER_MEMORY[backend](cfg, plan)
    trainer = {k: v / GIB for k, v in {**tm.gpu, **teacher_memory(cfg, plan)}.items()}
    eng, kv_tokens = engine_memory(cfg, gpu_gib * GIB) if plan.engines else ({}, None)  # algo=sft: maybe none
    engine = {k: v / GIB for k, v in eng.items()}
    train_total, engine_total = sum(trainer.values()), sum(engine.values())
    if plan.colocate:
        state = sum(v for k, v in trainer.items() if k not in TRANSIENT and not (p.offload_train and k in tm.offloaded))
        gpus = {"colocated GPU, training": train_total + (0.0 if p.offload_rollout else engine_total),
                "colocated GPU, rollout": engine_total + state}
        if p.offload_train and p.push_before_offload:  # the trainer's weights stay for the push, beside the engine's
            kept = state + trainer.get("weights", 0.0)
            engine_now = engine.get("weights", 0.0) if p.offload_rollout else engine_total
            gpus[PUSH_PHASE] = kept + engine_now + 2 * cfg.sync.bucket_mb / 1024
    else:
        gpus = {"trainer GPU": train_total, **({"engine GPU": engine_total} if engine else {})}
    ranks_per_node = min(p.trainer_gpus, p.gpus_per_node)
    label = torch_trainer_label(cfg) if backend == "torch" else backend
    est = MemoryEstimate(backend=label, engine_kind=cfg.rollout.engine, gpu_memory_gib=gpu_gib,
                         trainer=trainer, engine=engine, gpus=gpus, kv_cache_tokens=kv_tokens,
                         host_per_node={k: ranks_per_node * v / GIB for k, v in tm.host.items()},
                         micro_batch=tm.micro_batch or micro_batch_shape(cfg, plan.data_parallel),
                         checkpoint={k: v / GIB for k, v in checkpoint_bytes(cfg).items()} if saves(cfg) else {},
                         keep_checkpoints=cfg.trainer.keep_checkpoints)
    if resident(cfg):
        est.notes.append("(trainer.mode=async: the next rollout generates while the trainer trains, so the training "
                         "phase, the trainer beside the engine's weights and KV cache, is the colocated GPU's peak)")
    if cfg.rollout.max_prompt_len is None:
        est.notes.append("(prompts count as 0 tokens: rollout.max_prompt_len is unset)")
    if cfg.rollout.engine == "sglang" and mem_fraction_static(cfg) is None:
        est.notes.append(f"(rollout.server_args.mem_fraction_static is not a number: the engine counts "
                         f"{SGLANG_MEM_FRACTION_DEFAULT:g})")
    return est


def checkpoint_bytes(cfg: "RunConfig") -> Dict[str, float]:
    """Bytes one run checkpoint writes, all ranks together, by part: ``hf/`` (LoRA: if ``save_merged``), the
    optimizer (float32 master weights and Adam's moments), megatron's weights, the reference, a critic."""
    t, pc = cfg.trainer, param_count(cfg.model.arch)
    n, compute, lora = pc.total, dtype_bytes(cfg.model.dtype), t.lora.rank > 0
    trains = lora_params(cfg) if lora else n
    kl = bool(cfg.algo.kl_coef or cfg.algo.kl_loss_coef) and not lora
    return {"hf": compute * n if not lora or t.lora.save_merged else 0.0,
            "optimizer": 12.0 * trains,
            "weights": compute * n if t.backend == "megatron" else 0.0,
            "reference": (compute if t.backend == "megatron" else 4) * n if kl else 0.0,
            "critic": (compute + 12.0) * (n - pc.lm_head) if cfg.algo.advantage_estimator == "ppo" else 0.0}


def saves(cfg: "RunConfig") -> bool:
    """Whether the run writes a checkpoint (``trainer.save_last`` or ``save_interval``)."""
    t = cfg.trainer
    return t.save_last or (t.save_interval > 0 and (t.num_rollout is None or t.save_interval <= t.num_rollout))


def machine_problems(plan: "Plan", host_gib: Optional[float], disk_free_gib: float) -> Tuple[List[str], List[str]]:
    """(problems, warnings) of a run about to start here: the trainers' host memory against ``host_gib`` (None:
    not checked) and a run checkpoint against the free disk of the run directory."""
    est, problems, warnings = plan.memory, [], []
    ckpt = sum(est.checkpoint.values())
    if ckpt > disk_free_gib:
        problems.append(f"output_dir: a run checkpoint is ~{ckpt:.0f} GiB ({_parts(est.checkpoint)}) and the run "
                        f"directory's disk has {disk_free_gib:.0f} GiB free: free space, put the run directory "
                        "(hydra.run.dir) on a larger disk, or save nothing (trainer.save_last=false "
                        "trainer.save_interval=0)")
    elif ckpt * (est.keep_checkpoints + 1) > disk_free_gib:
        warnings.append(f"a run checkpoint is ~{ckpt:.0f} GiB and the run directory's disk has {disk_free_gib:.0f} "
                        f"GiB free: fewer than trainer.keep_checkpoints={est.keep_checkpoints} plus the one being "
                        "written fit")
    host = sum(est.host_per_node.values())
    if host_gib and host > HOST_WARN * host_gib:
        hint = ("; trainer.use_distributed_optimizer=false saves without the gather (one data-parallel rank: it "
                "shards nothing)" if est.host_per_node.get("checkpoint_gather") and plan.data_parallel <= 1 else
                "; parallelism.offload_train=false keeps the trainer's state on the GPU, where it fits")
        what = (f"the trainers need ~{host:.0f} GiB of host memory per node ({_parts(est.host_per_node)}), "
                f"{host / host_gib:.0%} of this machine's {host_gib:.0f} GiB")
        if host > HOST_REFUSE * host_gib:
            problems.append(f"parallelism: {what} (more than {HOST_REFUSE:.0%}){hint}")
        else:
            warnings.append(f"{what}: with the processes' own memory, a save may pass Ray's memory monitor's limit "
                            f"(95%){hint}")
    return problems, warnings


def memory_problems(cfg: "RunConfig", plan: "Plan", gpu_memory_gib: float) -> List[str]:
    """Why ``cfg`` cannot fit on GPUs of ``gpu_memory_gib`` GiB, with the numbers; empty when it fits (or on CPU)."""
    if cfg.parallelism.device != "cuda":
        return []
    if gpu_memory_gib <= 0:
        return [f"parallelism.gpu_memory_gib: must be > 0, got {gpu_memory_gib:g}"]
    est, out = estimate(cfg, plan, gpu_memory_gib), []
    limit = f"> parallelism.gpu_memory_gib={gpu_memory_gib:g}"
    eng = f"{est.engine_kind} engine {est.engine_total:.1f}"
    for where, need in est.gpus.items():
        if need <= gpu_memory_gib:
            continue
        if where in ("trainer GPU", "colocated GPU, training"):
            with_engine = need > est.trainer_total + 1e-9  # colocated, the engine keeps its memory
            hint = _room_hint(cfg, est, est.trainer_total, "offload_rollout") \
                if with_engine and est.trainer_total <= gpu_memory_gib else _trainer_hint(cfg, est)
            hint += _fsdp_lora_hint(cfg, plan, gpu_memory_gib)
            out.append(f"parallelism: {where} needs ~{need:.0f} GiB (trainer: {_parts(est.trainer)}"
                       f"{f'; {eng}' if with_engine else ''}) {limit}{hint}")
        else:
            rest = need - est.engine_total
            held = f"; trainer state left on the GPU {rest:.1f}" if rest > 1e-9 else ""
            hint = _room_hint(cfg, est, rest, "offload_train") if rest > 1e-9 else ""
            out.append(f"parallelism: {where} needs ~{need:.0f} GiB ({est.engine_kind} engine: "
                       f"{_parts(est.engine)}{held}) {limit}{hint}")
    if cfg.rollout.engine == "sglang" and est.engine:
        frac, e = mem_fraction_static(cfg), est.engine
        seq = (cfg.rollout.max_prompt_len or 0) + cfg.rollout.max_response_len
        if frac is None:
            out.append(f"rollout.server_args.mem_fraction_static: "
                       f"{cfg.rollout.server_args['mem_fraction_static']!r} is not a number")
        elif e["kv_cache"] <= 0:
            out.append(f"rollout.server_args.mem_fraction_static: the engine's weights take {e['weights']:.1f} GiB "
                       f"per GPU, more than {frac:g} x {gpu_memory_gib:g} GiB leaves for weights and KV cache; raise "
                       "parallelism.gpus_per_engine")
        elif est.kv_cache_tokens is not None and est.kv_cache_tokens < seq:
            out.append(f"rollout.server_args.mem_fraction_static: the KV cache holds ~{est.kv_cache_tokens} tokens "
                       f"per engine ({e['kv_cache']:.1f} GiB per GPU), less than one sequence of {seq} tokens; "
                       "raise it or parallelism.gpus_per_engine")
    return out


def _trainer_hint(cfg: "RunConfig", est: MemoryEstimate) -> str:
    """What would shrink the trainer the most."""
    state = sum(v for k, v in est.trainer.items() if k not in TRANSIENT)
    if state > est.gpu_memory_gib:
        where = ("the torch backend with DDP replicates them on every GPU" if cfg.trainer.backend == "torch" and
                 cfg.trainer.strategy == "ddp" and not cfg.trainer.lora.rank else
                 "a sharding backend (megatron) or more GPUs to shard over are needed"
                 if cfg.trainer.backend == "torch" else
                 "shard them further: tensor, pipeline or expert parallel, or trainer.use_distributed_optimizer=true"
                 if not cfg.trainer.use_distributed_optimizer else
                 "shard them further: tensor, pipeline or expert parallel")
        what = ("the weights, gradients, optimizer state and reference weights" if est.trainer.get("reference")
                else "the weights, gradients and optimizer state")
        return f"; {what} alone take {state:.0f} GiB ({where})"
    mb, tips = est.micro_batch, []
    if cfg.trainer.backend == "megatron":
        t, p = cfg.trainer, cfg.parallelism
        if mb is not None and mb.samples > 1:
            tips.append(f"lower trainer.max_tokens_per_micro_batch (now {t.max_tokens_per_micro_batch}: "
                        f"{mb.samples} samples of up to {mb.prompt_len + mb.response_len} tokens)")
        if t.recompute != "full":
            tips.append("set trainer.recompute=full")
        if p.tensor_parallel > 1 and not p.sequence_parallel:
            tips.append("set parallelism.sequence_parallel=true")
        return "; " + (" or ".join(tips) if tips else "raise parallelism.tensor_parallel or shorten "
                                                      "rollout.max_response_len")
    if mb is not None and mb.samples > 1:
        tips.append(f"lower trainer.micro_batch_size (now {mb.samples} samples of up to "
                    f"{mb.prompt_len + mb.response_len} tokens)")
    if not cfg.trainer.gradient_checkpointing:
        tips.append("set trainer.gradient_checkpointing=true")
    return "; " + (" or ".join(tips) if tips else "shorten rollout.max_response_len")


def _fsdp_lora_hint(cfg: "RunConfig", plan: "Plan", gpu_memory_gib: float) -> str:
    """A full-weight DDP trainer that does not fit: which of FSDP2 and LoRA would (re-estimated with each)."""
    t = cfg.trainer
    if t.backend != "torch" or t.strategy != "ddp" or t.lora.rank:
        return ""
    lora = f"trainer.lora.rank={FSDP_LORA_RANK}"
    tries = {"trainer.strategy=fsdp": {"strategy": "fsdp"},
             lora: {"lora": replace(t.lora, rank=FSDP_LORA_RANK)},
             f"trainer.strategy=fsdp {lora}": {"strategy": "fsdp", "lora": replace(t.lora, rank=FSDP_LORA_RANK)},
             "trainer.strategy=fsdp trainer.fsdp_cpu_offload=true": {"strategy": "fsdp", "fsdp_cpu_offload": True}}
    if plan.data_parallel < 2:  # FSDP2 on one GPU shards nothing; its CPU offload still helps
        tries.pop("trainer.strategy=fsdp")
    peaks = {}
    for name, change in tries.items():
        alt = replace(cfg, trainer=replace(t, **change))
        try:
            peaks[name] = (estimate(alt, plan, gpu_memory_gib).trainer_total,
                           not memory_problems(alt, plan, gpu_memory_gib))
        except (ArithmeticError, ValueError):
            continue
    fits = [f"{k} (trainer ~{v:.0f} GiB)" for k, (v, ok) in peaks.items() if ok]
    if fits:
        return f"; these would fit: {', '.join(fits)}"
    own = estimate(cfg, plan, gpu_memory_gib).trainer
    if not peaks or sum(v for k, v in own.items() if k not in TRANSIENT) <= gpu_memory_gib:
        return ""  # the activations are what does not fit: the tips before this one are the way
    tried = ", ".join(f"{k}: trainer ~{v:.0f} GiB" for k, (v, _) in peaks.items())
    return f"; neither FSDP2 nor LoRA would fit either ({tried})"


def _room_hint(cfg: "RunConfig", est: MemoryEstimate, trainer_gib: float, offload_key: str) -> str:
    """Colocated: how to leave ``trainer_gib`` of the GPU to the trainer beside the engine."""
    why = {"offload_rollout": "the engine releases its memory while the trainer trains",
           "offload_train": "the trainer's state goes to the host while the engines generate"}[offload_key]
    tips = [f"set trainer.mode=sync (async trains while the next rollout generates, so nothing can be offloaded; "
            f"sync may set parallelism.{offload_key}=true: {why})" if resident(cfg) else
            f"set parallelism.{offload_key}=true ({why})"]
    gpu = est.gpu_memory_gib
    if cfg.rollout.engine == "sglang":
        frac = math.floor(100 * (gpu - trainer_gib) / gpu) / 100  # what the engine may take, rounded down
        if frac * gpu > est.engine["weights"] and mem_fraction_static(cfg) is not None:
            tips.append(f"lower rollout.server_args.mem_fraction_static to at most {frac:.2f} (now "
                        f"{mem_fraction_static(cfg):g}; the trainer needs {trainer_gib:.1f} GiB beside the engine)")
    else:
        tips.append(f"lower rollout.embedded_max_batch (now {cfg.rollout.embedded_max_batch})")
    return "; " + " or ".join(tips)


def resident(cfg: "RunConfig") -> bool:
    """Async on colocated GPUs: the next rollout generates while the trainer trains, so nothing is offloaded."""
    return cfg.trainer.mode == "async" and cfg.parallelism.colocate


def colocated_peaks(cfg: "RunConfig", plan: "Plan") -> Dict[Tuple[bool, bool], float]:
    """The peak GiB of a colocated GPU for each (offload_train, offload_rollout) of ``OFFLOAD_CHOICES``."""
    return {(train, rollout): estimate(replace(cfg, parallelism=replace(
        cfg.parallelism, offload_train=train, offload_rollout=rollout)), plan).peak
        for train, rollout in OFFLOAD_CHOICES}


def kv_cache_hint(cfg: "RunConfig", plan: "Plan") -> Optional[str]:
    """Colocated SGLang whose KV pool, far larger than the run fills, sends the trainer's state to the host:
    the ``mem_fraction_static`` that keeps it on the GPU. None with unbounded prompts or when that does not help."""
    p, r = cfg.parallelism, cfg.rollout
    if r.engine != "sglang" or not p.colocate or not p.offload_train or r.max_prompt_len is None \
            or plan.engine_batch is None or mem_fraction_static(cfg) is None:
        return None
    gpu = p.gpu_memory_gib * GIB
    eng, tokens = engine_memory(cfg, gpu)
    if not tokens:
        return None
    need = plan.engine_batch * (r.max_prompt_len + r.max_response_len)
    frac = math.ceil((eng["weights"] + KV_MARGIN * need * eng["kv_cache"] / tokens) / gpu * 100) / 100
    if frac >= mem_fraction_static(cfg):
        return None
    alt = replace(cfg, rollout=replace(r, server_args={**(r.server_args or {}), "mem_fraction_static": frac}),
                  parallelism=replace(p, offload_train=False))
    if estimate(alt, plan).peak > (1 - AUTO_OFFLOAD_HEADROOM) * p.gpu_memory_gib:
        return None
    return (f"the KV cache holds ~{tokens:,} tokens per engine and a rollout keeps at most {need:,} in flight: "
            f"rollout.server_args.mem_fraction_static={frac:g} ({KV_MARGIN:g}x that) fits with "
            "parallelism.offload_train=false, and the trainer's state stays on the GPU")


def offload_summary(cfg: "RunConfig", plan: "Plan") -> str:
    """One line for ``dry_run``: the colocated GPU's peak for each offload, and the rule of the default."""
    names = {(False, False): "none", (False, True): "engine", (True, False): "trainer", (True, True): "both"}
    peaks = ", ".join(f"{names[c]} {v:.1f}" for c, v in colocated_peaks(cfg, plan).items())
    gpu = cfg.parallelism.gpu_memory_gib
    if resident(cfg):
        return (f"peak by what is offloaded: {peaks}; trainer.mode=async offloads nothing (the rollout runs while "
                "the trainer trains); the others are for trainer.mode=sync")
    return (f"peak by what is offloaded: {peaks}; unset parallelism.offload_train / offload_rollout take the "
            f"least offload within {(1 - AUTO_OFFLOAD_HEADROOM) * gpu:g} GiB ({1 - AUTO_OFFLOAD_HEADROOM:.0%})")
