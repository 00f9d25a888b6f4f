"""megatron-core training throughput on one GPU, and TP / PP log-prob agreement on two.
How a GPU run is set up: bench/README.md.

Needs only torch, megatron-core and transformers (no Ray, Hydra or omegaconf): the model shape is read
from ``conf/model/<shape>.yaml`` with PyYAML and built with random weights in bf16.

Throughput (one GPU):

    python bench/megatron_gpu.py --shape qwen3_0_6b
    python bench/megatron_gpu.py --shape qwen3_4b --steps 8 --recompute none

Each optimizer step runs ``--micro-batches`` micro-batches of ``--tokens`` packed tokens (samples of
random lengths in ``--sample-lengths``, THD format, no padding), forward and backward through our
module spec (``slime_hydra/train/backends/megatron/spec.py``: SDPA / varlen flash attention, no Transformer
Engine needed), a policy-gradient-shaped loss on the vocab-parallel log-probs of the second half of
each sample, megatron's DDP with the distributed optimizer (Adam, fp32 main weights). Printed (and
written with ``--out``): training tokens/s, TFLOP/s and MFU against 790 TFLOP/s (the bf16 dense matmul
rate measured on the H200), peak memory, and the attention kernel. FLOPs per step count
``6 * N * T`` (N: the matmul parameters, LM head included, embedding lookup excluded; T: tokens)
plus causal attention, ``6 * layers * heads * head_dim * sum(len_i^2)`` (forward and backward).

Agreement (two GPUs):

    torchrun --nproc_per_node 2 bench/megatron_gpu.py --compare --shape qwen3_0_6b

builds the model at TP = 1 (random weights), exports it to Hugging Face tensors, loads those into
TP = 2 (with and without sequence parallelism) and PP = 2 models through the converter, and compares the
log-probs of one packed batch with TP = 1's (and with the transformers model's): the bf16 differences are
printed; the TP = 2 and PP = 2 exports must return the weights bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Dict

import torch
import torch.distributed as dist
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from gpu.harness import write_json  # noqa: E402 - bench/ is on the path from here

PEAK_TFLOPS = 790.0  # bf16 dense matmul, measured on the H200 (shared/reference/environment.md)


def hf_config(shape: str):
    """The transformers config of a model preset (the fields ``slime_hydra.model.hf`` maps)."""
    from transformers import AutoConfig

    arch = yaml.safe_load((ROOT / "conf" / "model" / f"{shape}.yaml").read_text())["arch"]
    kw = dict(vocab_size=arch["vocab_size"], hidden_size=arch["hidden_size"],
              intermediate_size=arch["intermediate_size"], num_hidden_layers=arch["num_layers"],
              num_attention_heads=arch["num_heads"], num_key_value_heads=arch["num_kv_heads"],
              max_position_embeddings=arch.get("max_position_embeddings", 32768),
              rope_theta=arch.get("rope_theta", 1e6), rms_norm_eps=arch.get("rms_norm_eps", 1e-6),
              tie_word_embeddings=arch.get("tie_word_embeddings", False),
              attention_bias=arch.get("attention_bias", False))
    if arch.get("head_dim"):
        kw["head_dim"] = arch["head_dim"]
    if arch.get("num_experts"):
        kw.update(num_experts=arch["num_experts"], num_experts_per_tok=arch["num_experts_per_tok"],
                  moe_intermediate_size=arch["moe_intermediate_size"])
    return AutoConfig.for_model(arch["type"], **kw)


def init_distributed() -> int:
    """NCCL process group (torchrun's environment, or a one-process group); returns the local rank."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return local


def random_micro_batches(n: int, tokens: int, lengths: tuple, vocab: int, seed: int):
    """``n`` packed micro-batches of exactly ``tokens`` tokens; each sample's second half is scored."""
    from slime_hydra.train.backends.megatron.packing import pack

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        seqs, left = [], tokens
        while left:
            ln = min(left, rng.randint(*lengths))
            if left - ln == 1:  # a one-token sample has nothing to score
                ln += 1
            seqs.append([rng.randrange(vocab) for _ in range(ln)])
            left -= ln
        out.append(pack(seqs, [len(s) // 2 for s in seqs], range(len(seqs))))
    return out


def matmul_params(hf) -> int:
    """Parameters that take part in a matmul per token (decoder linears and the LM head)."""
    h, L = hf.hidden_size, hf.num_hidden_layers
    d = getattr(hf, "head_dim", None) or h // hf.num_attention_heads
    attn = h * d * (hf.num_attention_heads * 2 + hf.num_key_value_heads * 2)
    mlp = 3 * h * hf.intermediate_size
    return L * (attn + mlp) + hf.vocab_size * h


def attention_flops(hf, batches) -> float:
    d = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    sq = sum(int(((b.cu_seqlens[1:] - b.cu_seqlens[:-1]).double() ** 2).sum()) for b in batches)
    return 6.0 * hf.num_hidden_layers * hf.num_attention_heads * d * sq


def throughput(args) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from slime_hydra.train.backends.megatron import spec
    from slime_hydra.train.backends.megatron.logprobs import packed_response_log_probs
    from slime_hydra.train.backends.megatron.model import (
        Parallel,
        build_gpt_model,
        compile_layers,
        transformer_config,
        use_fused_adam,
    )
    from slime_hydra.train.backends.megatron.spec import packed_attention_path, resolve_attention_impl

    init_distributed()
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(args.seed)
    spec.USE_VARLEN = not args.no_varlen
    hf = hf_config(args.shape)
    overrides = {}
    if args.recompute != "none":
        overrides.update(recompute_granularity=args.recompute)
        if args.recompute == "full":
            overrides.update(recompute_method="uniform", recompute_num_layers=1)
    if args.unfused_rope:  # megatron's own THD RoPE: a host sync and a loop over the sequences per layer
        overrides.update(apply_rope_fusion=False)
    config = transformer_config(hf, Parallel(), dtype=torch.bfloat16, overrides=overrides)
    model = build_gpt_model(hf, config, attention=args.attention).cuda()
    if args.compile:
        compile_layers([model])
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                               overlap_grad_reduce=False)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-6, weight_decay=0.1, bf16=True,
                                                       params_dtype=torch.bfloat16, use_distributed_optimizer=True,
                                                       clip_grad=1.0), [model])
    if args.fused_adam:
        use_fused_adam(optimizer)
    batches = random_micro_batches(args.micro_batches, args.tokens, args.sample_lengths, hf.vocab_size, args.seed)
    batches = [b.to("cuda") for b in batches]
    forward_backward = get_forward_backward_func()

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b.input_ids, b.position_ids, None, packed_seq_params=b.packed_seq_params())

        def loss_func(output):
            lp, _ = packed_response_log_probs(output, b, vocab_size=hf.vocab_size)
            loss = -(lp * b.loss_mask).sum() / b.loss_mask.sum()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    def one_step():
        """One optimizer step; returns (forward-backward seconds, optimizer seconds, grad norm)."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                         num_microbatches=len(batches), seq_length=args.tokens, micro_batch_size=1)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        ok, grad_norm, _ = optimizer.step()
        torch.cuda.synchronize()
        return t1 - t0, time.perf_counter() - t1, grad_norm

    times, parts = [], []
    for step in range(args.warmup + args.steps):
        fb, opt, grad_norm = one_step()
        if step >= args.warmup:
            times.append(fb + opt)
            parts.append((fb, opt))
        print(f"step {step}: {fb + opt:.3f} s (forward-backward {fb:.3f}, optimizer {opt:.3f}), grad norm {grad_norm}")
    step_s = sorted(times)[len(times) // 2]
    kernels = kernel_profile(one_step, args.profile) if args.profile else None
    tokens = args.micro_batches * args.tokens
    flops = 6.0 * matmul_params(hf) * tokens + attention_flops(hf, batches)
    impl = resolve_attention_impl(args.attention)
    result = dict(
        shape=args.shape, params_b=round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        tokens_per_step=tokens, micro_batches=args.micro_batches, tokens_per_micro_batch=args.tokens,
        sample_lengths=list(args.sample_lengths), recompute=args.recompute, fused_adam=args.fused_adam,
        compile=args.compile, rope="megatron's unfused" if args.unfused_rope else "packed (spec.packed_rotary_pos_emb)",
        median_step_s=round(step_s, 4),
        median_forward_backward_s=round(sorted(p[0] for p in parts)[len(parts) // 2], 4),
        median_optimizer_s=round(sorted(p[1] for p in parts)[len(parts) // 2], 4),
        tokens_per_s=round(tokens / step_s), tflops_per_s=round(flops / step_s / 1e12, 1),
        mfu=round(flops / step_s / 1e12 / PEAK_TFLOPS, 4),
        peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
        attention=impl if impl == "te" else packed_attention_path(torch.device("cuda"), torch.bfloat16),
        torch=torch.__version__, gpu=torch.cuda.get_device_name())
    if kernels:
        result["gpu_time_by_kernel_kind"] = kernels
    dist.destroy_process_group()
    return result


KERNEL_KINDS = [  # first match wins; names as CUDA kernels are reported on Hopper with torch 2.11
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas")),
    ("attention", ("flash", "fmha", "attn", "sdpa")),
    ("optimizer", ("adam", "foreach", "multi_tensor", "l2norm")),
    ("copy / cast", ("copy", "cast", "memcpy", "memset", "fill")),
    ("reduction", ("reduce", "softmax", "norm", "sum", "max")),
]


def kernel_profile(one_step, top: int) -> dict:
    """GPU time of one step by kind of kernel (share of the step's kernel time), and the ``top`` kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one_step()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in rows)
    kinds: Dict[str, float] = {}
    for e in rows:
        name = e.key.lower().replace("nocast", "")  # gpu_kernel_impl_nocast: elementwise, no cast
        kind = next((k for k, words in KERNEL_KINDS if any(w in name for w in words)), "other elementwise")
        kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total
    rows.sort(key=lambda e: -e.self_device_time_total)
    for e in rows[:top]:
        print(f"{e.self_device_time_total / 1e3:9.1f} ms {e.count:6d}x  {e.key[:110]}")
    return {"kernel_s": round(total / 1e6, 4),
            "share": {k: round(v / total, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}}


def _log_probs(model, batch, vocab, tp_group, pp: int):
    """Response log-probs of one packed batch (forward only, through megatron's pipeline schedule)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from slime_hydra.train.backends.megatron.logprobs import packed_response_log_probs

    got = []

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b.input_ids, b.position_ids, None, packed_seq_params=b.packed_seq_params())

        def loss_func(output):
            lp, _ = packed_response_log_probs(output, b, vocab_size=vocab, tp_group=tp_group)
            got.append(lp.float().cpu())
            return output.sum() * 0, {}

        return out, loss_func

    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]), model=[model],
                                    num_microbatches=1, seq_length=batch.num_tokens, micro_batch_size=1,
                                    forward_only=True)
    return got[0] if got else None


def compare(args) -> dict:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from slime_hydra.train.backends.megatron.convert import Layout, stage_shard
    from slime_hydra.train.backends.megatron.model import Parallel, build_gpt_model, transformer_config
    from slime_hydra.train.backends.megatron.weights import export_hf_state, load_hf_weights, model_chunks_state

    init_distributed()
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("--compare runs on 2 GPUs: torchrun --nproc_per_node 2 bench/megatron_gpu.py --compare")
    hf = hf_config(args.shape)
    batch = random_micro_batches(1, args.tokens, args.sample_lengths, hf.vocab_size, args.seed)[0].to("cuda")
    result, reference, hf_state = {}, None, None
    for tp, pp, sp in [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False)]:
        name = f"tp{tp}_pp{pp}" + ("_sp" if sp else "")
        parallel_state.initialize_model_parallel(tp, pp)
        model_parallel_cuda_manual_seed(args.seed)
        config = transformer_config(hf, Parallel(tp=tp, pp=pp, sequence_parallel=sp), dtype=torch.bfloat16)
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        model = build_gpt_model(hf, config, attention=args.attention, pre_process=pp_rank == 0,
                                post_process=pp_rank == pp - 1).cuda().eval()
        shard = stage_shard(config, tp_rank=tp_rank, pp_rank=pp_rank)
        layout = Layout.from_hf(hf, tp=tp)
        groups = dict(tp_group=parallel_state.get_tensor_model_parallel_group() if tp > 1 else None,
                      pp_group=parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None)
        if hf_state is None:  # TP = 1: its random weights, exported, are everyone's weights
            hf_state = export_hf_state(model_chunks_state([model], [shard]), layout)
        else:
            load_hf_weights([model], hf_state, layout, [shard])
            back = export_hf_state(model_chunks_state([model], [shard]), layout, **groups)
            exact = set(back) == set(hf_state) and all(torch.equal(back[k], hf_state[k]) for k in hf_state)
            result[f"{name}_export_bit_exact"] = exact
        lp = _log_probs(model, batch, hf.vocab_size, groups["tp_group"], pp)
        holder = [lp]
        dist.broadcast_object_list(holder, src=dist.get_world_size() - 1 if pp > 1 else 0)
        lp = holder[0]
        if reference is None:
            reference = lp
        else:
            diff = (lp - reference).abs()
            result[f"{name}_logprob_max_abs_diff"] = round(diff.max().item(), 5)
            result[f"{name}_logprob_mean_abs_diff"] = round(diff.mean().item(), 6)
        del model
        torch.cuda.empty_cache()
        parallel_state.destroy_model_parallel()
    if rank == 0:  # the transformers model on the same weights (what the rollout engines compute)
        from transformers import AutoModelForCausalLM

        with torch.device("cuda"):
            net = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
        net.load_state_dict({k: v for k, v in hf_state.items()}, strict=not hf.tie_word_embeddings)
        with torch.no_grad():
            lps = []
            for a, b, r in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist(), batch.response_lengths):
                ids = batch.input_ids[:, a:b]
                logp = torch.log_softmax(net(ids).logits[0].float(), -1)
                tgt = ids[0, 1:]
                lps.append(logp[:-1].gather(-1, tgt[:, None])[:, 0][-r:])
        diff = (torch.cat(lps).cpu() - reference).abs()
        result["transformers_logprob_max_abs_diff"] = round(diff.max().item(), 5)
        result["transformers_logprob_mean_abs_diff"] = round(diff.mean().item(), 6)
    result.update(shape=args.shape, tokens=args.tokens, scored_tokens=int(batch.targets.numel()))
    dist.destroy_process_group()
    return result if rank == 0 else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3_0_6b", help="a dense preset of conf/model/")
    p.add_argument("--tokens", type=int, default=4096, help="packed tokens per micro-batch")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--sample-lengths", type=lambda s: tuple(int(x) for x in s.split(":")), default=(256, 4096),
                   help="MIN:MAX tokens of the packed samples")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--attention", default="auto", help="auto | sdpa | te")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--no-varlen", action="store_true", help="packed attention: one SDPA call per sequence")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--fused-adam", action="store_true", help="torch's fused Adam kernel (as the trainer uses)")
    p.add_argument("--compile", action="store_true", help="trainer.compile: each decoder layer under torch.compile")
    p.add_argument("--unfused-rope", action="store_true",
                   help="megatron's own packed RoPE (a host sync per layer) instead of spec.packed_rotary_pos_emb")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="profile one more step: kernel kinds, top N")
    p.add_argument("--compare", action="store_true", help="the 2-GPU TP / PP log-prob comparison")
    p.add_argument("--out", help="also write the result as JSON here")
    args = p.parse_args()
    result = compare(args) if args.compare else throughput(args)
    if result:
        print(json.dumps(result, indent=1))
        if args.out:
            write_json(args.out, result)


if __name__ == "__main__":
    main()
