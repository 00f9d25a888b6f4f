"""The memory estimate of the plan (slime_hydra/plan/params.py, activations.py, memory.py): parameter counts against the
Hugging Face models, activation bytes against saved-tensor measurements, the whole trainer against
a measured H200 run, and the layouts it refuses or lets through."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

from conftest import resolved
from slime_hydra.model.hf import hf_config
from slime_hydra.plan import activations as A, memory as M, params as P
from slime_hydra.plan.resources import make_plan

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))


def hf_model(arch, **extra):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(arch, pad_token_id=0, **extra))


def hf_counts(model):
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    head = model.get_output_embeddings().weight
    tied = head is model.get_input_embeddings().weight
    return total, experts, 0 if tied else head.numel()


@pytest.mark.parametrize("preset", PRESETS)
def test_param_count_equals_the_hugging_face_model_of_each_preset(preset):
    arch = resolved([f"model={preset}"]).model.arch
    n = P.param_count(arch)
    assert (n.total, n.experts, n.lm_head) == hf_counts(hf_model(arch))


@pytest.mark.parametrize("kind, changes", [
    ("qwen2", {}),
    ("llama", {"attention_bias": True}),
    ("qwen3", {"attention_bias": True, "tie_word_embeddings": False}),
    ("glm4", {"attention_bias": True}),
    ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48}),
])
def test_param_count_follows_biases_tying_and_experts(kind, changes):
    arch = resolved([]).model.arch
    arch.type = kind
    for k, v in changes.items():
        setattr(arch, k, v)
    n = P.param_count(arch)
    assert (n.total, n.experts, n.lm_head) == hf_counts(hf_model(arch))


# ----------------------------------------------------------------------------------- activations
def saved_bytes_per_token_per_layer(arch, autocast: bool, checkpointing: bool = False, compiled: bool = False,
                                    **extra) -> float:
    """What autograd keeps for the backward pass, per token and decoder layer (the difference of 1 and
    2 layers, and of 1 and 3 sequences, so weights and their autocast copies cancel out). ``compiled``: each
    decoder layer compiled as ``trainer.compile`` does (train/backends/torch/backend.py); the tensors the
    compiled forward saves for its backward reach the hooks through AOTAutograd's ``save_for_backward``."""
    from transformers import AutoModelForCausalLM

    def saved(layers: int, batch: int) -> int:
        arch.num_layers = layers
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config(arch, pad_token_id=0, **extra), dtype=torch.float32)
        if checkpointing:
            model.gradient_checkpointing_enable()
        if compiled:
            torch._dynamo.reset()  # a fresh cache: no recompile limit reached, no fallback to eager
            for layer in model.model.layers:
                layer.compile(dynamic=True)
        model.train()
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(0, arch.vocab_size, (batch, 32))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                model.model(input_ids=ids)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return sum(v for k, v in storages.items() if k not in params)

    return ((saved(2, 3) - saved(2, 1)) - (saved(1, 3) - saved(1, 1))) / (2 * 32)


def small_arch(kind: str):
    arch = resolved(["model=deepseek_v3"] if kind == "deepseek_v3" else []).model.arch
    arch.type, arch.vocab_size, arch.hidden_size, arch.intermediate_size = kind, 64, 128, 320
    arch.num_heads, arch.num_kv_heads, arch.head_dim = 4, 2, 48
    if kind == "qwen3_moe":
        arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size = 8, 2, 96
    if kind == "deepseek_v3":
        arch.num_kv_heads, arch.head_dim = 4, None
        arch.q_lora_rank, arch.kv_lora_rank = 96, 64
        arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim = 32, 16, 32
        arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size, arch.first_k_dense_layers = 8, 2, 96, 0
    return arch


@pytest.mark.parametrize("kind", ["qwen3", "llama", "glm4", "qwen3_moe", "deepseek_v3"])
def test_activation_bytes_per_layer_match_what_autograd_saves(kind):
    arch = small_arch(kind)
    extra = {"n_group": 1, "topk_group": 1} if kind == "deepseek_v3" else {}
    moe = bool(arch.num_experts)
    measured = saved_bytes_per_token_per_layer(arch, autocast=True, **extra)
    assert sum(A.layer_act_bytes(arch, A.ACT_AUTOCAST, moe)) == pytest.approx(measured, rel=0.1)
    if kind in ("qwen3", "llama"):
        fp32 = saved_bytes_per_token_per_layer(arch, autocast=False)
        assert sum(A.layer_act_bytes(arch, A.ACT_FP32, moe)) == pytest.approx(fp32, rel=0.1)


@pytest.mark.slow  # about a minute of compiling on two CPU cores
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("autocast", [True, False])
def test_compiled_activation_bytes_per_layer_are_what_the_compiled_layer_saves(kind, autocast):
    """trainer.compile: inductor's partitioner keeps the matmuls' outputs and recomputes the elementwise work (norms,
    rotary, SiLU) in the backward; the compiled tables are its count, to the byte (4,976 bytes a token for this
    Qwen3 layer under autocast, against 8,816 eager)."""
    arch = small_arch(kind)
    table = A.ACT_COMPILED_AUTOCAST if autocast else A.ACT_COMPILED_FP32
    measured = saved_bytes_per_token_per_layer(arch, autocast=autocast, compiled=True)
    assert sum(A.layer_act_bytes(arch, table, False)) == measured


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gradient_checkpointing_keeps_each_layers_float32_input(compiled):
    """Compiled too: the checkpoint wraps the compiled layer, which the backward pass recomputes whole."""
    arch = small_arch("qwen3")
    assert saved_bytes_per_token_per_layer(arch, autocast=True, checkpointing=True,
                                           compiled=compiled) == 4 * arch.hidden_size


def test_logprob_chunk_is_the_trainers():
    from slime_hydra.train.batch import response_log_probs

    assert inspect.signature(response_log_probs).parameters["chunk"].default == A.LOGPROB_CHUNK


def test_head_chunk_is_the_trainers():
    from slime_hydra.train import logprobs

    assert logprobs.HEAD_CHUNK_ROWS == A.HEAD_CHUNK_ROWS


def test_trainer_estimate_is_within_10_percent_of_the_measured_h200_run():
    """A training run on an H200 (bench/measured/h200_train_gpu.json): Qwen3-0.6B shape, one trainer, 64 samples
    of 64 + 256 tokens in micro-batches of 16, KL loss (the reference's weights on the GPU);
    torch.cuda.max_memory_allocated 32.9 GiB. Estimate: 32.6."""
    run = json.loads((ROOT / "bench/measured/h200_train_gpu.json").read_text())["runs"][0]
    measured = run["kl"]["peak_gib"]
    cfg = resolved(["model=qwen3_0_6b", "parallelism=1gpu", "rollout.batch_size=8", "rollout.n_samples_per_prompt=8",
                    "trainer.micro_batch_size=16", "algo.kl_loss_coef=0.04", "rollout.max_prompt_len=64",
                    "trainer.fused_logprobs=false",  # measured before the fused head
                    "rollout.max_response_len=256"])
    est = M.estimate(cfg, make_plan(cfg))
    assert run["batch"] == 64 and est.micro_batch.positions == 16 * 320
    assert est.trainer_total == pytest.approx(measured, rel=0.1)


@pytest.mark.parametrize("file, phase, prompts", [("h200_sglang_colocated_warm_up.json", "sglang_warm", 8),
                                                  ("h200_sglang_colocated_256x256_compile.json", "sglang", 32)])
def test_trainer_compile_estimate_is_within_15_percent_of_the_measured_h200_runs(file, phase, prompts):
    """trainer.compile=true on an H200, Qwen3-0.6B shape, micro-batches of 64 samples of 256 new tokens: the
    trainer held 37.3 GiB (8 prompts x 8 samples; 55.9 eager) and 39.5 GiB (32 x 8). The plan: 34.1 for both,
    48.9 when it counted eager activations for compiled layers too."""
    run = json.loads((ROOT / "bench/measured" / file).read_text())[phase]
    assert "trainer.compile=true" in run["command"] and f"rollout.batch_size={prompts} " in run["command"]
    assert "micro_batch_size=64 (64 samples" in json.dumps(run)  # the micro-batch the plan chose for it
    peaks = [r["train/gpu_peak_gib"] for r in run["rows"][1:]]
    measured = sorted(peaks)[len(peaks) // 2]
    base = ["model=qwen3_0_6b", "parallelism=1gpu", "rollout=sglang", f"rollout.batch_size={prompts}",
            "rollout.n_samples_per_prompt=8", "rollout.max_response_len=256", "trainer.micro_batch_size=64",
            "trainer.gradient_checkpointing=false", "algo.kl_loss_coef=0", "parallelism.offload_train=false",
            "parallelism.offload_rollout=false", "rollout.server_args.mem_fraction_static=0.5"]
    compiled = M.estimate(cfg := resolved([*base, "trainer.compile=true"]), make_plan(cfg))
    eager = M.estimate(cfg := resolved(base), make_plan(cfg))
    assert compiled.micro_batch.positions == 64 * 256
    assert compiled.trainer_total == pytest.approx(measured, rel=0.15)
    assert eager.trainer_total > measured * 1.15  # eager activations do not fit the compiled run
    arch = cfg.model.arch
    per_token = {k: sum(A.layer_act_bytes(arch, t, False)) * arch.num_layers * 64 * 256 / M.GIB
                 for k, t in (("compiled", A.ACT_COMPILED_AUTOCAST), ("eager", A.ACT_AUTOCAST))}
    assert eager.trainer["activations"] - compiled.trainer["activations"] == \
        pytest.approx(per_token["eager"] - per_token["compiled"])  # only the layers change


def test_trainer_compile_changes_the_estimate_of_every_strategy_and_of_megatron():
    """DDP, FSDP2, LoRA and megatron compile the same decoder layers, and take the compiled tables: megatron's
    compiled step peaked at 51.4 GiB on the H200 against 65.7 planned eager, 47.2 compiled
    (bench/measured/h200_kv_cap.md); megatron with tensor parallelism, not measured compiled, keeps the eager count."""
    base = ["model=qwen3_0_6b", "parallelism=1gpu", "rollout=sglang", "trainer.micro_batch_size=16",
            "trainer.gradient_checkpointing=false"]
    for strategy in ([], ["trainer.strategy=fsdp"], ["trainer.lora.rank=16"]):
        eager, compiled = (resolved_activations([*base, *strategy, f"trainer.compile={c}"]) for c in ("false", "true"))
        assert compiled < 0.7 * eager, strategy
    megatron = [*base[:3], "trainer=megatron", "trainer.recompute=none"]
    assert resolved_activations([*megatron, "trainer.compile=true"]) < 0.7 * resolved_activations(megatron)
    tp2 = ["model=qwen3_0_6b", "parallelism=colocate_4gpu_tp2", "rollout=sglang", "trainer=megatron",
           "trainer.recompute=none"]  # not measured compiled: the eager count stays
    assert resolved_activations([*tp2, "trainer.compile=true"]) == resolved_activations(tp2)


# ----------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("model, state_gib, kl", [("deepseek_v3", 12499, 0), ("qwen3_30b_a3b", 569, 0),
                                                 ("qwen3_30b_a3b", 682, 0.04)])
def test_torch_backend_refuses_big_models_on_colocate_8gpu_with_the_numbers(model, state_gib, kl):
    cfg = resolved([f"model={model}", "rollout=sglang", "parallelism=colocate_8gpu", "trainer.micro_batch_size=1",
                    "trainer.gradient_checkpointing=true", f"algo.kl_loss_coef={kl}"])
    problems = M.memory_problems(cfg, make_plan(cfg), cfg.parallelism.gpu_memory_gib)
    training = next(p for p in problems if p.startswith("parallelism: colocated GPU, training needs"))
    what = "weights, gradients, optimizer state and reference weights" if kl else \
        "weights, gradients and optimizer state"
    assert f"the {what} alone take {state_gib} GiB" in training
    assert "> parallelism.gpu_memory_gib=140" in training and "replicates them on every GPU" in training
    n = P.param_count(cfg.model.arch).total
    assert f"weights {4 * n / M.GIB:.1f}, grads {4 * n / M.GIB:.1f}, Adam {8 * n / M.GIB:.1f}" in training


# the Qwen3-4B experiment on the data-parallel torch backend (its own file runs trainer=megatron)
TORCH_4B = ["experiment=qwen3_4b_grpo_math", "trainer=torch", "parallelism=colocate_8gpu", "trainer.micro_batch_size=1",
            "trainer.gradient_checkpointing=true"]


def test_qwen3_4b_on_the_torch_backend_fits_on_colocate_8gpu():
    cfg = resolved(TORCH_4B)
    assert cfg.parallelism.name == "colocate_8gpu" and cfg.model.name == "qwen3_4b" and cfg.trainer.backend == "torch"
    plan = make_plan(cfg)
    assert M.memory_problems(cfg, plan, cfg.parallelism.gpu_memory_gib) == []
    est = plan.memory
    assert est.micro_batch.positions == 8192 and 100 < est.peak < 120  # 105.4 training, 113.0 rollout


def test_a_long_micro_batch_is_refused_with_what_to_change():
    cfg = resolved([*TORCH_4B, "trainer.micro_batch_size=4", "trainer.gradient_checkpointing=false"])
    (problem,) = M.memory_problems(cfg, make_plan(cfg), 140.0)
    assert problem.startswith("parallelism: colocated GPU, training needs ~")
    assert problem.endswith("lower trainer.micro_batch_size (now 4 samples of up to 8192 tokens) "
                            "or set trainer.gradient_checkpointing=true")


def test_colocated_peak_is_the_larger_phase_with_offload_and_the_sum_without():
    base = TORCH_4B
    on = M.estimate(cfg := resolved(base), make_plan(cfg))
    no_offload = [*base, "parallelism.offload_train=false", "parallelism.offload_rollout=false"]
    off = M.estimate(cfg := resolved(no_offload), make_plan(cfg))
    assert on.gpus["colocated GPU, training"] == pytest.approx(on.trainer_total)
    # while engines generate, only DDP's gradient buckets stay (the offloader moves weights and Adam)
    assert on.gpus["colocated GPU, rollout"] == pytest.approx(on.engine_total + on.trainer["ddp_buckets"])
    assert off.gpus["colocated GPU, training"] == pytest.approx(off.trainer_total + off.engine_total)
    assert off.peak > 140 > on.peak


# the anchor GRPO step (python bench/run.py anchor): Qwen3-0.6B shape, 8 prompts x 8 samples x 256 new tokens, one H200;
# the numbers below are those of the logits head (trainer.fused_logprobs=false), ANCHOR_FUSED's the default's
ANCHOR = ["model=qwen3_0_6b", "parallelism=1gpu", "rollout=sglang", "rollout.batch_size=8",
          "rollout.n_samples_per_prompt=8", "rollout.max_response_len=256", "trainer.micro_batch_size=16",
          "trainer.gradient_checkpointing=false", "trainer.fused_logprobs=false"]
ANCHOR_FUSED = ANCHOR[:-1]


@pytest.mark.parametrize("overrides, offload", [
    # trainer 32.6 + engine 0.5 x 140 = 102.6 GiB <= 126 (90% of 140): nothing moves
    ([*ANCHOR, "rollout.server_args.mem_fraction_static=0.5"], (False, False)),
    # engine 0.7 x 140: 130.6 together > 126; the engine releases while training, the trainer stays (109.1)
    (ANCHOR, (False, True)),
    # the fused log-prob head: trainer 24.8 (activations 12.6 against 20.4) + engine 98.0 = 122.8 <= 126
    (ANCHOR_FUSED, (False, False)),
    # a set value stays: the other is chosen around it
    ([*ANCHOR, "rollout.server_args.mem_fraction_static=0.5", "parallelism.offload_train=true"], (True, False)),
    ([*ANCHOR, "parallelism.offload_rollout=false"], (True, False)),  # nothing fits in 126: the most offload
    ([*ANCHOR, "rollout=embedded", "rollout.embedded_max_batch=64"], (False, False)),
    (["experiment=qwen3_4b_grpo_math"], (False, False)),  # TP 2, distributed optimizer: 119.0 side by side
    # Adam unsharded: 135.8 side by side, 131.7 with the engine released; only with both (98.0)
    (["experiment=qwen3_4b_grpo_math", "trainer.use_distributed_optimizer=false"], (True, True)),
    (["parallelism=cpu_colocate"], (True, True)),  # CPU slots: the colocated choreography
    ([], (False, False)),  # split
])
def test_unset_offload_is_the_least_that_fits_in_90_percent_of_the_gpu(overrides, offload):
    p = resolved(overrides).parallelism
    assert (p.offload_train, p.offload_rollout) == offload


def test_dry_run_shows_the_peak_of_each_offload_and_the_choice():
    text = make_plan(resolved([*ANCHOR, "rollout.server_args.mem_fraction_static=0.5"])).describe()
    assert "offload: train=False rollout=False" in text
    assert "colocated GPU, training: 102.6" in text and "colocated GPU, rollout: 81.1" in text
    assert ("peak by what is offloaded: none 102.6, engine 81.1, trainer 102.6, both 70.0; unset "
            "parallelism.offload_train / offload_rollout take the least offload within 126 GiB (90%)") in text
    assert "peak by what is offloaded" not in make_plan(resolved(["model=qwen3_4b", "rollout=sglang",
                                                                  "parallelism=split_4_4"])).describe()


def test_colocated_without_offload_is_refused_with_what_would_fit():
    # Qwen3-4B (4.02B parameters) unsharded: TP 1 and Adam on every rank (12 bytes a parameter, 45.0 GiB)
    cfg = resolved(["experiment=qwen3_4b_grpo_math", "parallelism.offload_train=false",
                    "parallelism.offload_rollout=false", "parallelism.tensor_parallel=1",
                    "trainer.use_distributed_optimizer=false"])
    training, rollout = M.memory_problems(cfg, make_plan(cfg), 140.0)
    assert training.startswith("parallelism: colocated GPU, training needs ~173 GiB (trainer: weights 7.5, grads 15.0, "
                               "Adam 45.0, activations 7.9; sglang engine 98.0)")
    assert training.endswith("> parallelism.gpu_memory_gib=140; set parallelism.offload_rollout=true (the engine "
                             "releases its memory while the trainer trains) or lower "
                             "rollout.server_args.mem_fraction_static to at most 0.46 (now 0.7; the trainer needs "
                             "75.4 GiB beside the engine)")
    assert rollout.startswith("parallelism: colocated GPU, rollout needs ~165 GiB (sglang engine: weights 3.7, KV "
                              "cache 94.3; trainer state left on the GPU 67.4)")
    assert "set parallelism.offload_train=true" in rollout and "mem_fraction_static to at most 0.51" in rollout
    # SGLang with mem_fraction_static 0.9 beside a 33 GiB trainer: refused; at most 0.76 would fit
    big = resolved([*ANCHOR, "parallelism.offload_rollout=false", "rollout.server_args.mem_fraction_static=0.9"])
    (problem,) = M.memory_problems(big, make_plan(big), 140.0)
    assert "training needs ~159 GiB" in problem and "mem_fraction_static to at most 0.76 (now 0.9" in problem
    fits = resolved([*ANCHOR, "parallelism.offload_rollout=false", "rollout.server_args.mem_fraction_static=0.76"])
    assert M.memory_problems(fits, make_plan(fits), 140.0) == []
    embedded = resolved([*ANCHOR, "rollout=embedded", "parallelism.offload_rollout=false",
                         "rollout.embedded_max_batch=4096", "rollout.max_response_len=1024"])
    assert "or lower rollout.embedded_max_batch (now 4096)" in M.memory_problems(embedded, make_plan(embedded), 140)[0]


def test_async_colocated_counts_the_trainer_beside_the_whole_engine_and_refuses_with_the_sync_loop():
    """trainer.mode=async on a colocated GPU: the rollout runs while the trainer trains, so nothing is offloaded
    and the peak is the training phase, the trainer (activations too) beside the engine's weights and KV cache.
    A layout over the GPU is refused naming trainer.mode=sync, not an offload async cannot take."""
    cfg = resolved([*ANCHOR, "trainer.mode=async"])
    est = M.estimate(cfg, make_plan(cfg))
    assert est.engine["kv_cache"] > 0 and est.trainer["activations"] > 0
    assert est.gpus["colocated GPU, training"] == pytest.approx(est.trainer_total + est.engine_total)  # 130.6
    sync = resolved(ANCHOR)  # the same in the sync loop: the engine releases its memory while the trainer trains
    assert est.peak == est.gpus["colocated GPU, training"] > M.estimate(sync, make_plan(sync)).peak
    assert any("trainer.mode=async" in n for n in est.notes)
    assert "trainer.mode=async offloads nothing" in make_plan(cfg).describe()
    cfg = resolved(["experiment=qwen3_4b_grpo_math", "trainer.mode=async", "parallelism.tensor_parallel=1",
                    "trainer.use_distributed_optimizer=false"])
    training, rollout = M.memory_problems(cfg, make_plan(cfg), 140.0)
    assert training.startswith("parallelism: colocated GPU, training needs ~173 GiB")
    for problem in (training, rollout):
        assert "set trainer.mode=sync (async trains while the next rollout generates, so nothing can be offloaded" \
            in problem and "=true (the" not in problem


def test_sglang_kv_cache_and_weights_must_fit_in_mem_fraction_static():
    tight = resolved(["experiment=qwen3_4b_grpo_math", "rollout.server_args.mem_fraction_static=0.03"])
    (kv,) = M.memory_problems(tight, make_plan(tight), 140.0)
    assert kv.startswith("rollout.server_args.mem_fraction_static: the KV cache holds ~")
    assert "less than one sequence of 8192 tokens" in kv
    est = M.estimate(tight, make_plan(tight))
    per_token = 2 * 36 * (8 // 2) * 128 * 2  # K and V, 36 layers, 4 of 8 KV heads per GPU (TP 2), head 128, bf16
    assert est.kv_cache_tokens == int((0.03 * 140 * M.GIB - est.engine["weights"] * M.GIB) / per_token)
    none = resolved(["experiment=qwen3_4b_grpo_math", "rollout.server_args.mem_fraction_static=0.02"])
    (weights,) = M.memory_problems(none, make_plan(none), 140.0)
    assert "the engine's weights take 3.7 GiB per GPU, more than 0.02 x 140 GiB" in weights


def test_megatron_shards_weights_by_model_parallel_and_the_optimizer_over_data_parallel():
    cfg = resolved(["model=deepseek_v3", "rollout=sglang", "trainer=megatron", "parallelism=split_4_4",
                    "parallelism.num_nodes=16", "parallelism.trainer_gpus=64", "parallelism.rollout_gpus=64",
                    "parallelism.gpus_per_engine=16", "parallelism.tensor_parallel=4",
                    "parallelism.pipeline_parallel=4", "parallelism.expert_parallel=4",
                    "parallelism.sequence_parallel=true", "+trainer.megatron.num_layers_in_last_pipeline_stage=13"])
    a, n = cfg.model.arch, P.param_count(cfg.model.arch)
    est = M.estimate(cfg, make_plan(cfg))
    # the largest stage: 16 of the 61 layers (16 + 16 + 16 + 13), 16 of the 58 MoE layers, one vocabulary matrix
    vocab = a.vocab_size * a.hidden_size
    dense = ((n.dense - 2 * vocab - a.hidden_size) * 16 / 61 + vocab + a.hidden_size) / 4  # / TP
    experts = n.experts * 16 / 58 / (4 * 4)  # / EP x expert TP (= TP)
    assert est.trainer["weights"] == pytest.approx(2 * (dense + experts) / M.GIB)
    assert est.trainer["grads"] == pytest.approx(4 * (dense + experts) / M.GIB)
    assert est.trainer["adam"] == pytest.approx(12 * (dense / 4 + experts / 1) / M.GIB)  # over 64 / 16 and 64 / 64
    whole = resolved(["model=deepseek_v3", "rollout=sglang", "trainer=megatron", "parallelism=colocate_8gpu"])
    assert M.estimate(whole, make_plan(whole)).trainer["weights"] == pytest.approx(2 * n.total / M.GIB)
    replicated = resolved(["model=deepseek_v3", "rollout=sglang", "parallelism=colocate_8gpu"])
    torch_est = M.estimate(replicated, make_plan(replicated))
    state = ("weights", "grads", "adam")
    # the experts, most of the model, split 64 ways (EP x TP x PP); 18 bytes a parameter to torch's 16 + 4
    assert sum(est.trainer[k] for k in state) < sum(torch_est.trainer[k] for k in state) / 40


def test_megatron_optimizer_state_is_whole_on_every_rank_without_the_distributed_optimizer():
    base = ["experiment=qwen3_4b_grpo_math", "trainer.recompute=none"]
    sharded = M.estimate(cfg := resolved(base), make_plan(cfg))
    whole = M.estimate(cfg := resolved([*base, "trainer.use_distributed_optimizer=false"]), make_plan(cfg))
    assert whole.trainer["adam"] == pytest.approx(4 * sharded.trainer["adam"])  # data parallel 4
    assert whole.trainer["weights"] == sharded.trainer["weights"] and whole.trainer["grads"] == sharded.trainer["grads"]
    assert sharded.trainer["activations"] > resolved_activations(["experiment=qwen3_4b_grpo_math"])


def test_megatron_packs_by_tokens_whatever_the_micro_batch_size():
    """The megatron backend packs up to trainer.max_tokens_per_micro_batch, and micro_batch_size does not cap the
    samples (train/backends/megatron/backend.py: micro_batches). The estimate once capped them by it: 21.3 GiB for
    the anchor's megatron trainer against 49.7 GiB measured on the H200."""
    base = ["model=qwen3_0_6b", "trainer=megatron", "rollout=sglang", "parallelism=1gpu", "rollout.batch_size=8",
            "rollout.n_samples_per_prompt=8", "rollout.max_response_len=256", "trainer.recompute=none",
            "trainer.max_tokens_per_micro_batch=16384"]
    ests = [M.estimate(cfg, make_plan(cfg)) for cfg in (resolved([*base, f"trainer.micro_batch_size={n}"])
                                                         for n in (4, 16, 64))]
    assert {e.micro_batch.samples for e in ests} == {64}  # 16384 tokens of 256-token samples: the whole step
    assert ests[0].trainer["activations"] == ests[2].trainer["activations"]
    half = resolved([*base, "trainer.max_tokens_per_micro_batch=8192"])
    assert M.estimate(half, make_plan(half)).micro_batch.samples == 32


# the Qwen3-4B shape, megatron + SGLang colocated on one H200 (bench/measured/h200_megatron_sglang_4b_1gpu.md)
MEGATRON_4B = ["model=qwen3_4b", "trainer=megatron", "rollout=sglang", "parallelism=1gpu", "rollout.batch_size=8",
               "rollout.n_samples_per_prompt=8", "rollout.max_response_len=256", "algo.kl_loss_coef=0"]


def test_a_run_checkpoint_and_the_save_gather_are_counted():
    """On the H200 the 4B megatron run's final save first ran out of host memory (the distributed optimizer
    gathers its state on the host beside the pinned offload buffers; 110 GB of 128 GiB), then, without it, out
    of the 64 GiB disk."""
    cfg = resolved(MEGATRON_4B)
    est = M.estimate(cfg, make_plan(cfg))
    n = P.param_count(cfg.model.arch).total
    assert sum(est.checkpoint.values()) == pytest.approx(16 * n / M.GIB)  # hf/ and megatron's weights, 12 B Adam
    assert est.host_per_node["checkpoint_gather"] == pytest.approx(est.trainer["adam"])
    assert "a run checkpoint on disk: 59.9" in est.describe()
    whole = resolved([*MEGATRON_4B, "trainer.use_distributed_optimizer=false"])
    assert "checkpoint_gather" not in M.estimate(whole, make_plan(whole)).host_per_node
    lora = resolved(["model=qwen3_4b", "rollout=sglang", "parallelism=1gpu", "trainer.lora.rank=16"])
    assert sum(M.estimate(lora, make_plan(lora)).checkpoint.values()) < 1  # adapters and their optimizer only
    none = resolved([*MEGATRON_4B, "trainer.save_last=false", "trainer.save_interval=0"])
    nothing = M.estimate(none, make_plan(none))
    assert nothing.checkpoint == {} and "checkpoint_gather" not in nothing.host_per_node


def test_a_run_that_cannot_save_or_whose_host_memory_is_short_is_refused_before_it_starts():
    plan = make_plan(resolved(MEGATRON_4B))  # host 97.4 GiB (offload 52.4, gather 45.0), checkpoint 59.9 GiB
    problems, warnings = M.machine_problems(plan, host_gib=125.0, disk_free_gib=40.0)
    assert len(problems) == 1 and problems[0].startswith("output_dir: a run checkpoint is ~60 GiB")
    assert "40 GiB free" in problems[0] and "trainer.save_last=false" in problems[0]
    assert len(warnings) == 1 and "78% of this machine's 125 GiB" in warnings[0]  # the H200 machine: a warning
    assert "trainer.use_distributed_optimizer=false" in warnings[0]
    problems, warnings = M.machine_problems(plan, host_gib=100.0, disk_free_gib=500.0)
    assert warnings == [] and len(problems) == 1 and problems[0].startswith("parallelism: the trainers need ~97 GiB")
    problems, warnings = M.machine_problems(plan, host_gib=None, disk_free_gib=150.0)  # a joined cluster
    assert problems == [] and "fewer than trainer.keep_checkpoints=2" in warnings[0]  # 3 x 60 GiB do not fit
    assert M.machine_problems(plan, host_gib=1000.0, disk_free_gib=1000.0) == ([], [])


def test_a_kv_pool_the_run_cannot_fill_is_named_when_it_is_why_the_trainer_moves():
    """The 4B run on the H200 moved the trainer's 52 GiB to the host and back every step, beside a 62.5 GiB KV
    pool (mem_fraction_static=0.5) of which a rollout fills a few GiB; the plan says what would keep it on the GPU."""
    from slime_hydra.plan.fit import fit

    bounded = [*MEGATRON_4B, "rollout.max_prompt_len=128", "rollout.server_args.mem_fraction_static=0.5"]
    cfg = resolved(bounded)
    fit(cfg)  # as run.py: the micro-batch and the offload (both) left to the plan
    assert cfg.parallelism.offload_train
    hint = M.kv_cache_hint(cfg, make_plan(cfg))
    assert "a rollout keeps at most 24,576 in flight" in hint and "mem_fraction_static=0.11" in hint
    assert hint in make_plan(cfg).describe()
    kept = resolved([*bounded, "rollout.server_args.mem_fraction_static=0.11", "parallelism.offload_train=false",
                     "parallelism.offload_rollout=true", f"trainer.max_tokens_per_micro_batch="
                     f"{cfg.trainer.max_tokens_per_micro_batch}", f"trainer.recompute={cfg.trainer.recompute}"])
    assert M.memory_problems(kept, make_plan(kept), 140.0) == []  # what the hint says does fit
    unbounded = resolved([*MEGATRON_4B, "rollout.server_args.mem_fraction_static=0.5"])
    fit(unbounded)
    assert M.kv_cache_hint(unbounded, make_plan(unbounded)) is None  # prompts of any length: no bound to size by


def resolved_activations(overrides):
    cfg = resolved(overrides)
    return M.estimate(cfg, make_plan(cfg)).trainer["activations"]


def test_dry_run_plan_prints_the_estimate_on_gpus_only():
    text = make_plan(resolved(TORCH_4B)).describe()
    assert "Memory estimate, GiB per GPU (torch trainer; micro-batch 1 x 8192 tokens; a GPU has 140)" in text
    assert "colocated GPU, training: 92.0" in text and "~1,372,670 tokens of KV cache per engine" in text
    assert "Memory estimate" not in make_plan(resolved([])).describe()
    assert M.memory_problems(resolved([]), make_plan(resolved([])), 1.0) == []  # CPU slots: nothing to refuse


def test_gpu_memory_must_be_positive_and_sizes_the_kv_pool():
    cfg = resolved(["experiment=qwen3_4b_grpo_math"])
    assert M.memory_problems(cfg, make_plan(cfg), 0.0) == ["parallelism.gpu_memory_gib: must be > 0, got 0"]
    small, big = M.estimate(cfg, make_plan(cfg), 80.0), M.estimate(cfg, make_plan(cfg), 140.0)
    assert big.engine["kv_cache"] - small.engine["kv_cache"] == pytest.approx(0.7 * 60)


def test_validation_refuses_a_layout_that_cannot_fit_before_anything_starts():
    from slime_hydra.launch.validate import validate

    too_big = resolved(["model=qwen3_30b_a3b", "rollout=sglang", "parallelism=colocate_8gpu", "data=jsonl",
                       f"data.path={ROOT / 'tests/fixtures/tiny.jsonl'}", "eval.datasets=[]"])
    problems = validate(too_big)
    assert problems and all(p.startswith("parallelism: ") and "GiB" in p for p in problems), problems


def test_a_mem_fraction_static_that_is_not_a_number_is_reported_not_raised():
    cfg = resolved(["experiment=qwen3_4b_grpo_math", "rollout.server_args.mem_fraction_static=abc"])
    plan = make_plan(cfg)  # plans are made of configs not yet validated too (engine commands, tests)
    assert "(rollout.server_args.mem_fraction_static is not a number: the engine counts 0.9)" in plan.describe()
    assert "rollout.server_args.mem_fraction_static: 'abc' is not a number" in M.memory_problems(cfg, plan, 140.0)
