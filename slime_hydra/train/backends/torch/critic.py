"""The PPO critic of the torch backend: ``ValueModel`` (the policy's backbone from the same checkpoint plus a
zero-initialised float32 ``hidden -> 1`` head) and ``Critic`` (DDP, AdamW at ``algo.critic_lr``, LR schedule).
``V_t`` is read where the logits scoring response token ``t`` are: the value of the state before token ``t``.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
from torch import nn

from slime_hydra.train import algorithms as A
from slime_hydra.train.backend import CriticBackend, StepResult, ValueLossFn
from slime_hydra.train.backends.torch.offload import data_parallel
from slime_hydra.train.batch import MicroBatch
from slime_hydra.train.logprobs import response_rows
from slime_hydra.train.optim import accumulated_step, adamw, autocast, load_schedule


class ValueModel(nn.Module):
    """A causal LM's backbone plus a float32 ``hidden -> 1`` value head."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        self.value_head = nn.Linear(backbone.config.hidden_size, 1, dtype=torch.float32,
                                    device=next(backbone.parameters()).device)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, model_path: str, dtype: torch.dtype = torch.float32,
                        trust_remote_code: bool = False) -> "ValueModel":
        """The backbone of the causal-LM checkpoint at ``model_path`` (its LM head is not loaded)."""
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(model_path, dtype=dtype, trust_remote_code=trust_remote_code)
        backbone.config.use_cache = False
        return cls(backbone)

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        """Response tokens' values, ``[B, T]`` float32 (garbage at padding); inputs as ``TorchBackend._forward``'s."""
        B, T = mb.response_ids.shape
        rows = response_rows(self.backbone(input_ids=mb.input_ids).last_hidden_state, mb.response_start, T)
        with torch.autocast(rows.device.type, enabled=False):  # the head stays float32 under autocast
            return self.value_head(rows.float()).view(B, T)


class Critic(CriticBackend):
    """The value model trained on one trainer rank (its own optimiser, the actor's data parallelism)."""

    def __init__(self, algo, model_path: str, *, dtype: torch.dtype, compute_dtype: torch.dtype,
                 device: torch.device, world_size: int, gradient_checkpointing: bool = False,
                 trust_remote_code: bool = False):
        self.algo, self.device, self.world_size, self.compute_dtype = algo, device, world_size, compute_dtype
        self.model = ValueModel.from_pretrained(model_path, dtype, trust_remote_code).to(device)
        if gradient_checkpointing:
            self.model.backbone.gradient_checkpointing_enable()
        self.net: nn.Module = self.model
        if world_size > 1:
            self.net = data_parallel(self.model, device)
        self.opt = adamw(self.model.parameters(), algo, algo.critic_lr if algo.critic_lr is not None else algo.lr)
        self.sched: Optional[torch.optim.lr_scheduler.LambdaLR] = None  # the backend sizes it to the run

    @property
    def lr(self) -> float:
        return self.sched.get_last_lr()[0]

    @torch.no_grad()
    def values(self, mbs: Sequence[MicroBatch]) -> torch.Tensor:
        """The critic's values of a whole rollout, ``[N, T]`` float32 on CPU; zero after each response (mask-0
        tokens inside one keep theirs: GAE runs through them, see ``algorithms.advantages.ppo_gae``)."""
        self.model.eval()
        out = []
        with autocast(self.device, self.compute_dtype):
            for mb in mbs:
                positions = torch.arange(mb.loss_mask.shape[1], device=mb.loss_mask.device)
                inside = positions[None, :] < A.response_lengths(mb.loss_mask)[:, None]
                out.append((self.net(mb) * inside).float())
        return torch.cat(out).cpu()  # one copy to the host, not a wait for the GPU a micro-batch

    def train_step(self, mbs: Sequence[MicroBatch], loss_fn: ValueLossFn) -> StepResult:
        with autocast(self.device, self.compute_dtype):
            return accumulated_step(self.net, self.model, self.opt, self.sched, mbs,
                                    lambda mb: loss_fn(mb.indices, self.net(mb)), self.world_size,
                                    self.algo.clip_grad)

    def state_dict(self) -> Dict[str, object]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict()}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        load_schedule(self.sched, state["scheduler"])
