"""The same seed gives the same run: each sample's ``sampling_seed`` comes from the run seed, its
rollout and its index, the engine samples every request from its own stream, and the CPU trainer
is deterministic, so batching and timing cannot change what a run computes."""

from __future__ import annotations

import asyncio
import copy
import functools
from types import SimpleNamespace

import pytest

from runs import metrics, run
from slime_hydra.data.sample import Sample
from slime_hydra.rollout.generate import GenerateContext, generate, sampling_seed, seeded


class Engine:
    async def post(self, path, payload):
        self.payload = copy.deepcopy(payload)
        return {
            "text": "9",
            "output_ids": [11],
            "meta_info": {"output_token_logprobs": [[-0.3, 11, None]], "finish_reason": {"type": "stop"}},
        }


def _ctx(seed):
    from slime_hydra.data.tokenizer import builtin_tokenizer

    return GenerateContext(
        cfg=SimpleNamespace(rollout=SimpleNamespace(seed=seed)),
        tokenizer=builtin_tokenizer("builtin:digits"),
        client=Engine(),
    )


def test_each_sample_gets_its_own_seed():
    """The seed depends on the run seed, the rollout that first sampled the sample and its index;
    greedy requests and requests that carry a seed are left alone."""
    ctx = _ctx(1234)
    s = Sample(prompt="3815=", index=7, metadata={"start_rollout_id": 3})
    asyncio.run(generate(ctx, s, {"max_new_tokens": 4, "temperature": 1.0}))
    seed = ctx.client.payload["sampling_params"]["sampling_seed"]
    assert seed == sampling_seed(1234, 3, 7) and 0 <= seed < 2**31
    others = {
        sampling_seed(1235, 3, 7),
        sampling_seed(1234, 4, 7),
        sampling_seed(1234, 3, 8),
        sampling_seed(1234, "eval", 7),
    }
    assert seed not in others and len(others) == 4
    assert "sampling_seed" not in seeded(ctx, s, {"temperature": 0.0}, False)
    assert seeded(ctx, s, {"sampling_seed": 5}, False) == {"sampling_seed": 5}
    assert seeded(ctx, s, {}, True)["sampling_seed"] == sampling_seed(1234, "eval", 7)


@pytest.mark.integration
def test_one_request_per_group_samples_what_one_request_per_sample_does(engine_url):
    """The default generate function sends each group in one batched /generate; a custom one sends
    one request per sample. Against the same engine, with the same seeds, both make the same samples
    (tokens, log-probs, rewards), training and evaluation alike."""
    from rollout_harness import make_rollout
    from slime_hydra.rollout.client import GenerateClient

    async def per_sample(ctx, s, sp, evaluation=False):  # not the default function: one request per sample
        return await generate(ctx, s, sp, evaluation)

    from slime_hydra.rollout.sampling import sampling_params

    def groups(custom):
        m = make_rollout(["rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.max_response_len=6",
                          "eval.datasets=[{name: heldout, n_samples_per_prompt: 4, temperature: 1.0, max_prompts: 2}]"],
                         urls=[engine_url])
        if custom:
            m.set_generate(per_sample)
        held = m.evaluator.sets["heldout"]

        async def both():
            m.ctx.sampler.ctx.client = GenerateClient(engine_url, 64)
            try:
                train, _ = await m.collect(rollout_id=3)
                sp = sampling_params(m.cfg.rollout, held.cfg)
                evals = await asyncio.gather(*(m.ctx.sampler.group(g, sp, True) for g in held.groups()))
                return train + evals, m.ctx.sampler.ctx.requests
            finally:
                await m.ctx.sampler.ctx.client.aclose()

        return asyncio.run(both())

    (batched, requests), (single, single_requests) = groups(custom=False), groups(custom=True)
    assert (requests, single_requests) == (6, 24)  # 4 training groups and 2 eval groups of 4 samples
    flat = [(s, t) for a, b in zip(batched, single, strict=True) for s, t in zip(a, b, strict=True)]
    assert sum(s.response_length for s, _ in flat) > len(flat)  # more than one token each, on the whole
    for s, t in flat:
        assert (s.index, s.tokens, s.status, s.reward) == (t.index, t.tokens, t.status, t.reward)
        assert s.rollout_log_probs == t.rollout_log_probs  # exactly: the logits do not depend on the batch


@pytest.mark.integration
@pytest.mark.slow  # 56 s; the fast short chaos run (tests/launch/test_heal.py) compares two runs row by row too
def test_same_seed_same_run(tmp_path):
    """Two short runs of the default with the same seed write the same metrics.jsonl, but for the
    timings (perf/, startup/) and the engine-vs-trainer log-prob gap (float noise that depends on the batch)."""
    args = [
        "trainer.num_rollout=6",
        "eval.interval=3",
        "logging.progress=false",
        "logging.backends=[]",
        "trainer.save_interval=0",
    ]
    rows = [metrics(d) for d in (tmp_path / "a", tmp_path / "b") if run(d, *args)]
    keep = [k for k in rows[0][1]
            if not k.startswith(("perf/", "startup/")) and k != "train/train_rollout_logprob_abs_diff"]
    assert "rollout/reward_mean" in keep and "eval/heldout/reward" in rows[0][3]
    assert sum(r["rollout/response_len_mean"] for r in rows[0][1:]) > 0  # tokens were sampled
    for a, b in zip(*rows, strict=True):
        assert {k: a.get(k) for k in keep + ["eval/heldout/reward"]} == {
            k: b.get(k) for k in keep + ["eval/heldout/reward"]
        }


class CalcEngine:
    """An engine stub for the calculator agent: calls the tool, then answers 6; records each request."""

    def __init__(self):
        self.payloads = []

    async def post(self, path, payload):
        self.payloads.append(copy.deepcopy(payload))
        token = 23 if len(self.payloads) % 2 else 8  # <call>, then "6"
        return {"text": "", "output_ids": [token],
                "meta_info": {"output_token_logprobs": [[-0.5, token, None]], "finish_reason": {"type": "length"}}}


@pytest.mark.parametrize("evaluation", [False, True])
def test_every_turn_of_a_custom_generate_function_is_seeded(evaluation):
    """A custom generate function (here the multi-turn calculator agent, one request per turn) gets
    the sample's ``sampling_seed`` too: without it the engine drew every turn from its shared
    generator, so what a run sampled depended on how requests were batched, and runs with one seed
    differed."""
    from examples.calculator.direct import generate as agent_generate
    from slime_hydra.config.schema import RewardConfig
    from slime_hydra.data.tokenizer import builtin_tokenizer
    from slime_hydra.rollout.sampling import GroupSampler

    ctx = GenerateContext(cfg=SimpleNamespace(rollout=SimpleNamespace(seed=1234)),
                          tokenizer=builtin_tokenizer("builtin:calc"), client=CalcEngine())
    generate_fn = functools.partial(agent_generate, turn_max_tokens=1)
    sampler = GroupSampler(generate_fn, ctx, RewardConfig(type="custom", custom="examples.calculator.direct.reward"))
    s = Sample(prompt="12*13-150", label="6", index=7)
    sp = {"max_new_tokens": 12, "temperature": 1.0}
    out = asyncio.run(sampler.sample(s, sp, evaluation, rollout_id=3))
    assert out.reward == 1.0 and out.metadata["num_turns"] == 2
    seeds = [p["sampling_params"]["sampling_seed"] for p in ctx.client.payloads]
    assert seeds == [sampling_seed(1234, "eval" if evaluation else 3, 7)] * 2


def test_the_embedded_engine_samples_what_it_would_whatever_the_batch(tiny_ckpt, request):
    """A request's tokens and log-probs are bit for bit the same alone, in a small batch and in a large one of
    prompts of other lengths: the engine's logits do not depend on the batch (embedded/engine.py,
    CPU_MIN_ROWS). They did, by up to 1.8e-7 between a batch of 1 and one of 33, which now and then changed
    a sampled token and so a run (the calculator agent's learning test failed so under load). With one torch
    thread, as the engine's server runs by default (``parallelism.cpu_threads``): with two, on an AVX2 machine
    (AMD EPYC, no AVX-512), log-probs still moved with the batch by about 2e-7."""
    import random

    import torch

    from slime_hydra.rollout.engines.embedded.engine import EmbeddedModel, Request, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server's torch.set_num_threads(parallelism.cpu_threads)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    engine = EmbeddedModel(tiny_ckpt, dtype="float32", seed=0)
    rng = random.Random(0)

    def req(i, n_tokens):
        ids = [rng.randrange(2, engine.vocab_size) for _ in range(n_tokens)]
        params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, sampling_seed=1000 + i)
        return Request(input_ids=ids, params=params, rid=f"r{i}", return_logprob=True)

    mine = [req(i, 6) for i in range(3)]
    others = [req(10 + i, rng.randint(2, 20)) for i in range(37)]
    alone = [engine.generate([r])[0] for r in mine]
    small = engine.generate(mine)
    large = engine.generate(others[:20] + mine + others[20:])[20:23]
    for a, b, c in zip(alone, small, large, strict=True):
        assert a["output_ids"] == b["output_ids"] == c["output_ids"]
        lps = [[lp for lp, _, _ in x["meta_info"]["output_token_logprobs"]] for x in (a, b, c)]
        assert lps[0] == lps[1] == lps[2]  # exactly
