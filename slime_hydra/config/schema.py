"""The typed schema of every config group (``conf/<group>/*.yaml``), registered by :mod:`slime_hydra.config.store`:
a misspelt key fails at compose time with its dotted path. ``None`` means derived (``resolve.resolve``), ``???``
required. Each field's trailing comment (or the comment line right above it) is what ``describe`` prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

# the transformers model types whose config fields model.hf.hf_config_kwargs knows how to fill
ARCH_TYPES = ("qwen3", "qwen3_moe", "qwen2", "glm4", "llama", "deepseek_v3")


@dataclass
class ArchConfig:
    """The model's shape, in Hugging Face terms (the fields of its ``config.json``)."""

    type: str = "qwen3"  # HF model_type, one of ARCH_TYPES
    vocab_size: int = MISSING  # tokenizer vocabulary (rows of the embedding and the LM head)
    hidden_size: int = MISSING  # width of the residual stream
    intermediate_size: int = MISSING  # width of a dense MLP layer
    num_layers: int = MISSING  # transformer layers (HF num_hidden_layers)
    num_heads: int = MISSING  # attention (query) heads
    num_kv_heads: int = MISSING  # key/value heads (grouped-query attention; = num_heads: multi-head)
    head_dim: Optional[int] = None  # None: hidden_size // num_heads
    max_position_embeddings: int = 32768  # longest sequence the position encoding is set up for
    rope_theta: float = 1_000_000.0  # RoPE base frequency
    rope_scaling: Optional[Dict[str, Any]] = None  # HF rope_scaling {rope_type: llama3 | yarn, factor, ...}; None: none
    rms_norm_eps: float = 1e-6  # epsilon of the RMSNorm layers
    tie_word_embeddings: bool = False  # the LM head shares the input embedding's weights
    attention_bias: bool = False  # biases on the attention projections
    num_experts: int = 0  # mixture of experts: routed experts per MoE layer (0: a dense model)
    num_experts_per_tok: int = 0  # experts each token is routed to
    moe_intermediate_size: Optional[int] = None  # width of one expert's MLP
    num_shared_experts: int = 0  # always-active shared experts per MoE layer (deepseek_v3)
    first_k_dense_layers: int = 0  # leading layers with a dense MLP instead of experts (deepseek_v3)
    norm_topk_prob: Optional[bool] = None  # renormalise the top-k router weights; None: the HF class default
    n_group: Optional[int] = None  # DeepSeek-V3 group-limited routing: expert groups; None: the HF default
    topk_group: Optional[int] = None  # DeepSeek-V3: groups each token may route to; None: the HF default
    routed_scaling_factor: Optional[float] = None  # DeepSeek-V3: routed experts' output scale; None: HF default
    q_lora_rank: Optional[int] = None  # multi-head latent attention (DeepSeek-V3): rank of the query compression
    kv_lora_rank: Optional[int] = None  # MLA: rank of the joint key/value compression
    qk_nope_head_dim: Optional[int] = None  # MLA: per-head query/key dims without rotary encoding
    qk_rope_head_dim: Optional[int] = None  # MLA: per-head query/key dims with rotary encoding
    v_head_dim: Optional[int] = None  # MLA: per-head value dims


@dataclass
class ModelConfig:
    name: str = MISSING  # preset name, used in run_name (conf/model/<name>.yaml)
    path: Optional[str] = None  # a local HF checkpoint directory or a hub id; None: random weights of ``arch``
    tokenizer: Optional[str] = None  # None: ``path``'s; "builtin:digits" / "builtin:bytes": in-code (task / any text)
    arch: ArchConfig = field(default_factory=ArchConfig)  # the model's shape (HF config.json fields)
    dtype: str = "float32"  # trainer parameter dtype: float32 | bfloat16
    trust_remote_code: bool = False  # let transformers and SGLang run the checkpoint's own model code
    init_seed: int = 0  # seed of the random initialisation when ``path`` is None


# the shape of a model given by its checkpoint alone (a teacher without a preset): read from its config.json
NO_ARCH = ArchConfig(vocab_size=0, hidden_size=0, intermediate_size=0, num_layers=0, num_heads=0, num_kv_heads=0)


@dataclass
class AlgoConfig:
    """The RL algorithm: advantage estimator, policy loss and its terms, and the optimiser."""

    name: str = MISSING  # preset name, used in run_name (conf/algo/<name>.yaml)
    advantage_estimator: str = "grpo"  # a key of slime_hydra.train.algorithms.ADVANTAGE_ESTIMATORS
    policy_loss: str = "ppo_clip"  # a key of slime_hydra.train.algorithms.POLICY_LOSSES
    normalize_rewards: bool = True  # subtract each group's mean reward (in the rollout manager)
    normalize_std: bool = True  # also divide by the group's reward std (off by itself when n_samples_per_prompt=1)
    # DAPO dynamic sampling: train only on groups whose rewards differ (rollout.dynamic_filter, or nonzero_reward_std)
    dynamic_sampling: bool = False
    overlong_buffer_len: int = 0  # DAPO overlong shaping: tokens before the length limit where a penalty ramps (0: off)
    overlong_penalty_factor: float = 1.0  # reward lost at the length limit (linear over the buffer, before normalising)
    eps_clip: float = 0.2  # PPO ratio clip: [1 - eps_clip, 1 + eps_clip_high]
    eps_clip_high: Optional[float] = None  # None: eps_clip
    eps_clip_c: Optional[float] = None  # dual clip (> 1), None: off
    entropy_coef: float = 0.0  # weight of the entropy bonus in the policy loss
    kl_loss_coef: float = 0.0  # KL(policy || reference) as a loss term
    # k1 | k2 | k3 | low_var_kl; also the estimator of the kl_coef reward (as slime); k1 as a loss needs use_unbiased_kl
    kl_loss_type: str = "low_var_kl"
    use_unbiased_kl: bool = False  # KL loss times exp(log_probs - old_log_probs) (DeepSeek-V3.2)
    kl_coef: float = 0.0  # KL as reward shaping (ppo, reinforce_plus_plus*)
    loss_reduction: str = "sample_mean"  # sample_mean (per-sample token mean) | token_mean | token_sum
    normalize_advantages: bool = False  # masked whitening over the rollout batch (required by reinforce_plus_plus*)
    use_rollout_logprobs: bool = False  # rollout log-probs are the old policy (no recompute)
    use_tis: bool = False  # truncated importance sampling rollout -> trainer
    tis_clip: float = 2.0  # upper clamp of the TIS weight
    tis_clip_low: float = 0.0  # lower clamp of the TIS weight
    gamma: float = 1.0  # discount (PPO's GAE and REINFORCE++'s returns)
    lambd: float = 1.0  # GAE lambda (PPO)
    value_clip: float = 0.2  # clip range of the critic's value update (PPO)
    critic_lr: Optional[float] = None  # None: lr
    num_critic_only_steps: int = 0  # rollouts that train only the critic before the actor starts
    opd_reward_weight: float = 0.0  # algo=opd: weight of the group-normalised task reward added to -reverse KL
    lr: float = 1e-6  # peak learning rate of the policy
    min_lr: float = 0.0  # learning rate at the end of a cosine or linear decay
    lr_warmup_steps: int = 0  # linear warm-up, in optimiser steps
    lr_decay: str = "constant"  # constant | cosine | linear
    weight_decay: float = 0.0  # AdamW weight decay
    adam_beta1: float = 0.9  # Adam beta1
    adam_beta2: float = 0.98  # Adam beta2
    adam_eps: float = 1e-8  # Adam epsilon
    clip_grad: float = 1.0  # clip the gradient's global norm to this


@dataclass
class RouterConfig:
    enabled: bool = True  # route through a real sglang-router process
    # auto: cache_aware with several engines, round_robin with one | round_robin | random | cache_aware | power_of_two
    policy: str = "auto"
    request_timeout_secs: int = 14400  # the router's (and the client's) limit for one request
    args: Dict[str, Any] = field(default_factory=dict)  # extra sglang-router flags (without "--")


@dataclass
class RolloutConfig:
    engine: str = "embedded"  # embedded | sglang
    batch_size: int = 32  # prompts per rollout (slime: rollout_batch_size)
    n_samples_per_prompt: int = 8  # responses per prompt (a GRPO group)
    temperature: float = 1.0  # sampling temperature (the trainer scores log-probs at the same temperature)
    top_p: float = 1.0  # nucleus sampling; must stay off (1.0) for training samples: the trainer scores all tokens
    top_k: int = -1  # top-k sampling; must stay off (-1) for training samples, as top_p
    max_response_len: int = 1024  # most new tokens per response
    max_prompt_len: Optional[int] = None  # longer prompts are filtered out at load time
    stop: List[str] = field(default_factory=list)  # stop strings
    stop_token_ids: List[int] = field(default_factory=list)  # stop token ids (besides EOS)
    skip_special_tokens: bool = True  # drop EOS and other special tokens from the response text
    seed: int = 42  # sampling seed: each sample's sampling_seed derives from it, the rollout and the sample's index
    concurrency: int = 512  # in-flight /generate requests per engine; threads of a plain-def rollout.agent
    # Hooks: Hydra _target_ nodes or dotted paths; None: the built-in default
    generate: Optional[Any] = None  # async generate(ctx, sample, sampling_params, evaluation) -> Sample
    dynamic_filter: Optional[Any] = None  # f(cfg, group) -> bool | DynamicFilterOutput; None: algo.dynamic_sampling
    rollout_function: Optional[Any] = None  # async f(ctx, rollout_id, weight_version) -> (groups, metrics)
    # an agent on an OpenAI-compatible endpoint per sample: [async] run(client, sample) -> reward (a def: a thread)
    agent: Optional[Any] = None  # a _target_ node or dotted path (docs/recipes/agents.md); None: rollout.generate
    agent_timeout: float = 600.0  # seconds an agent may take for one sample; then the sample fails
    agent_max_turns: Optional[int] = None  # chat requests per sample; one more is refused and truncates it
    agent_env: Optional[str] = None  # rollout.agent=verifiers: the installed verifiers taskset (module name or id)
    tool_parser: Optional[str] = None  # qwen3 | glm4 | llama3 | calc | none; None: guessed from the chat template
    over_sampling_batch_size: Optional[int] = None  # prompts per refill while too few groups pass; None: batch_size
    max_sampled_groups: Optional[int] = None  # per rollout; then rejected groups fill the batch (None: no limit)
    partial_rollout: bool = False  # groups cut off when the batch is full are continued next rollout
    mask_offpolicy_in_partial_rollout: bool = False  # no loss on tokens made by older weights
    server_args: Dict[str, Any] = field(default_factory=dict)  # SGLang ServerArgs pass-through
    embedded_max_batch: int = 256  # embedded engine: most sequences decoded together
    # SGLang starts sooner: pre-imported forked workers, kernels built beside it, early checks (docs/startup.md)
    sglang_fast_start: bool = True
    startup_timeout_s: float = 600.0  # how long an engine may take to answer /health_generate after it starts
    router: RouterConfig = field(default_factory=RouterConfig)  # sglang-router in front of the engines
    # heal in process (docs/faults.md): restart dead or silent engines, rebuild router, manager, trainers; off: stop
    fault_tolerance: bool = False
    health_check_interval_s: float = 10.0  # fault tolerance: seconds between /health_generate probes
    health_check_timeout_s: float = 30.0  # fault tolerance: an engine silent this long is restarted
    max_engine_restarts_per_hour: int = 3  # per engine; one more is an error naming it


@dataclass
class ParallelismConfig:
    """Where things run. "gpus" means accelerator slots; with device=cpu they are CPU slots."""

    name: str = MISSING  # preset name (conf/parallelism/<name>.yaml)
    device: str = "cpu"  # cpu | cuda
    num_nodes: int = 1  # machines in the Ray cluster
    gpus_per_node: int = 8  # accelerators (or CPU slots) per machine
    trainer_gpus: int = 1  # total trainer slots (data x tensor x pipeline x context parallel)
    rollout_gpus: Optional[int] = None  # None: = trainer_gpus when colocated
    gpus_per_engine: int = 1  # accelerators of one engine (SGLang tp_size; may span nodes)
    colocate: bool = False  # trainers and engines share slots, taking turns on memory as offload_* say
    # colocated: the trainer's state goes to the host while engines generate; None: the least the estimate fits
    offload_train: Optional[bool] = None
    offload_rollout: Optional[bool] = None  # colocated: the engines release their memory while the trainer trains
    # with offload_train: push the weights from the GPU before they go to the host; None: where the estimate fits
    push_before_offload: Optional[bool] = None
    tensor_parallel: int = 1  # trainer tensor-parallel size (megatron)
    pipeline_parallel: int = 1  # trainer pipeline-parallel size (megatron)
    context_parallel: int = 1  # trainer context-parallel size (megatron)
    expert_parallel: int = 1  # trainer expert-parallel size (megatron, MoE; divides arch.num_experts)
    expert_tensor_parallel: Optional[int] = None  # megatron: TP size inside the experts; None: tensor_parallel
    virtual_pipeline_parallel: Optional[int] = None  # megatron: model chunks per pipeline rank (interleaved)
    sequence_parallel: bool = False  # megatron sequence parallelism (with tensor_parallel > 1)
    gpu_memory_gib: float = 140.0  # GiB of one accelerator, for the memory estimate (docs/memory.md)
    cpu_threads: int = 1  # torch threads per process on CPU (OpenMP threads that outnumber the cores spin)


@dataclass
class DataConfig:
    name: str = MISSING  # preset name, used in run_name (conf/data/<name>.yaml)
    source: str = "builtin"  # builtin | jsonl (jsonl also reads .parquet) | verifiers (rollout.agent_env's tasks)
    task: str = "max_digit"  # builtin: the task (slime_hydra/data/tasks.py)
    num_train: int = 9000  # builtin: training prompts
    num_eval: int = 256  # builtin: held-out prompts
    path: Optional[str] = None  # path, optionally with a row slice: data.jsonl@[0:1000]
    input_key: str = "prompt"  # the prompt's field in each row (text or chat messages)
    label_key: Optional[str] = "label"  # the label's field (None: no labels)
    metadata_key: Optional[str] = "metadata"  # a field of free-form metadata handed to the reward (None: none)
    tools_key: Optional[str] = "tools"  # a field of tool schemas for the chat template (None: none)
    apply_chat_template: bool = False  # render prompts with the tokenizer's chat template
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)  # apply_chat_template arguments
    system_prompt: Optional[str] = None  # a system message put first (needs apply_chat_template)
    shuffle: bool = True  # shuffle the prompts every epoch
    seed: int = 1234  # seed of the split and the shuffle
    num_epoch: Optional[int] = None  # alternative to trainer.num_rollout
    buffer_filter: Optional[Any] = None  # f(buffer, n) -> list[list[Sample]], popping what it returns


@dataclass
class RewardConfig:
    type: str = "exact"  # a key of slime_hydra.rewards.REWARD_TYPES
    custom: Optional[Any] = None  # ``_target_`` node or dotted path for type=custom
    group: bool = False  # custom reward is called per group (list of samples)
    key: Optional[str] = None  # pick this field when the reward is a dict
    url: Optional[str] = None  # type=remote
    timeout_s: float = 30.0  # type=remote: seconds per request
    max_retries: int = 5  # type=remote: retries (connection errors, timeouts, 5xx, 408, 429)


@dataclass
class EvalDatasetConfig:
    name: str = MISSING  # metrics go to eval/<name>/...
    path: Optional[str] = None  # None: the built-in task's held-out split
    input_key: Optional[str] = None  # None: data.input_key
    label_key: Optional[str] = None  # None: data.label_key
    reward: Optional[str] = None  # reward type; None: reward.type
    n_samples_per_prompt: int = 1  # samples per prompt (pass@k needs more than 1)
    temperature: float = 0.0  # greedy by default
    top_p: float = 1.0  # nucleus sampling (1.0: off)
    max_response_len: Optional[int] = None  # None: rollout.max_response_len
    max_prompts: Optional[int] = None  # evaluate only the first N prompts (None: all)


@dataclass
class EvalConfig:
    interval: int = 10  # every N rollouts; 0: only before and after training
    before_train: bool = True  # evaluate once before the first step
    datasets: List[EvalDatasetConfig] = field(default_factory=list)  # the eval sets (each: EvalDatasetConfig)


@dataclass
class LoraConfig:
    """LoRA adapters through PEFT (torch backend, DDP or FSDP2): only the adapters train."""

    rank: int = 0  # adapter rank r; 0: off (full fine-tuning)
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input
    target_modules: Optional[List[str]] = None  # linear layer names to adapt (LORA_LINEAR_MODULES); None: the family's
    save_merged: bool = False  # checkpoints also write hf/ with the adapters merged (else the adapter only)
    push: str = "merged"  # what the engines get: merged (base + scale B A per layer); the only one so far


@dataclass
class TrainerConfig:
    backend: str = "torch"  # torch | megatron (slime_hydra.train.backend.BACKENDS)
    strategy: str = "ddp"  # ddp (every rank holds the whole model) | fsdp (FSDP2: sharded per decoder layer)
    fsdp_cpu_offload: bool = False  # fsdp: parameters, gradients and optimizer state live on the host
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (lora.rank > 0); torch backend only
    # log-probs from the hidden states a chunk of tokens at a time, never the [B, L, V] logits (train/logprobs.py)
    fused_logprobs: bool = True
    compile: bool = False  # torch.compile each decoder layer (dynamic lengths; fuses norms, rotary, SwiGLU, casts)
    # a dummy forward/backward while the engines start, so step 1 skips the compiles; auto: on GPUs, unless offloading
    warm_up: Any = "auto"
    num_rollout: Optional[int] = 100  # training steps (rollouts); None: from data.num_epoch
    global_batch_size: Optional[int] = None  # samples per optimiser step; None: one step per rollout
    num_steps_per_rollout: Optional[int] = None  # None: derived from global_batch_size
    micro_batch_size: Any = "auto"  # samples per forward/backward; auto: on GPUs the largest that fits, else 64
    gradient_checkpointing: Any = "auto"  # recompute activations (torch backend); auto: where the estimate needs it
    mode: str = "sync"  # sync | async (one-step off-policy: the next rollout generates while the trainer trains)
    update_weights_interval: int = 1  # push weights to the engines every N steps (and after the last)
    max_staleness: int = 1  # async: most training steps a sample's weights may lag (rollout/staleness_max); more stops
    save_interval: int = 50  # rollouts; 0: none but the last step's
    save_last: bool = True  # save the last step too; false: a measurement whose checkpoint is not wanted
    keep_checkpoints: int = 2  # newest checkpoints kept in the run directory
    resume: Optional[str] = None  # a checkpoint dir, a run dir, or "auto" (latest in this run dir)
    # besides SIGTERM, the signal that preempts: save at the next safe point, exit 128 + its number; None: SIGTERM only
    preempt_signal: Optional[str] = "USR1"
    preempt_grace_s: float = 60.0  # a preempted run saves and exits within this; else it exits without the save
    max_restarts_per_hour: int = 3  # fault tolerance: trainer-group rebuilds per hour; one more stops the run
    # fault tolerance: a trainer call not done within this many seconds is a hung rank (rebuilt); None: no limit
    hang_timeout_s: Optional[float] = 3600.0
    # megatron: packed tokens per micro-batch; None: micro_batch_size samples; auto: the largest that fits (GPUs)
    max_tokens_per_micro_batch: Any = None
    recompute: str = "none"  # activation recompute: none | selective | full | auto (full only where needed)
    use_distributed_optimizer: bool = True  # Adam state and main weights sharded over data-parallel ranks
    megatron: Dict[str, Any] = field(default_factory=dict)  # extra TransformerConfig fields, passed through


@dataclass
class SyncConfig:
    transport: str = "auto"  # auto (colocated: tensor, split: distributed) | distributed | tensor | disk
    bucket_mb: int = 512  # weights travel in buckets of at most this many MiB
    # stop a sync run whose mean |rollout - trainer| log-prob gap exceeds this; None: 1e-3 fp32, 0.05 bf16; inf: off
    max_logprob_diff: Optional[float] = None
    push_timeout_s: float = 600.0  # fault tolerance: a push not done in this many seconds counts as its engines' death


@dataclass
class LoggingConfig:
    level: str = "INFO"  # Python log level of the driver and the actors
    progress: bool = True  # show a progress bar with the live reward
    backends: List[str] = field(default_factory=lambda: ["wandb"])  # trackers: wandb, tensorboard, mlflow
    wandb_mode: str = "auto"  # auto (online with an API key, else offline) | online | offline | disabled
    wandb_project: str = "slime_hydra"  # wandb project
    wandb_entity: Optional[str] = None  # wandb entity (team or user; None: wandb's default)
    wandb_tags: List[str] = field(default_factory=list)  # wandb run tags
    wandb_group: Optional[str] = None  # wandb run group (a sweep sets its id: its runs side by side)
    mlflow_uri: Optional[str] = None  # MLflow tracking URI; None: $MLFLOW_TRACKING_URI, else sqlite in the run dir
    mlflow_experiment: str = "slime_hydra"  # MLflow experiment
    mlflow_parent: Optional[str] = None  # MLflow parent run id (a sweep sets its run's: the jobs are its children)
    plot: bool = True  # write reward_curve.png into the run directory
    log_samples: int = 2  # print this many sampled responses per eval


@dataclass
class ClusterConfig:
    address: Optional[str] = None  # join this Ray cluster ("auto" or host:port); None: start a local one
    num_cpus: Optional[int] = None  # local cluster only; None: what the plan needs
    include_dashboard: bool = False  # start Ray's dashboard (local cluster)
    env_vars: Dict[str, str] = field(default_factory=dict)  # environment of every Ray actor and the servers they start


@dataclass
class SweepConfig:
    max_concurrent: int = 1  # -m: jobs running at once, all on one Ray cluster (the launcher's n_jobs)
    num_cpus: Optional[int] = None  # -m: CPUs of the sweep's local Ray cluster; None: enough for max_concurrent jobs
    num_gpus: Optional[int] = None  # -m: GPUs of the sweep's local Ray cluster; None: the machine's
    skip_invalid: bool = False  # -m: run the valid jobs when some are invalid (else: list them all, start none)
    resume: bool = False  # -m: skip finished jobs, resume interrupted ones (trainer.resume=auto); same sweep dir
    optimized_metric: str = "eval_reward_final"  # the summary.json value a job returns (Optuna's objective)
    status_interval_s: float = 10.0  # -m: seconds between the sweep's status lines and report updates


@dataclass
class StageConfig:
    """One stage of a staged experiment: a whole run, starting from the previous stage's final checkpoint."""

    name: str = MISSING  # names the stage's directory, <run dir>/<k>_<name>
    overrides: List[str] = field(default_factory=list)  # this stage's Hydra overrides (algo=sft, trainer.num_rollout=9)


@dataclass
class RunConfig:
    model: ModelConfig = MISSING  # conf/model/: the policy model (architecture, checkpoint, tokenizer)
    algo: AlgoConfig = MISSING  # conf/algo/: advantages, policy loss, KL, optimiser
    # algo=opd: the model the student learns from (teacher.path; a preset: +model@teacher=qwen3_4b)
    teacher: ModelConfig = field(default_factory=lambda: ModelConfig(name="none", dtype="${model.dtype}", arch=NO_ARCH))
    rollout: RolloutConfig = MISSING  # conf/rollout/: engine, sampling, hooks, router, fault tolerance
    parallelism: ParallelismConfig = MISSING  # conf/parallelism/: devices, placement, model parallelism, offload
    data: DataConfig = MISSING  # conf/data/: the training prompts
    trainer: TrainerConfig = MISSING  # conf/trainer/: backend, steps, batches, sync/async, checkpoints
    reward: RewardConfig = field(default_factory=RewardConfig)  # conf/reward/: how a response is scored
    eval: EvalConfig = field(default_factory=EvalConfig)  # conf/eval/: held-out evaluation
    sync: SyncConfig = field(default_factory=SyncConfig)  # weight transport trainer -> engines and its guard
    logging: LoggingConfig = MISSING  # conf/logging/: console, wandb, plots
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # Ray: start a local cluster or join one
    sweep: SweepConfig = field(default_factory=SweepConfig)  # `-m` sweeps: concurrency, validation, resume
    # stages run one after another (e.g. SFT then GRPO), each from the previous one's final checkpoint; [] one run
    stages: List[StageConfig] = field(default_factory=list)
    run_name: str = "run"  # names the run directory (default: <model>_<algo>)
    seed: int = 1234  # one seed for everything random (model init, data order, sampling, training)
    dry_run: bool = False  # validate and print the resource plan and memory estimate; start nothing
    output_dir: Optional[str] = None  # where this run writes (Hydra's run directory), filled in at start-up
