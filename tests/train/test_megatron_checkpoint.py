"""The megatron backend's checkpoints (``megatron.core.dist_checkpointing``, torch_dist) on CPU and gloo:

- a resume in the same layout restores every tensor bit for bit (weights, the optimizer's main weights
  and Adam moments, the reference weights, the RNG) and the step count, and the next optimizer step
  gives the same weights as the run that was not interrupted; with the distributed optimizer and
  without it;
- re-sharding: a checkpoint saved by two ranks at TP = 2, PP = 2 or DP = 2 and resumed on one rank gives the
  saving run's log-probs, and after one more optimizer step on each side, the same log-probs again
  (so the Adam moments were re-sharded too); EP = 2 resumed at EP = 1 exports the same weights;
- a checkpoint of the earlier per-rank format is refused with an error naming its file.

megatron's CUDA assumptions are pointed at the CPU by ``tests/megatron_cpu.py`` (tests only)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from megatron_cpu import free_port, saved_checkpoint, tiny_hf_model, trainer_on_cpu  # skips without megatron
from train.tiny_trainer import fake_rollout

from conftest import resolved

TRAINER_STATE = {"steps_done": 1, "rollouts_done": 1}


def _cfg(*overrides: str):
    return resolved(["trainer=megatron", "algo.kl_loss_coef=0.1", "algo.lr=1e-2", "algo.clip_grad=1e9",
                     "trainer.max_tokens_per_micro_batch=20", *overrides])


@contextlib.contextmanager
def _backend(cfg, path: str, rank: int = 0, world_size: int = 1):
    """A megatron backend on the CPU, its parallel state (and a one-rank process group) torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from slime_hydra.train.backend import BACKENDS

    own_group = not dist.is_initialized()
    with trainer_on_cpu():
        be = BACKENDS["megatron"](model=cfg.model, algo=cfg.algo, trainer=cfg.trainer,
                                      parallelism=cfg.parallelism, model_path=path, rank=rank,
                                      world_size=world_size, device=torch.device("cpu"))
        try:
            yield be
        finally:
            parallel_state.destroy_model_parallel()
            if own_group:
                dist.destroy_process_group()


def _loss(data, share: float = 1.0):
    """``share`` of a loss of the log-probs and entropies of the sampled tokens (weights of both signs)."""
    T = max(data["response_lengths"])
    mask = torch.tensor([[float(t < r) for t in range(T)] for r in data["response_lengths"]])
    weights = torch.linspace(-1.0, 1.0, len(data["tokens"]))

    def loss_fn(idx, lp, ent):
        m = mask[list(idx)]
        loss = share * ((lp * weights[list(idx), None] - 0.01 * ent) * m).sum() / mask.sum()
        return loss, {"loss": loss.detach()}

    return loss_fn


def _step(be, data) -> None:
    """An optimizer step on ``data``; data-parallel ranks all get the whole of it, each a 1 / DP share of
    the loss (the backend sums the ranks' shares), so the step is the one-rank step."""
    rows, T = list(range(len(data["tokens"]))), max(data["response_lengths"])
    be.train_step(be.micro_batches(data, rows, T), 0.7, _loss(data, 1 / be.dp_size))


def _log_probs(be, data) -> torch.Tensor:
    rows, T = list(range(len(data["tokens"]))), max(data["response_lengths"])
    return be.log_probs(be.micro_batches(data, rows, T), 0.7)


def _tensors(be):
    """Everything a resume restores, by name: weights, the optimizer's tensors, reference weights, RNG."""
    out = {f"param{i}": p.detach().clone() for i, p in enumerate(be._params())}
    for j, o in enumerate(be._inner_optimizers()):
        inner = o.optimizer
        for g, group in enumerate(inner.param_groups):
            for i, p in enumerate(group["params"]):
                out[f"opt{j}.group{g}.main{i}"] = p.detach().clone()
                for k, v in inner.state.get(p, {}).items():
                    out[f"opt{j}.group{g}.{k}{i}"] = torch.as_tensor(v).clone()
    out.update({f"ref{i}": t.clone() for i, t in enumerate(be.ref_state)})
    out["rng"] = torch.get_rng_state()
    return out


def _tiny_checkpoint(tmp_path_factory, family: str) -> str:
    path = str(tmp_path_factory.mktemp(family))
    saved_checkpoint(tiny_hf_model(family), path)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _tiny_checkpoint(tmp_path_factory, "qwen3")


@pytest.mark.parametrize("family, distributed_optimizer", [("qwen3", True), ("qwen3", False), ("llama", True),
                                                           ("glm4", True), ("qwen3_moe", True),
                                                           ("deepseek_v3", True)])
@pytest.mark.integration
def test_resume_restores_every_tensor(tmp_path_factory, tmp_path, family, distributed_optimizer):
    ckpt = _tiny_checkpoint(tmp_path_factory, family)
    cfg = _cfg(f"trainer.use_distributed_optimizer={str(distributed_optimizer).lower()}")
    data, out = fake_rollout(8), str(tmp_path / "step_1")
    with _backend(cfg, ckpt) as be:
        _step(be, data)
        with torch.no_grad():  # reference weights unlike the initial ones, to see them come back
            for t in be.ref_state:
                t.mul_(0.5)
        be.save(out, TRAINER_STATE)
        saved = _tensors(be)
        _step(be, data)
        after = [p.detach().clone() for p in be._params()]
    assert sorted(os.listdir(os.path.join(out, "megatron")))[-1] == "metadata.json"
    torch.manual_seed(123)  # a different RNG state, which load() must replace
    with _backend(cfg, ckpt) as be:
        fresh = _tensors(be)
        assert be.load(out) == TRAINER_STATE
        loaded = _tensors(be)
        assert be.steps_done == 1
        _step(be, data)
        resumed = [p.detach().clone() for p in be._params()]
    assert loaded.keys() == saved.keys()
    assert any(not torch.equal(fresh[k], saved[k]) for k in saved if k.startswith("param"))
    assert any(k.startswith("opt0.group0.exp_avg_sq") for k in saved)
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k
    for a, b in zip(resumed, after):
        assert torch.equal(a, b)


@pytest.mark.integration
def test_resume_with_more_rollouts_runs_at_the_new_schedules_rate(ckpt, tmp_path):
    """Saved at step 2 of a 2-rollout cosine decay, resumed with trainer.num_rollout=4 (the driver's
    set_num_rollout comes before load): the rate is the 4-step schedule's at step 2, not the old end (min_lr)."""
    from slime_hydra.train.optim import lr_lambda

    decay = ["algo.lr_decay=cosine", "algo.min_lr=1e-3"]
    data, out = fake_rollout(8), str(tmp_path / "step_2")
    with _backend(_cfg(*decay, "trainer.num_rollout=2"), ckpt) as be:
        _step(be, data)
        _step(be, data)
        assert be.lr == pytest.approx(1e-3)
        be.save(out, TRAINER_STATE)
    cfg = _cfg(*decay, "trainer.num_rollout=4")
    with _backend(cfg, ckpt) as be:
        be.set_num_rollout(4)
        be.load(out)
        assert be.steps_done == 2
        assert be.lr == pytest.approx(1e-2 * lr_lambda(cfg.algo, 4)(2)) == pytest.approx(5.5e-3)


def test_per_rank_checkpoint_is_refused(ckpt, tmp_path):
    os.makedirs(tmp_path / "megatron")
    torch.save({}, tmp_path / "megatron" / "rank_00000.pt")
    with _backend(_cfg(), ckpt) as be:
        with pytest.raises(ValueError, match="rank_00000.pt: a per-rank megatron checkpoint"):
            be.load(str(tmp_path))
        with pytest.raises(FileNotFoundError, match="no megatron checkpoint"):
            be.load(str(tmp_path / "nothing"))


def _save_on_two_ranks(rank: int, port: int, overrides, path: str, out: str, data) -> None:
    """Rank ``rank`` of a two-rank run: a step, a checkpoint, its log-probs; one more step, its log-probs."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        with _backend(_cfg(*overrides), path, rank=rank, world_size=2) as be:
            _step(be, data)
            be.save(out, TRAINER_STATE)
            saved = _log_probs(be, data)
            _step(be, data)
            if rank == 0:
                torch.save({"saved": saved, "next": _log_probs(be, data)}, os.path.join(out, "log_probs.pt"))
            else:
                _log_probs(be, data)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["parallelism.tensor_parallel=2", "parallelism.pipeline_parallel=2",
                                    "parallelism.tensor_parallel=1"])  # the last: DP = 2
@pytest.mark.integration
def test_resharded_resume_gives_the_same_log_probs(ckpt, tmp_path, layout):
    import torch.multiprocessing as mp

    data, out = fake_rollout(8), str(tmp_path / "step_1")
    mp.spawn(_save_on_two_ranks, args=(free_port(), [layout], ckpt, out, data), nprocs=2, join=True)
    want = torch.load(os.path.join(out, "log_probs.pt"))
    with _backend(_cfg(), ckpt) as be:  # TP = PP = 1
        before = _log_probs(be, data)
        assert be.load(out) == TRAINER_STATE
        got = _log_probs(be, data)
        _step(be, data)
        got_next = _log_probs(be, data)
    mask = torch.tensor([[t < r for t in range(got.shape[1])] for r in data["response_lengths"]])
    assert (before - want["saved"])[mask].abs().max() > 1e-2  # the saved run's step moved the weights
    torch.testing.assert_close(got[mask], want["saved"][mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(got_next[mask], want["next"][mask], atol=1e-4, rtol=0)


def _save_scaled_on_two_ranks(rank: int, port: int, overrides, path: str, out: str) -> None:
    """Rank ``rank`` of a two-rank run: the weights scaled by 1.5, their Hugging Face export, a checkpoint."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        with _backend(_cfg(*overrides), path, rank=rank, world_size=2) as be:
            with torch.no_grad():
                for p in be._params():
                    p.mul_(1.5)
            weights = dict(be.hf_weights())  # gathered over the ranks; rank 0 yields them
            be.save(out, TRAINER_STATE)
            if rank == 0:
                torch.save(weights, os.path.join(out, "hf_weights.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_expert_parallel_checkpoint_resumes_without_it(tmp_path_factory, tmp_path):
    """EP = 2 -> EP = 1 for a Qwen3-MoE model, compared on the exported weights (expert parallelism does
    not run a forward pass on gloo: the token dispatcher's all-to-all)."""
    import torch.multiprocessing as mp

    ckpt, out = _tiny_checkpoint(tmp_path_factory, "qwen3_moe"), str(tmp_path / "step_1")
    mp.spawn(_save_scaled_on_two_ranks, args=(free_port(), ["parallelism.expert_parallel=2"], ckpt, out), nprocs=2,
             join=True)
    want = torch.load(os.path.join(out, "hf_weights.pt"))
    with _backend(_cfg(), ckpt) as be:
        assert be.load(out) == TRAINER_STATE
        got = dict(be.hf_weights())
    assert got.keys() == want.keys() and any("experts.1." in k for k in got)
    for k in got:
        assert torch.equal(got[k], want[k]), k
