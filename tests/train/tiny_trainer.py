"""The torch backend and the RL step on the tiny model, in process (no Ray), for the tests in this folder."""

from __future__ import annotations

import torch

from conftest import resolved


def backend(cfg, ckpt: str, rank: int = 0, world_size: int = 1):
    from slime_hydra.train.backends.torch.backend import TorchBackend

    return TorchBackend(model=cfg.model, algo=cfg.algo, trainer=cfg.trainer, parallelism=cfg.parallelism,
                        model_path=ckpt, rank=rank, world_size=world_size, device=torch.device("cpu"))


def rl_trainer(cfg, ckpt: str, rank: int = 0, world_size: int = 1):
    """(RLTrainer, its TorchBackend) for the composed config ``cfg``."""
    from slime_hydra.train.trainer import RLTrainer

    be = backend(cfg, ckpt, rank, world_size)
    return RLTrainer(be, cfg.algo, cfg.trainer.num_steps_per_rollout), be


def train(rl, cfg, data: dict) -> dict:
    """One rollout, with the sampling temperature and budget the driver would pass."""
    return rl.train(data, temperature=cfg.rollout.temperature, max_response_len=cfg.rollout.max_response_len)


def config(*overrides: str):
    return resolved(list(overrides))


def fake_rollout(n: int = 8, seed: int = 0, vocab: int = 24) -> dict:
    """Rollout data as the manager sends it: prompts of 5 tokens, responses of 1-3 tokens, 0/1 rewards."""
    g = torch.Generator().manual_seed(seed)
    tokens, lens, masks = [], [], []
    for i in range(n):
        r = 1 + i % 3
        tokens.append(torch.randint(3, vocab, (5 + r,), generator=g).tolist())
        lens.append(r)
        masks.append([1] * r)
    rewards = [float(x) for x in torch.randint(0, 2, (n,), generator=g)]
    return {"tokens": tokens, "response_lengths": lens, "loss_masks": masks, "rewards": rewards,
            "raw_rewards": list(rewards), "rollout_log_probs": [[0.0] * r for r in lens],
            "group_indices": [i // 4 for i in range(n)], "truncated": [False] * n}
