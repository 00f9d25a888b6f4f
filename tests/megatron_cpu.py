"""megatron-core on CPU for tests, and tiny random models of every supported family.

megatron-core 0.16.1 assumes CUDA in a few places that a forward pass on CPU reaches (see
``shared/reference/environment.md``): the MoE router and its expert-bias buffer allocate on
``torch.cuda.current_device()``, and the all-to-all token dispatcher and shared experts create CUDA
streams. ``megatron_on_cpu`` points those at the CPU for the duration of a test module (these patches
belong here, never in the product) and sets up a one-process gloo group with TP = PP = 1.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Dict

import pytest
import torch
from torch.overrides import TorchFunctionMode

pytest.importorskip("megatron.core")

# Sizes chosen so that every rule is exercised (GQA with 2 groups, 4 experts, 2 layers with one dense
# layer in DeepSeek-V3) and TP = 2 / EP = 2 splits are possible, while each model builds in milliseconds.
_DENSE = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def tiny_hf_config(family: str):
    """A 2-layer transformers config of ``family`` (rope scaling on where the family has one)."""
    import transformers as tf

    if family == "qwen3":
        return tf.Qwen3Config(**_DENSE, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "llama":  # tied, and Llama 3.1's rope scaling
        return tf.LlamaConfig(**_DENSE, tie_word_embeddings=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192))
    if family == "glm4":
        return tf.Glm4Config(**_DENSE, pad_token_id=0, eos_token_id=1)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**_DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                 norm_topk_prob=True)
    if family == "deepseek_v3":  # MLA with YaRN; layer 0 dense, layer 1 MoE with a shared expert
        d = {k: v for k, v in _DENSE.items() if k != "head_dim"}
        return tf.DeepseekV3Config(
            **{**d, "num_key_value_heads": 4}, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=16,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                 original_max_position_embeddings=16, beta_fast=32, beta_slow=1, mscale=1.0,
                                 mscale_all_dim=1.0))
    raise ValueError(family)


FAMILIES = ("qwen3", "llama", "glm4", "qwen3_moe", "deepseek_v3")


def tiny_hf_model(family: str, seed: int = 0):
    """A random float32 HF model whose every weight matters: norms, biases and the router's score
    correction are drawn away from their neutral init, so that a mapping mistake shows in the logits."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(family), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.2 if "bias" in name else 0.1)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.1)
    return model


def saved_checkpoint(model, path: str) -> Dict[str, torch.Tensor]:
    """Save ``model`` as a sharded safetensors checkpoint (with an index) and return its tensors by name."""
    from slime_hydra.train.backends.megatron.convert import HFCheckpoint

    model.save_pretrained(path, max_shard_size="40KB")
    ck = HFCheckpoint(path)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json")), "expected a sharded checkpoint"
    return {k: ck[k] for k in ck}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _NoStream:
    """Stands in for a CUDA stream / event: megatron only waits on and records them."""

    def __new__(cls, *args, **kwargs):
        return _NO_STREAM

    def wait_stream(self, other):
        pass

    def record_event(self, *args):
        return self

    def synchronize(self):
        pass


_NO_STREAM = object.__new__(_NoStream)


@contextlib.contextmanager
def cuda_on_cpu():
    """megatron's CUDA assumptions pointed at the CPU, undone on exit."""
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    mp.setattr(torch.cuda, "Stream", _NoStream)
    mp.setattr(torch.cuda, "current_stream", lambda *a, **k: _NO_STREAM)
    mp.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    try:
        yield
    finally:
        mp.undo()


class _CudaTensorsOnCpu(TorchFunctionMode):
    """megatron's optimizer makes its loss-scale tensors with ``device='cuda'``: make them on the CPU; and
    the distributed optimizer accepts only ``torch.cuda.*Tensor`` parameters: CPU tensors say they are
    (and ``.cuda()`` leaves them where they are)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and out.startswith("torch."):
            out = out.replace("torch.", "torch.cuda.", 1)
        return out


@contextlib.contextmanager
def trainer_on_cpu():
    """:func:`cuda_on_cpu` plus what megatron's optimizers and dist_checkpointing's writer assume
    (CUDA tensors, ``torch.cuda.synchronize``): for a whole trainer backend on the CPU."""
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    try:
        with cuda_on_cpu(), _CudaTensorsOnCpu():
            yield
    finally:
        mp.undo()


@contextlib.contextmanager
def megatron_on_cpu():
    """A one-process gloo group and megatron's parallel state with TP = PP = 1, on the CPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    with cuda_on_cpu():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def megatron_model(hf_config, tp: int = 1, **overrides):
    """A float32 megatron GPTModel for ``hf_config`` (this process's TP rank, PP = 1) with the SDPA
    spec, in eval mode."""
    from slime_hydra.train.backends.megatron.model import Parallel, build_gpt_model, transformer_config

    # torch.compile'd fusions cost seconds of compilation on CPU and compute the same thing
    overrides = {"bias_activation_fusion": False, "bias_dropout_fusion": False, **overrides}
    tc = transformer_config(hf_config, Parallel(tp=tp), dtype=torch.float32, cpu_init=True, overrides=overrides)
    return build_gpt_model(hf_config, tc, attention="sdpa", pp_rank=0).eval()
