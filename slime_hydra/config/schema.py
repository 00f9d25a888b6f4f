"""Typed schemas for every config group.

Each dataclass here is the schema of one Hydra config group (``conf/<group>/*.yaml``) and is
registered in Hydra's ConfigStore by :mod:`slime_hydra.config.store`. Because the root config is a
structured ``RunConfig``, a misspelt key anywhere (a YAML file or a command-line override) fails at
compose time with its dotted path. Cross-field rules live beside the code they guard
(``slime_hydra/*/rules.py``), collected by :mod:`slime_hydra.launch.validate`.

Conventions: ``None`` means "derived" (filled in by ``resolve.resolve``), ``???`` in YAML means
"required". This module imports nothing heavy, so ``dry_run=true`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

# --------------------------------------------------------------------------------------- model
# the transformers model types whose config fields checkpoint.hf.hf_config_kwargs knows how to fill
ARCH_TYPES = ("qwen3", "qwen3_moe", "qwen2", "glm4", "llama", "deepseek_v3")


@dataclass
class ArchConfig:
    """The model's shape, in Hugging Face terms (the fields of its ``config.json``)."""

    type: str = "qwen3"  # HF model_type, one of ARCH_TYPES
    vocab_size: int = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING
    head_dim: Optional[int] = None  # None: hidden_size // num_heads
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rope_scaling: Optional[Dict[str, Any]] = None  # HF rope_scaling {rope_type: llama3 | yarn, factor, ...}; None: none
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Mixture of experts (0 experts: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: Optional[int] = None
    num_shared_experts: int = 0
    first_k_dense_layers: int = 0
    norm_topk_prob: Optional[bool] = None  # renormalise the top-k router weights; None: the HF class default
    n_group: Optional[int] = None  # DeepSeek-V3 group-limited routing: expert groups; None: the HF default
    topk_group: Optional[int] = None  # DeepSeek-V3: groups each token may route to; None: the HF default
    routed_scaling_factor: Optional[float] = None  # DeepSeek-V3: routed experts' output scale; None: HF default
    # Multi-head latent attention (DeepSeek-V3)
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None


@dataclass
class ModelConfig:
    name: str = MISSING
    # A local Hugging Face checkpoint directory or a hub id. None: build the model from ``arch``
    # with random weights (the embedded default's tiny model).
    path: Optional[str] = None
    # Tokenizer: None -> same as ``path``; "builtin:digits" -> the in-code tokenizer of the built-in tasks.
    tokenizer: Optional[str] = None
    arch: ArchConfig = field(default_factory=ArchConfig)
    dtype: str = "float32"  # trainer parameter dtype: float32 | bfloat16
    trust_remote_code: bool = False
    init_seed: int = 0  # seed of the random initialisation when ``path`` is None


# ---------------------------------------------------------------------------------------- algo
@dataclass
class AlgoConfig:
    """The RL algorithm: advantage estimator, policy loss and its terms, and the optimiser."""

    name: str = MISSING
    advantage_estimator: str = "grpo"  # a key of slime_hydra.train.algorithms.ADVANTAGE_ESTIMATORS
    policy_loss: str = "ppo_clip"  # a key of slime_hydra.train.algorithms.POLICY_LOSSES
    # Reward post-processing (in the rollout manager): subtract the group mean, divide by its std.
    normalize_rewards: bool = True
    normalize_std: bool = True
    # DAPO's dynamic sampling: train only on groups whose rewards differ (the rollout manager uses
    # slime_hydra.rollout.filters.nonzero_reward_std unless rollout.dynamic_filter names another).
    dynamic_sampling: bool = False
    # Clipping
    eps_clip: float = 0.2
    eps_clip_high: Optional[float] = None  # None: eps_clip
    eps_clip_c: Optional[float] = None  # dual clip (> 1), None: off
    # Loss terms
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0  # KL(policy || reference) as a loss term
    kl_loss_type: str = "low_var_kl"  # k1 | k2 | k3 | low_var_kl; also the estimator of the kl_coef reward (as slime)
    use_unbiased_kl: bool = False
    kl_coef: float = 0.0  # KL as reward shaping (ppo, reinforce_plus_plus*)
    loss_reduction: str = "sample_mean"  # sample_mean (per-sample token mean) | token_mean | token_sum
    normalize_advantages: bool = False  # masked whitening over the rollout batch (required by reinforce_plus_plus*)
    # Off-policy corrections
    use_rollout_logprobs: bool = False  # rollout log-probs are the old policy (no recompute)
    use_tis: bool = False  # truncated importance sampling rollout -> trainer
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    # PPO (advantage_estimator=ppo trains a critic); gamma is also REINFORCE++'s discount
    gamma: float = 1.0
    lambd: float = 1.0
    value_clip: float = 0.2
    critic_lr: Optional[float] = None  # None: lr
    num_critic_only_steps: int = 0  # rollouts that train only the critic before the actor starts
    # Optimiser
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay: str = "constant"  # constant | cosine | linear
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


# ------------------------------------------------------------------------------------- rollout
@dataclass
class RouterConfig:
    enabled: bool = True  # route through a real sglang-router process
    policy: str = "cache_aware"  # round_robin | random | cache_aware | power_of_two
    request_timeout_secs: int = 14400
    args: Dict[str, Any] = field(default_factory=dict)  # extra sglang-router flags (without "--")


@dataclass
class RolloutConfig:
    engine: str = "embedded"  # embedded | sglang
    batch_size: int = 32  # prompts per rollout (slime: rollout_batch_size)
    n_samples_per_prompt: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_len: int = 1024
    max_prompt_len: Optional[int] = None  # longer prompts are filtered out at load time
    stop: List[str] = field(default_factory=list)
    stop_token_ids: List[int] = field(default_factory=list)
    skip_special_tokens: bool = True  # drop EOS and other special tokens from the response text
    seed: int = 42
    concurrency: int = 512  # in-flight /generate requests per engine
    # Hooks (Hydra ``_target_`` nodes or dotted paths); None: the built-in default.
    generate: Optional[Any] = None  # async generate(ctx, sample, sampling_params, evaluation) -> Sample
    dynamic_filter: Optional[Any] = None  # f(cfg, group) -> bool | DynamicFilterOutput; None: algo.dynamic_sampling
    rollout_function: Optional[Any] = None  # async f(ctx, rollout_id, weight_version) -> (groups, metrics)
    # prompts pulled per refill while too few groups pass; None: batch_size
    over_sampling_batch_size: Optional[int] = None
    max_sampled_groups: Optional[int] = None  # per rollout; then rejected groups fill the batch (None: no limit)
    partial_rollout: bool = False  # groups cut off when the batch is full are continued next rollout
    mask_offpolicy_in_partial_rollout: bool = False  # no loss on tokens made by older weights
    # Engine settings
    server_args: Dict[str, Any] = field(default_factory=dict)  # SGLang ServerArgs pass-through
    embedded_max_batch: int = 256  # embedded engine: most sequences decoded together
    startup_timeout_s: float = 600.0
    router: RouterConfig = field(default_factory=RouterConfig)
    # Fault tolerance (slime's --use-fault-tolerance): while a rollout or eval runs, an engine whose
    # process exits or whose /health_generate does not answer within health_check_timeout_s is taken
    # out of the router and restarted; its requests go to the others. Off: an engine death stops the run.
    fault_tolerance: bool = False
    health_check_interval_s: float = 10.0
    health_check_timeout_s: float = 30.0
    max_engine_restarts_per_hour: int = 3  # per engine; one more is an error naming it


# --------------------------------------------------------------------------------- parallelism
@dataclass
class ParallelismConfig:
    """Where things run. "gpus" means accelerator slots; with device=cpu they are CPU slots."""

    name: str = MISSING
    device: str = "cpu"  # cpu | cuda
    num_nodes: int = 1
    gpus_per_node: int = 8
    trainer_gpus: int = 1  # total trainer slots (data x tensor x pipeline x context parallel)
    rollout_gpus: Optional[int] = None  # None: = trainer_gpus when colocated
    gpus_per_engine: int = 1
    colocate: bool = False  # trainers and engines share slots, taking turns on memory
    offload_train: Optional[bool] = None  # None: = colocate
    offload_rollout: Optional[bool] = None  # None: = colocate
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: Optional[int] = None  # megatron: TP size inside the experts; None: tensor_parallel
    virtual_pipeline_parallel: Optional[int] = None  # megatron: model chunks per pipeline rank (interleaved)
    sequence_parallel: bool = False
    gpu_memory_gib: float = 140.0  # one accelerator, for the memory estimate (H200: 143,771 MiB = 140.4 GiB)
    # torch threads per process on CPU: processes share the cores, and OpenMP threads that
    # outnumber them spin against each other (measured: 25 ms -> 1.1 s for one engine batch).
    cpu_threads: int = 1


# ---------------------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    name: str = MISSING
    source: str = "builtin"  # builtin | jsonl (jsonl also reads .parquet)
    # builtin
    task: str = "max_digit"
    num_train: int = 9000
    num_eval: int = 256
    # files
    path: Optional[str] = None  # path, optionally with a row slice: data.jsonl@[0:1000]
    input_key: str = "prompt"
    label_key: Optional[str] = "label"
    metadata_key: Optional[str] = "metadata"
    tools_key: Optional[str] = "tools"
    apply_chat_template: bool = False
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    system_prompt: Optional[str] = None
    shuffle: bool = True
    seed: int = 1234
    num_epoch: Optional[int] = None  # alternative to trainer.num_rollout
    buffer_filter: Optional[Any] = None  # f(buffer, n) -> list[list[Sample]], popping what it returns


# -------------------------------------------------------------------------------------- reward
@dataclass
class RewardConfig:
    type: str = "exact"  # a key of slime_hydra.rewards.REWARD_TYPES
    custom: Optional[Any] = None  # ``_target_`` node or dotted path for type=custom
    group: bool = False  # custom reward is called per group (list of samples)
    key: Optional[str] = None  # pick this field when the reward is a dict
    url: Optional[str] = None  # type=remote
    timeout_s: float = 30.0
    max_retries: int = 5


# ---------------------------------------------------------------------------------------- eval
@dataclass
class EvalDatasetConfig:
    name: str = MISSING
    path: Optional[str] = None  # None: the built-in task's held-out split
    input_key: Optional[str] = None  # None: data.input_key
    label_key: Optional[str] = None
    reward: Optional[str] = None  # reward type; None: reward.type
    n_samples_per_prompt: int = 1
    temperature: float = 0.0  # greedy by default
    top_p: float = 1.0
    max_response_len: Optional[int] = None  # None: rollout.max_response_len
    max_prompts: Optional[int] = None


@dataclass
class EvalConfig:
    interval: int = 10  # every N rollouts; 0: only before and after training
    before_train: bool = True
    datasets: List[EvalDatasetConfig] = field(default_factory=list)


# ------------------------------------------------------------------------------------- trainer
@dataclass
class TrainerConfig:
    backend: str = "torch"  # torch
    num_rollout: Optional[int] = 100  # training steps (rollouts); None: from data.num_epoch
    global_batch_size: Optional[int] = None  # samples per optimiser step; None: one step per rollout
    num_steps_per_rollout: Optional[int] = None  # None: derived from global_batch_size
    micro_batch_size: int = 64
    gradient_checkpointing: bool = False
    mode: str = "sync"  # sync | async (one-step off-policy; requires colocate=false)
    update_weights_interval: int = 1
    # async: the most training steps a sample's weights may lag the trainer (trainer version minus
    # the sample's weight version, rollout/staleness_max); more stops the run
    max_staleness: int = 1
    save_interval: int = 50  # rollouts; the last step is always saved
    keep_checkpoints: int = 2
    resume: Optional[str] = None  # a checkpoint dir, a run dir, or "auto" (latest in this run dir)
    # megatron backend only (trainer=megatron):
    max_tokens_per_micro_batch: Optional[int] = None  # packed-token budget per micro-batch; None: micro_batch_size
    recompute: str = "none"  # activation recompute: none | selective | full
    use_distributed_optimizer: bool = True  # Adam state and main weights sharded over data-parallel ranks
    megatron: Dict[str, Any] = field(default_factory=dict)  # extra TransformerConfig fields, passed through


# ---------------------------------------------------------------------------------------- sync
@dataclass
class SyncConfig:
    transport: str = "auto"  # auto | distributed | tensor | disk
    bucket_mb: int = 512
    # fail a sync run when the mean |rollout - trainer| log-prob gap of a step exceeds this (stale or
    # corrupt weights on the engines). None: by model.dtype (config/resolve.py: 1e-3 for float32, where
    # gaps of ~1e-7 were measured; 0.05 for bf16/fp16, where 0.0065-0.0073 were measured on H200s); inf: off
    max_logprob_diff: Optional[float] = None


# ------------------------------------------------------------------------------------- logging
@dataclass
class LoggingConfig:
    level: str = "INFO"
    progress: bool = True
    wandb: bool = True
    wandb_mode: str = "auto"  # auto (online with an API key, else offline) | online | offline | disabled
    wandb_project: str = "slime_hydra"
    wandb_entity: Optional[str] = None
    wandb_tags: List[str] = field(default_factory=list)
    plot: bool = True
    log_samples: int = 2  # print this many sampled responses per eval


@dataclass
class ClusterConfig:
    address: Optional[str] = None  # join this Ray cluster ("auto" or host:port); None: start a local one
    num_cpus: Optional[int] = None  # local cluster only; None: what the plan needs
    include_dashboard: bool = False
    env_vars: Dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------- root
@dataclass
class RunConfig:
    model: ModelConfig = MISSING
    algo: AlgoConfig = MISSING
    rollout: RolloutConfig = MISSING
    parallelism: ParallelismConfig = MISSING
    data: DataConfig = MISSING
    trainer: TrainerConfig = MISSING
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    logging: LoggingConfig = MISSING
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    run_name: str = "run"
    seed: int = 1234
    dry_run: bool = False
    # Filled in at start-up: where this run writes (Hydra's run directory).
    output_dir: Optional[str] = None
