"""The torch trainer backend (:class:`~slime_hydra.train.backend.TrainerBackend`): a Hugging Face
causal LM, AdamW, data parallel across trainer ranks (DDP over gloo on CPU, NCCL on GPUs).

It only moves tensors: padded micro-batches, forward passes under autocast, backward over
micro-batches with the loss function the RL step (:mod:`slime_hydra.train.trainer`) gives it, the
optimiser, offload and checkpoints. Every rank is its own data-parallel rank; rank 0 pushes the
weights and writes checkpoints.

What the extra models cost in memory, with ``P`` the policy's parameter bytes:

- Reference model (``needs_ref``: ``kl_coef`` or ``kl_loss_coef``): no second model. Its weights are
  a frozen copy of the policy's first weights on the device (``P``, the master dtype, so its log-probs
  are computed exactly as the policy's were), run through the policy's modules with
  ``torch.func.functional_call``: nothing is copied for a reference pass (a host copy swapped into the
  policy, as slime's TensorBackuper does, moves ``3P`` over PCIe each time). Colocated, it is offloaded
  with the policy.
- Critic (``needs_critic``: ``advantage_estimator=ppo``, :mod:`slime_hydra.train.backends.torch.critic`): a second
  trainable model on the device: the policy's backbone (``P`` minus an untied LM head) plus a
  ``hidden -> 1`` head, with its own gradients and AdamW's two moments (same dtype as the weights):
  about ``4P`` of accelerator memory, the same training state as the actor's, so PPO roughly doubles
  the trainer's footprint. Activations: the critic's forward/backward runs before the actor's in each
  step, so only one model's activations are live at a time. With colocated engines it is offloaded
  to CPU with the actor.

Precision: on GPUs the trainer keeps float32 master weights and AdamW state and runs forward and
backward under autocast in ``model.dtype`` (bfloat16 for the real-model presets); the engines get,
and ``hf/`` stores, ``model.dtype`` weights. On CPU the weights are ``model.dtype`` throughout.

Checkpoints: ``hf/`` (the policy), ``trainer.pt`` (optimiser, scheduler, counters, reference
weights, float32 master weights when they differ from ``hf/``, RNG) and, with a critic,
``critic.pt`` (value model, its optimiser and scheduler).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from slime_hydra.train import algorithms as A
from slime_hydra.train.backend import PolicyLossFn, StepResult, TrainerBackend
from slime_hydra.train.backends.torch.critic import Critic
from slime_hydra.train.backends.torch.offload import Offloader
from slime_hydra.train.batch import MicroBatch, make_micro_batch, response_log_probs
from slime_hydra.train.optim import accumulated_step, adamw, autocast, schedule

if TYPE_CHECKING:
    from slime_hydra.config.schema import AlgoConfig, ModelConfig, ParallelismConfig, TrainerConfig

log = logging.getLogger(__name__)

# trainer.pt keys of the backend's own; the rest is the RL step's state given to save()
_OWN_STATE = ("optimizer", "scheduler", "ref", "rng", "master")


class TorchBackend(TrainerBackend):
    def __init__(self, *, model: ModelConfig, algo: AlgoConfig, trainer: TrainerConfig,
                 parallelism: Optional[ParallelismConfig] = None, model_path: str, rank: int, world_size: int,
                 device: torch.device):
        # parallelism: data parallel over all ranks is the only layout (validation refuses the others)
        self.algo, self.trainer_cfg = algo, trainer
        self.rank, self.world_size, self.device = rank, world_size, device
        self.compute_dtype = getattr(torch, model.dtype)
        dtype = torch.float32 if device.type == "cuda" else self.compute_dtype  # master weights
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                          trust_remote_code=model.trust_remote_code).to(device)
        if trainer.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.config.use_cache = False
        self.net = self.model
        if world_size > 1:
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None)
        self.opt = adamw(self.model.parameters(), algo, algo.lr)
        self.critic: Optional[Critic] = None
        if A.needs_critic(algo):
            self.critic = Critic(algo, model_path, dtype=dtype, compute_dtype=self.compute_dtype, device=device,
                                 world_size=world_size, gradient_checkpointing=trainer.gradient_checkpointing,
                                 trust_remote_code=model.trust_remote_code)
        self.set_num_rollout(trainer.num_rollout or 1)
        self.ref_state: Optional[Dict[str, torch.Tensor]] = None  # the reference's weights, by state-dict name
        if A.needs_ref(algo):
            self.ref_state = {k: v.detach().clone() for k, v in self._unique_state().items()}
        self.offloaders = [Offloader(self.model, self.opt, device, extra=(self.ref_state or {}).values())]
        if self.critic is not None:
            self.offloaders.append(Offloader(self.critic.model, self.critic.opt, device))
        self.pad_id = self.model.config.pad_token_id or 0

    # ------------------------------------------------------------------------------ layout
    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def dp_size(self) -> int:
        return self.world_size

    @property
    def pushes_weights(self) -> bool:
        return self.rank == 0

    @property
    def reports_metrics(self) -> bool:
        return True  # every rank holds the whole model: its metrics, reduced over ranks, are complete

    def dp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            t = t.to(self.device)
            dist.all_reduce(t)
        return t.cpu()

    def set_num_rollout(self, num_rollout: int) -> None:
        steps = self.trainer_cfg.num_steps_per_rollout
        actor_steps = max(1, num_rollout - self.algo.num_critic_only_steps) * steps  # the actor waits for the critic
        self.sched = schedule(self.opt, self.algo, actor_steps)
        if self.critic is not None:
            self.critic.sched = schedule(self.critic.opt, self.algo, num_rollout * steps)

    # ------------------------------------------------------------------------------ weights
    def _unique_state(self) -> Dict[str, torch.Tensor]:
        """The state dict with each storage once: tied weights (embeddings = LM head) share one
        tensor, and copying into it twice under two names would undo a swap."""
        seen, out = set(), {}
        for k, v in self.model.state_dict().items():
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                out[k] = v
        return out

    def _named_weights(self, on_device: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
        """Hugging Face names -> tensors in ``model.dtype``, as the engines load them (cast one at a
        time, so a push never holds a second copy of the model). Each storage once: a tied LM head is
        the embedding, which the engines tie as they load it (SGLang warns "Parameter lm_head.weight not
        found" for a second copy; the cast would hide that the two are one). ``on_device``: offloaded
        weights are copied from their pinned host buffers and cast on the device, not on the host."""
        for name, tensor in self._unique_state().items():
            tensor = tensor.detach()
            if on_device:
                tensor = tensor.to(self.device, non_blocking=True)
            yield name, tensor.to(self.compute_dtype)

    def hf_weights(self, every_rank: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
        if self.pushes_weights or every_rank:
            yield from self._named_weights(on_device=True)

    def offload(self) -> None:
        """Colocated GPUs: parameters and optimiser state (and the critic's) go to pinned host
        buffers while the engines generate."""
        for o in self.offloaders:
            o.offload()

    def onload(self) -> None:
        for o in self.offloaders:
            o.onload()

    # --------------------------------------------------------------------------------- train
    def micro_batches(self, data: Dict[str, list], rows: Sequence[int], response_len: int) -> List[MicroBatch]:
        size = self.trainer_cfg.micro_batch_size
        return [make_micro_batch(data, rows[s:s + size], response_len, self.pad_id).to(self.device)
                for s in range(0, len(rows), size)]

    @property
    def lr(self) -> float:
        return self.sched.get_last_lr()[0]

    def _forward(self, mb: MicroBatch, temperature: float, with_entropy: bool = False,
                 weights: Optional[Dict[str, torch.Tensor]] = None):
        """``weights``: run the policy's modules with these instead of its own (the reference's).

        No attention mask: the rows are right-padded, so under causal attention no real token sees
        a pad, and what the padded positions compute is never read (their loss mask is 0). The same
        logits at the real tokens (bitwise, on CPU), and SDPA's causal kernel instead of its masked
        one: 0.6 ms a layer against 1.1 ms for the tiny model's 128 x 9 tokens (measured)."""
        pos = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)
        inputs = {"input_ids": mb.input_ids, "position_ids": pos}
        with autocast(self.device, self.compute_dtype):
            if weights is None:
                logits = self.net(**inputs).logits
            else:  # the tied LM head follows the embedding (tie_weights), buffers stay the model's
                logits = torch.func.functional_call(self.model, weights, (), inputs, strict=False).logits
        return response_log_probs(logits, mb, temperature, with_entropy, entropy_grad=bool(self.algo.entropy_coef))

    @torch.no_grad()
    def _log_probs(self, mbs: Sequence[MicroBatch], temperature: float,
                   weights: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
        self.model.eval()
        return torch.cat([self._forward(mb, temperature, weights=weights)[0].float().cpu() for mb in mbs])

    def log_probs(self, mbs: Sequence[MicroBatch], temperature: float, *, reference: bool = False) -> torch.Tensor:
        if not reference:
            return self._log_probs(mbs, temperature)
        if self.ref_state is None:
            raise RuntimeError("reference log-probs asked for, but algo has neither kl_coef nor kl_loss_coef, "
                               "so the backend kept no reference weights")
        return self._log_probs(mbs, temperature, weights=self.ref_state)

    def train_step(self, mbs: Sequence[MicroBatch], temperature: float, loss_fn: PolicyLossFn) -> StepResult:
        def loss_of(mb: MicroBatch):
            log_probs, entropy = self._forward(mb, temperature, with_entropy=True)
            return loss_fn(mb.indices, log_probs, entropy)

        return accumulated_step(self.net, self.model, self.opt, self.sched, mbs, loss_of, self.world_size,
                                self.algo.clip_grad)

    # ---------------------------------------------------------------------------- checkpoints
    def export_hf(self, out_dir: str, tokenizer_dir: Optional[str]) -> None:
        """Rank 0 writes ``out_dir`` (``model.dtype`` weights; loads with from_pretrained)."""
        if self.rank != 0:
            return
        self.model.save_pretrained(out_dir, state_dict=dict(self._named_weights()))
        if tokenizer_dir:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)

    def save(self, out_dir: str, trainer_state: Dict[str, Any]) -> None:
        """Rank 0 writes ``out_dir/trainer.pt`` (optimiser, scheduler, reference weights, RNG, float32
        master weights when ``hf/`` holds another dtype, ``trainer_state``) and, with a critic,
        ``out_dir/critic.pt``; the weights are those of ``out_dir/hf``."""
        if self.rank != 0:
            return
        master = self.model.state_dict()
        state = {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(), **trainer_state,
                 "ref": self.ref_state, "rng": torch.get_rng_state(),
                 "master": master if self.compute_dtype != next(self.model.parameters()).dtype else None}
        torch.save(state, os.path.join(out_dir, "trainer.pt"))
        if self.critic is not None:
            torch.save(self.critic.state_dict(), os.path.join(out_dir, "critic.pt"))

    def load(self, ckpt_dir: str) -> Dict[str, Any]:
        from safetensors.torch import load_file

        hf = os.path.join(ckpt_dir, "hf")
        weights = {}
        for f in sorted(os.listdir(hf)):
            if f.endswith(".safetensors"):
                weights.update(load_file(os.path.join(hf, f)))
        missing, _ = self.model.load_state_dict(weights, strict=False)
        if [k for k in missing if k in dict(self.model.named_parameters())]:
            raise RuntimeError(f"checkpoint {hf} lacks parameters {missing[:5]}")
        self.model.tie_weights()
        state = torch.load(os.path.join(ckpt_dir, "trainer.pt"), map_location="cpu", weights_only=False)
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        if state.get("master") is not None:  # the float32 weights, not their bfloat16 copy in hf/
            self.model.load_state_dict(state["master"])
        if self.critic is not None:
            path = os.path.join(ckpt_dir, "critic.pt")
            if not os.path.exists(path):
                raise FileNotFoundError(f"{ckpt_dir} has no critic.pt: it was not saved by a run with a critic "
                                        "(advantage_estimator=ppo); start a new run from its hf/ with model.path "
                                        "instead")
            self.critic.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
        if self.ref_state is not None and state.get("ref") is not None:
            for k, v in self.ref_state.items():
                v.copy_(state["ref"][k])
        torch.set_rng_state(state["rng"])
        return {k: v for k, v in state.items() if k not in _OWN_STATE}
