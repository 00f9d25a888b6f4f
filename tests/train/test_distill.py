"""SFT and on-policy distillation: the loss, its mask and the advantages against hand computations, the
teacher's scores through the embedded engine against its own forward pass, and the teacher rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import resolved
from slime_hydra.launch.validate import validate
from slime_hydra.train import algorithms as A


def test_sft_label_response_masks_the_prompt_and_the_loss_is_the_cross_entropy():
    from slime_hydra.data.sample import Sample
    from slime_hydra.data.tokenizer import load_tokenizer
    from slime_hydra.rollout.sft import label_response
    from slime_hydra.rollout.train_data import train_data
    from slime_hydra.train.batch import make_micro_batch

    algo = resolved(["algo=sft"]).algo
    tok = load_tokenizer("builtin:digits")
    samples = [label_response(Sample(prompt=p, label=y), tok, max_len=4) for p, y in (("3815=", "8"), ("12=", "21"))]
    prompt_ids = tok.encode("3815=", add_special_tokens=False)
    assert samples[0].tokens == prompt_ids + tok.encode("8", add_special_tokens=False) + [tok.eos_token_id]
    assert (samples[0].response_length, samples[1].response_length) == (2, 3)  # the label and end-of-sequence
    data, _ = train_data(samples, algo, 1)
    mb = make_micro_batch(data, [0, 1], 3)
    assert mb.response_start.tolist() == [len(prompt_ids), 3]  # the prompt is before the first scored token
    assert mb.loss_mask.tolist() == [[1, 1, 0], [1, 1, 1]]

    log_probs = torch.log_softmax(torch.randn(2, 3, 24), -1)[..., 5].requires_grad_()
    mask = mb.loss_mask
    adv, _ = A.compute_advantages(algo, rewards=torch.tensor(data["rewards"]), loss_mask=mask,
                                  old_log_probs=log_probs.detach())
    assert torch.equal(adv, mask)
    reducer = A.Reducer("token_mean", num_samples=2, num_tokens=5, max_len=3)
    loss, metrics = A.policy_loss(algo, reducer, log_probs=log_probs, old_log_probs=log_probs.detach(),
                                  advantages=adv, loss_mask=mask)
    by_hand = -(log_probs[0, :2].sum() + log_probs[1].sum()) / 5
    torch.testing.assert_close(loss, by_hand)
    loss.backward()
    torch.testing.assert_close(log_probs.grad, -mask / 5)  # the padding gets no gradient


def test_opd_advantage_is_the_negative_reverse_kl_plus_the_weighted_reward():
    algo = resolved(["algo=opd", "algo.normalize_advantages=false"]).algo  # the digits recipe whitens them
    g = torch.Generator().manual_seed(0)
    student, teacher = -torch.rand(4, 3, generator=g), -torch.rand(4, 3, generator=g)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    rewards = torch.tensor([1.0, -1.0, 0.5, 0.0])
    adv, _ = A.compute_advantages(algo, rewards=rewards, loss_mask=mask, old_log_probs=student,
                                  teacher_log_probs=teacher)
    torch.testing.assert_close(adv, (teacher - student) * mask)  # log p_teacher - log p_student, per token
    mixed = dataclasses.replace(algo, opd_reward_weight=0.5)
    adv, _ = A.compute_advantages(mixed, rewards=rewards, loss_mask=mask, old_log_probs=student,
                                  teacher_log_probs=teacher)
    torch.testing.assert_close(adv, (teacher - student + 0.5 * rewards[:, None]) * mask)


def test_teacher_log_probs_through_the_engine_equal_its_own_forward(tiny_ckpt):
    """SGLang's prompt log-probs (return_logprob, logprob_start_len, max_new_tokens=0) from the embedded engine
    are, bit for bit, the trainer-side teacher's scores of the same tokens."""
    from slime_hydra.config.schema import ModelConfig
    from slime_hydra.rollout.engines.embedded.engine import EmbeddedModel, Request, SamplingParams
    from slime_hydra.train.teacher import Teacher

    engine = EmbeddedModel(tiny_ckpt)
    teacher = Teacher(ModelConfig(name="t", path=tiny_ckpt), torch.device("cpu"), micro_batch_size=1)
    rows = [([5, 12, 3, 9, 4, 12], [7, 3, 1]), ([4, 4, 12], [9, 1])]
    for temperature in (1.0, 0.7):
        data = {"tokens": [p + r for p, r in rows], "response_lengths": [len(r) for _, r in rows],
                "loss_masks": [None, None]}
        own = teacher.log_probs(data, 3, temperature)
        reqs = [Request(p + r, SamplingParams(max_new_tokens=0, temperature=temperature), rid=str(i),
                        return_logprob=True, logprob_start_len=len(p)) for i, (p, r) in enumerate(rows)]
        for i, (out, (_, r)) in enumerate(zip(engine.generate(reqs), rows)):
            pairs = out["meta_info"]["input_token_logprobs"]
            assert [t for _, t, _ in pairs] == r and out["output_ids"] == []
            assert [lp for lp, _, _ in pairs] == own[i, :len(r)].tolist()
    # from position 0, as SGLang: the first token has no log-prob
    first = engine.generate([Request([5, 12, 3], SamplingParams(max_new_tokens=0), rid="z", return_logprob=True,
                                     logprob_start_len=0)])[0]["meta_info"]["input_token_logprobs"]
    assert first[0] == [None, 5, None] and len(first) == 3


def test_teacher_with_another_tokenizer_is_refused_naming_both(tiny_ckpt):
    errs = validate(resolved(["algo=opd", f"teacher.path={tiny_ckpt}", "teacher.tokenizer=builtin:calc"]))
    assert any(e.startswith("teacher.tokenizer:") and "builtin:calc" in e and "builtin:digits" in e for e in errs), errs
    assert validate(resolved(["algo=opd", f"teacher.path={tiny_ckpt}"])) == []
    assert any(e.startswith("teacher.path:") for e in validate(resolved(["algo=opd"])))
    assert any(e.startswith("teacher.path:") for e in validate(resolved([f"teacher.path={tiny_ckpt}"])))


@pytest.mark.parametrize("overrides, key", [
    (["algo=sft", "rollout.n_samples_per_prompt=4"], "rollout.n_samples_per_prompt"),
    (["algo=sft", "algo.policy_loss=ppo_clip"], "algo.policy_loss"),
    (["algo.opd_reward_weight=1.0"], "algo.opd_reward_weight"),
])
def test_sft_and_opd_rules(overrides, key):
    assert any(e.startswith(key + ":") for e in validate(resolved(overrides)))


def test_chat_rows_ending_with_the_assistant_turn_have_it_as_label():
    from slime_hydra.data.dataset import parse_row

    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    row = parse_row({"prompt": msgs}, "f.jsonl:1")
    assert (row.prompt, row.label) == (msgs[:1], "4")


def test_memory_plan_counts_the_teacher_on_gpus():
    from slime_hydra.plan.memory import GIB, estimate
    from slime_hydra.plan.params import param_count
    from slime_hydra.plan.resources import make_plan

    gpu = ["model=qwen3_0_6b", "data=jsonl", "data.path=tests/fixtures/tiny.jsonl", "eval.datasets=[]",
           "rollout=sglang", "parallelism=1gpu", "trainer.micro_batch_size=1"]
    cfg = resolved(["algo=opd", "+model@teacher=qwen3_4b", *gpu])
    trainer = estimate(cfg, make_plan(cfg)).trainer
    assert trainer["teacher"] == 2 * param_count(cfg.teacher.arch).total / GIB  # bfloat16 weights
    assert trainer["teacher_forward"] > 0
    assert "teacher" not in estimate(resolved(gpu), make_plan(resolved(gpu))).trainer
    errs = validate(resolved(["algo=opd", "teacher.path=Qwen/Qwen3-4B", *gpu]))  # no shape for the plan
    assert any(e.startswith("teacher.arch:") for e in errs), errs


def test_opd_with_a_model_parallel_megatron_trainer_is_refused():
    """The teacher beside the trainer is whole on every rank: megatron's TP ranks would each score the same rows."""
    gpu = ["model=qwen3_0_6b", "data=jsonl", "data.path=tests/fixtures/tiny.jsonl", "eval.datasets=[]",
           "rollout=sglang", "+model@teacher=qwen3_4b", "teacher.path=Qwen/Qwen3-4B", "algo=opd"]
    errs = validate(resolved([*gpu, "trainer=megatron", "parallelism=colocate_4gpu_tp2"]))
    assert any(e.startswith("parallelism.tensor_parallel:") and "tensor_parallel=2" in e for e in errs), errs
    dp_only = validate(resolved([*gpu, "trainer=megatron", "parallelism=colocate_4gpu",
                                 "parallelism.tensor_parallel=1"]))
    assert not any(e.startswith("parallelism.") for e in dp_only), dp_only
