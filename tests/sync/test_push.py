"""The order of a colocated weight push (slime_hydra/sync/push.py) and where the plan pushes before offloading."""

from __future__ import annotations

import pytest

from conftest import resolved


@pytest.mark.parametrize("push_first", [True, False])
def test_push_before_offload_moves_the_weights_after_the_push(monkeypatch, push_first):
    """The order of a colocated push with both offloads (the calls only: test_e2e's colocated CPU runs make
    them for real): with ``push_first`` the trainer's optimizer state goes, the engines take back their
    weights' memory, the push reads the trainer's GPU weights, then the trainer's weights go and the engines
    take back their KV cache; without, the trainer goes to the host whole before the push."""
    from slime_hydra.sync import push

    calls = []

    class Call:
        def __init__(self, name):
            self.name = name

        def remote(self, *args):
            calls.append(self.name)

    class Manager:
        onload_weights, onload_kv = Call("engines: weights"), Call("engines: kv cache")

    class Trainers:
        def offload(self, keep_weights=False):
            calls.append("trainer: optimizer state" if keep_weights else "trainer: weights and state")

        def update_weights(self, version):
            calls.append("push")
            return {"seconds": 0.0}

    monkeypatch.setattr(push.ray, "get", lambda ref: ref)
    push.push_weights(Manager(), Trainers(), 1, push.Offload(trainer=True, engines=True, push_first=push_first))
    if push_first:
        assert calls == ["trainer: optimizer state", "engines: weights", "push", "trainer: weights and state",
                         "engines: kv cache"]
    else:
        assert calls == ["trainer: weights and state", "engines: weights", "push", "engines: kv cache"]


def test_push_before_offload_is_chosen_where_its_phase_fits():
    """The 4B shape with megatron on one 141 GiB GPU: the push phase (the trainer's bf16 weights beside the
    engine's) fits, so the plan pushes before the offload; the phase
    shows in the estimate. Set to false, it stays false; without offload_train there is no such phase."""
    from slime_hydra.plan.memory import PUSH_PHASE, estimate
    from slime_hydra.plan.resources import make_plan

    shape = ["model=qwen3_4b", "trainer=megatron", "rollout=sglang", "parallelism=1gpu", "rollout.batch_size=8",
             "rollout.n_samples_per_prompt=8", "rollout.max_response_len=256", "rollout.max_prompt_len=64"]
    cfg = resolved(shape)
    p = cfg.parallelism
    assert (p.offload_train, p.offload_rollout, p.push_before_offload) == (True, True, True)
    gpus = estimate(cfg, make_plan(cfg)).gpus
    assert 15 < gpus[PUSH_PHASE] < gpus["colocated GPU, training"]  # 7.5 + 7.5 GiB of weights, 1 of buckets
    assert resolved([*shape, "parallelism.push_before_offload=false"]).parallelism.push_before_offload is False
    none = resolved([*shape, "parallelism.offload_train=false", "parallelism.offload_rollout=true"])
    assert none.parallelism.push_before_offload is False
    assert PUSH_PHASE not in estimate(none, make_plan(none)).gpus
    assert resolved(["parallelism=cpu_colocate"]).parallelism.push_before_offload is True  # CPU: the GPU's order
