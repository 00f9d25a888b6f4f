"""LoRA through PEFT on the torch backend (slime_hydra/train/backends/torch/lora.py), in process on the tiny
model: only the adapters train, the reference is the base with the adapters off, the engines get
``W + scale B A`` per layer (= PEFT's own ``merge_and_unload``), and the checkpoint's adapter loads with
``PeftModel.from_pretrained`` and resumes with its AdamW state."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from tiny_trainer import config, fake_rollout, rl_trainer, train

from conftest import resolved

LORA = ("trainer.num_rollout=10", "trainer.lora.rank=4", "trainer.lora.alpha=8", "algo.lr=1e-2",
        "algo.kl_loss_coef=0.1")


def _trained(tiny_ckpt, *extra, steps: int = 3):
    cfg = config(*LORA, *extra)
    rl, be = rl_trainer(cfg, tiny_ckpt)
    base0 = {k: v.detach().clone() for k, v in be.model.state_dict().items() if ".lora_" not in k}
    lora0 = {k: v.detach().clone() for k, v in be.model.state_dict().items() if ".lora_" in k}
    for i in range(steps):
        train(rl, cfg, fake_rollout(8, seed=i))
    return cfg, rl, be, base0, lora0


def test_only_the_adapters_train_and_the_reference_is_the_base(tiny_ckpt):
    """After three steps the base weights are bitwise the checkpoint's, every adapter moved, only adapters
    have gradients and AdamW state, and the reference log-probs are the untouched base model's."""
    from transformers import AutoModelForCausalLM

    cfg, rl, be, base0, lora0 = _trained(tiny_ckpt)
    now = be.model.state_dict()
    assert base0 and all(torch.equal(now[k], v) for k, v in base0.items())
    assert lora0 and all(not torch.equal(now[k], v) for k, v in lora0.items() if ".lora_B." in k)
    assert all(not torch.equal(now[k], v) for k, v in lora0.items() if ".lora_A." in k)
    trainable = {n for n, p in be.model.named_parameters() if p.requires_grad}
    assert trainable == {k for k in lora0}
    assert len(be.opt.state) == len(trainable) and be.ref_state is None  # no copy of the base for the KL
    assert all(p.grad is None for n, p in be.model.named_parameters() if n not in trainable)

    base = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    mbs = be.micro_batches(fake_rollout(6), list(range(6)), 3)
    ref = be.log_probs(mbs, 1.0, reference=True)
    assert not torch.allclose(ref, be.log_probs(mbs, 1.0))
    from slime_hydra.train.batch import response_log_probs

    with torch.no_grad():
        want = torch.cat([response_log_probs(base(input_ids=mb.input_ids, position_ids=(
            mb.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits, mb, 1.0)[0] for mb in mbs])
    mask = torch.cat([mb.loss_mask for mb in mbs]).bool()  # (padding positions are never read)
    torch.testing.assert_close(ref[mask], want[mask], rtol=0, atol=1e-6)


def test_pushed_weights_are_merged_per_layer_and_match_peft_merge(tiny_ckpt):
    """What the engines get: Hugging Face names (no ``base_model.model.``, ``.base_layer``, adapters),
    each adapted weight ``W + (alpha / r) B A``, the rest the base; equal to PEFT's ``merge_and_unload``
    of a copy, and the policy itself is never merged."""
    cfg, rl, be, base0, _ = _trained(tiny_ckpt)
    pushed = dict(be.hf_weights())
    from transformers import AutoModelForCausalLM

    names = list(dict(AutoModelForCausalLM.from_pretrained(tiny_ckpt).state_dict()))
    assert sorted(pushed) == sorted(n for n in names if n != "lm_head.weight")  # tied: the embedding once
    scale = 8 / 4
    adapted = 0
    for name, layer in be.model.base_model.model.named_modules():
        if hasattr(layer, "lora_A") and "default" in layer.lora_A:
            w = layer.base_layer.weight.detach()
            a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
            torch.testing.assert_close(pushed[f"{name}.weight"], w + scale * (b @ a), rtol=0, atol=1e-7)
            assert not torch.equal(pushed[f"{name}.weight"], w)
            adapted += 1
    assert adapted == 3 * 7  # q k v o gate up down in each of the 3 layers
    merged = copy.deepcopy(be.model).merge_and_unload().state_dict()
    for name, w in pushed.items():
        torch.testing.assert_close(w, merged[name], rtol=0, atol=1e-7, msg=name)
    assert all(torch.equal(be.model.state_dict()[k], v) for k, v in base0.items())  # nothing merged in place


def test_checkpoint_adapter_loads_in_peft_and_resumes(tiny_ckpt, tmp_path):
    """``adapter/`` is PEFT's format (``PeftModel.from_pretrained`` on the base gives the policy's
    weights); with ``save_merged`` ``hf/`` is the merged model; a resumed backend has the adapters and
    AdamW state and takes the same next step as the one that saved."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, rl, be, _, _ = _trained(tiny_ckpt, "trainer.lora.save_merged=true")
    out = str(tmp_path / "ckpt")
    os.makedirs(out)
    be.export_hf(os.path.join(out, "hf"), None)
    be.save(out, rl.state_dict())
    assert sorted(os.listdir(out)) == ["adapter", "hf", "trainer.pt"]
    pushed = dict(be.hf_weights())

    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_ckpt), os.path.join(out, "adapter"))
    for name, w in peft.merge_and_unload().state_dict().items():
        if name in pushed:
            torch.testing.assert_close(w, pushed[name], rtol=0, atol=1e-7, msg=name)
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf")).state_dict()
    for name, w in pushed.items():
        torch.testing.assert_close(hf[name], w, rtol=0, atol=0, msg=name)

    rl2, be2 = rl_trainer(cfg, tiny_ckpt)
    rl2.load_state_dict(be2.load(out))
    assert rl2.state_dict() == rl.state_dict()
    for (n, p), (_, q) in zip(be.model.named_parameters(), be2.model.named_parameters()):
        assert torch.equal(p, q), n
    data = fake_rollout(8, seed=7)
    m1, m2 = train(rl, cfg, data), train(rl2, cfg, data)
    for key in ("pg_loss", "kl_loss", "grad_norm", "lr"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-6, abs=1e-9), key
    for (n, p), (_, q) in zip(be.model.named_parameters(), be2.model.named_parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-7, msg=n)  # AdamW's moments came back too


def test_without_save_merged_the_checkpoint_is_the_adapter(tiny_ckpt, tmp_path):
    cfg, rl, be, _, _ = _trained(tiny_ckpt, steps=1)
    out = str(tmp_path / "ckpt")
    os.makedirs(out)
    be.export_hf(os.path.join(out, "hf"), None)
    be.save(out, rl.state_dict())
    assert sorted(os.listdir(out)) == ["adapter", "trainer.pt"]
    files = os.listdir(os.path.join(out, "adapter"))
    assert "adapter_config.json" in files and "adapter_model.safetensors" in files
    full = config("trainer.num_rollout=10")
    with pytest.raises(FileNotFoundError, match="no hf"):
        rl_trainer(full, tiny_ckpt)[1].load(out)


def test_default_target_modules_per_family():
    from slime_hydra.train.backends.torch.lora import LORA_TARGET_MODULES, hf_name

    assert LORA_TARGET_MODULES["qwen3"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"]
    assert "gate_up_proj" in LORA_TARGET_MODULES["glm4"]
    assert hf_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight") == \
        "model.layers.0.mlp.up_proj.weight"


def test_tiny_lora_count_matches_the_backend(tiny_ckpt):
    """The estimate's adapter count is what the backend trains on the tiny model."""
    from tiny_trainer import backend

    from slime_hydra.plan.params import lora_params

    cfg = resolved(["trainer.lora.rank=4", "trainer.num_rollout=10"])
    be = backend(cfg, tiny_ckpt)
    assert lora_params(cfg) == sum(p.numel() for p in be.model.parameters() if p.requires_grad)
    assert all(p.dtype == torch.float32 for p in be.model.parameters() if p.requires_grad)


@pytest.mark.parametrize("overrides, needle", [
    (["trainer=megatron", "parallelism.device=cuda", "trainer.lora.rank=16"],
     "trainer.lora.rank: LoRA runs on the torch backend only (trainer.backend='megatron' has no adapters)"),
    (["trainer=megatron", "parallelism.device=cuda", "trainer.strategy=fsdp"], "trainer.strategy: 'fsdp'"),
    (["trainer.strategy=zero3"], "trainer.strategy"),
    (["trainer.fsdp_cpu_offload=true"], "trainer.fsdp_cpu_offload: needs trainer.strategy=fsdp on GPUs"),
    (["algo=ppo", "trainer.lora.rank=8"], "trainer.lora.rank: PPO's critic is trained with DDP and full weights"),
    (["algo=ppo", "trainer.strategy=fsdp"], "trainer.strategy: PPO's critic"),
    (["trainer.lora.rank=-1"], "trainer.lora.rank: must be >= 0"),
    (["trainer.lora.rank=8", "trainer.lora.push=adapter"], "trainer.lora.push"),
    (["trainer.lora.rank=8", "trainer.lora.target_modules=[]"], "trainer.lora.target_modules: an empty list"),
    (["trainer.lora.rank=8", "trainer.lora.dropout=1.5"], "trainer.lora.dropout"),
    (["trainer.lora.rank=8", "trainer.lora.target_modules=[embed_tokens,q_proj]"],
     "trainer.lora.target_modules: 'embed_tokens' is the token embedding"),
    (["trainer.lora.rank=8", "trainer.lora.target_modules=[q_proj,lm_head]"],
     "trainer.lora.target_modules: 'lm_head' is the LM head"),
    (["trainer.lora.rank=8", "trainer.lora.target_modules=[q_prj]"],
     "trainer.lora.target_modules: 'q_prj' names no linear layer (did you mean 'q_proj'?)"),
    (["trainer.lora.rank=8", "trainer.lora.target_modules=[q_proj,v_prj,gate_poj]"],
     "'v_prj' names no linear layer (did you mean 'v_proj'?); 'gate_poj' names no linear layer (did you mean "
     "'gate_proj'?). Only the linear projections are supported: q_proj, k_proj"),
    (["trainer.lora.rank=8", "trainer.lora.target_modules=[gate_up_proj]"], "'gate_up_proj' names no linear layer"),
])
def test_validation_names_the_key(overrides, needle):
    from slime_hydra.train.rules import check

    errs = check(resolved(["trainer.num_rollout=10", *overrides]))
    assert any(needle in e for e in errs), errs


def test_valid_fsdp_and_lora_configs_pass():
    from slime_hydra.train.rules import check

    for extra in (["trainer.strategy=fsdp"], ["trainer.lora.rank=8"], ["trainer.strategy=fsdp", "trainer.lora.rank=8",
                                                                       "trainer.lora.target_modules=[q_proj,v_proj]"],
                  ["trainer.lora.rank=8", "trainer.lora.target_modules=[self_attn.q_proj,mlp.down_proj]"]):
        assert check(resolved(["trainer.num_rollout=10", *extra])) == []


def _tiny_model(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)


@pytest.mark.parametrize("targets, needles", [
    (["q_prj"], ["'q_prj' names no linear layer (did you mean 'q_proj'?)"]),  # PEFT: NoMatchingPeftModuleError
    (["q_proj", "v_prj", "gate_poj"], ["'v_prj'", "did you mean 'v_proj'?", "did you mean 'gate_proj'?"]),
    (["embed_tokens", "q_proj"], ["'embed_tokens' is the token embedding"]),
    (["lm_head"], ["'lm_head' is the LM head"]),
])
def test_wrap_refuses_names_that_match_no_linear_layer(tiny_ckpt, targets, needles):
    """The wrap (past validation: a model whose arch the preset does not describe) checks the names against
    the model: each must match a linear layer, else one error naming the key, the names it has, a suggestion."""
    from slime_hydra.config.schema import LoraConfig
    from slime_hydra.train.backends.torch.lora import lora_layers, wrap

    with pytest.raises(ValueError) as e:
        wrap(_tiny_model(tiny_ckpt), LoraConfig(rank=4, target_modules=targets), "qwen3")
    msg = str(e.value)
    assert msg.startswith("trainer.lora.target_modules: ")
    assert "linear projections are supported: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in msg
    assert all(n in msg for n in needles), msg
    wrapped = wrap(_tiny_model(tiny_ckpt), LoraConfig(rank=4, target_modules=["self_attn.q_proj", "v_proj"]),
                   "qwen3")
    assert {n.rpartition(".")[2] for n in lora_layers(wrapped)} == {"q_proj", "v_proj"}


@pytest.mark.parametrize("targets, needle", [
    (["embed_tokens", "q_proj"], "are not linear layers"),  # PEFT's Embedding: lora_embedding_A/B, no lora_A
    (["lm_head", "q_proj"], "have no weight of their own"),  # tied: the state holds the embedding's weight once
])
def test_merged_push_refuses_layers_it_cannot_merge(tiny_ckpt, targets, needle):
    """A LoRA layer the merge cannot handle (wrapped by PEFT directly, past the checks) raises rather than
    sending the engines its base weight without the adapter."""
    from peft import LoraConfig, get_peft_model

    from slime_hydra.train.backends.torch import fsdp
    from slime_hydra.train.backends.torch.lora import hf_model, merged_weights

    model = get_peft_model(_tiny_model(tiny_ckpt), LoraConfig(r=4, target_modules=targets))
    assert model.config.tie_word_embeddings
    with pytest.raises(RuntimeError, match=needle) as e:
        list(merged_weights(model, fsdp.unique_state(hf_model(model)), lambda t: t))
    assert "lm_head" in str(e.value) or "embed_tokens" in str(e.value)


def test_linear_module_table_matches_the_transformers_models():
    """``LORA_LINEAR_MODULES`` (what validation accepts) is every linear layer name of each family, over its
    variants, LM head left out; the family defaults are among them. Built on the meta device from the presets."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from slime_hydra.config.schema import ARCH_TYPES, ArchConfig
    from slime_hydra.model.hf import hf_config
    from slime_hydra.train.backends.torch.lora import LORA_LINEAR_MODULES, LORA_TARGET_MODULES

    small = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    mla = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
               num_shared_experts=1, first_k_dense_layers=1)
    variants = {"qwen3": [{}], "qwen2": [{}], "llama": [{}], "glm4": [{}], "qwen3_moe": [moe],
                "deepseek_v3": [{**moe, **mla, "q_lora_rank": 16}, {**moe, **mla}]}  # q_lora_rank null: q_proj
    assert sorted(variants) == sorted(ARCH_TYPES) == sorted(LORA_LINEAR_MODULES)

    for arch_type, kinds in variants.items():
        names = set()
        for extra in kinds:
            arch = dataclasses.replace(ArchConfig(type=arch_type, **small), **extra)
            mla_q = {"q_lora_rank": arch.q_lora_rank} if arch_type == "deepseek_v3" else {}  # None: HF's default
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(hf_config(arch, pad_token_id=0, **mla_q))
            names |= {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        assert names - {"lm_head"} == set(LORA_LINEAR_MODULES[arch_type]), arch_type
        assert set(LORA_TARGET_MODULES[arch_type]) <= names, arch_type
