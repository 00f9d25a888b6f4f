"""The torch trainer backend: a Hugging Face causal LM, AdamW, data parallel across trainer actors
(DDP over gloo on CPU, NCCL on GPUs).

``train(data)`` is one rollout's worth of training: recompute the old (and reference) log-probs,
the critic's values (PPO), the advantages, then ``num_steps_per_rollout`` optimiser steps over
micro-batches (each step: a critic step, then an actor step). The algorithm is entirely in
:mod:`slime_hydra.train.algorithms`; this file only moves tensors.

What the extra models cost in memory, with ``P`` the policy's parameter bytes:

- Reference model (``needs_ref``: ``kl_coef`` or ``kl_loss_coef``): no second model. Its weights are
  a frozen CPU copy (``P`` of host memory, pinned on GPUs) swapped into the policy for its forward
  pass, through a same-size CPU staging buffer that holds the policy's own weights meanwhile
  (another ``P``): ``2P`` of host memory, no accelerator memory beyond the policy's (like slime's
  TensorBackuper). Each reference pass copies ``P`` device -> host and ``2P`` host -> device.
- Critic (``needs_critic``: ``advantage_estimator=ppo``, :mod:`slime_hydra.train.critic`): a second
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

import contextlib
import logging
import math
import os
from collections import defaultdict
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from slime_hydra.config.schema import RunConfig
from slime_hydra.train import algorithms as A
from slime_hydra.train.batch import MicroBatch, make_micro_batch, response_log_probs, response_tensor
from slime_hydra.train.critic import Critic, explained_variance
from slime_hydra.train.offload import Offloader

log = logging.getLogger(__name__)


def lr_lambda(algo, total_steps: int):
    def f(step: int) -> float:
        if step < algo.lr_warmup_steps:
            return (step + 1) / algo.lr_warmup_steps
        if algo.lr_decay == "constant" or total_steps <= algo.lr_warmup_steps:
            return 1.0
        frac = min(1.0, (step - algo.lr_warmup_steps) / max(1, total_steps - algo.lr_warmup_steps))
        floor = algo.min_lr / algo.lr
        if algo.lr_decay == "linear":
            return floor + (1 - floor) * (1 - frac)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


class TorchTrainer:
    def __init__(self, cfg: RunConfig, model_path: str, rank: int, world_size: int, device: torch.device):
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        algo = cfg.algo
        self.compute_dtype = getattr(torch, cfg.model.dtype)
        dtype = torch.float32 if device.type == "cuda" else self.compute_dtype  # master weights
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                          trust_remote_code=cfg.model.trust_remote_code).to(device)
        if cfg.trainer.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.config.use_cache = False
        self.net = self.model
        if world_size > 1:
            self.net = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=[device.index] if device.type == "cuda" else None)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=algo.lr, betas=(algo.adam_beta1, algo.adam_beta2),
                                     eps=algo.adam_eps, weight_decay=algo.weight_decay)
        self.needs_ref = A.needs_ref(algo)
        self.critic = None
        if A.needs_critic(algo):
            self.critic = Critic(algo, model_path, dtype=dtype, device=device, world_size=world_size,
                                 gradient_checkpointing=cfg.trainer.gradient_checkpointing,
                                 trust_remote_code=cfg.model.trust_remote_code)
        self.set_num_rollout(cfg.trainer.num_rollout or 1)
        pin = device.type == "cuda"
        self.ref_state = self._cpu_copy(pin) if self.needs_ref else None
        self._backup = self._cpu_copy(pin) if self.needs_ref else None
        self.offloaders = [Offloader(self.model, self.opt, device)]
        if self.critic is not None:
            self.offloaders.append(Offloader(self.critic.model, self.critic.opt, device))
        self.pad_id = self.model.config.pad_token_id or 0
        self.steps_done = 0  # actor optimiser steps
        self.rollouts_done = 0  # train() calls, critic-only ones included

    def set_num_rollout(self, num_rollout: int) -> None:
        """(Re)build the LR schedules for a run of ``num_rollout`` rollouts (known once the data
        is read when the run is sized by ``num_epoch``); call before the first step."""
        algo, steps = self.cfg.algo, self.cfg.trainer.num_steps_per_rollout
        actor_steps = max(1, num_rollout - algo.num_critic_only_steps) * steps  # the actor waits for the critic
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(algo, actor_steps))
        if self.critic is not None:
            self.critic.sched = torch.optim.lr_scheduler.LambdaLR(self.critic.opt, lr_lambda(algo, num_rollout * steps))

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

    def _cpu_copy(self, pin: bool) -> Dict[str, torch.Tensor]:
        out = {}
        for k, v in self._unique_state().items():
            t = torch.empty(v.shape, dtype=v.dtype, pin_memory=pin)
            t.copy_(v.detach())
            out[k] = t
        return out

    @contextlib.contextmanager
    def swapped_in(self, state: Dict[str, torch.Tensor]) -> Iterator[None]:
        """Run the policy model with ``state``'s weights, then restore its own."""
        params = self._unique_state()
        with torch.no_grad():
            for k, v in params.items():
                self._backup[k].copy_(v, non_blocking=True)
                v.copy_(state[k], non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for k, v in params.items():
                    v.copy_(self._backup[k], non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize()

    def named_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """Hugging Face names -> tensors in ``model.dtype``, as the engines load them (cast one at a
        time, so a push never holds a second copy of the model)."""
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach().to(self.compute_dtype)

    def autocast(self):
        mixed = self.device.type == "cuda" and self.compute_dtype != torch.float32
        return torch.autocast("cuda", dtype=self.compute_dtype) if mixed else contextlib.nullcontext()

    def offload(self) -> None:
        """Colocated GPUs: parameters and optimiser state (and the critic's) go to pinned host
        buffers while the engines generate."""
        for o in self.offloaders:
            o.offload()

    def onload(self) -> None:
        for o in self.offloaders:
            o.onload()

    # --------------------------------------------------------------------------------- train
    def _forward_log_probs(self, mb: MicroBatch, with_entropy: bool = False):
        pos = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)
        with self.autocast():
            logits = self.net(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=pos).logits
        return response_log_probs(logits, mb, self.cfg.rollout.temperature, with_entropy)

    @torch.no_grad()
    def _log_probs_all(self, mbs: List[MicroBatch]) -> torch.Tensor:
        self.model.eval()
        return torch.cat([self._forward_log_probs(mb)[0].float().cpu() for mb in mbs])

    def _micro_batches(self, data: Dict[str, list], rows: List[int], resp_len: int) -> List[MicroBatch]:
        size = self.cfg.trainer.micro_batch_size
        return [make_micro_batch(data, rows[s:s + size], resp_len, self.pad_id).to(self.device)
                for s in range(0, len(rows), size)]

    def _allreduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            t = t.to(self.device)
            dist.all_reduce(t)
        return t.cpu()

    def train(self, data: Dict[str, list]) -> Dict[str, float]:
        cfg, algo = self.cfg, self.cfg.algo
        n = len(data["tokens"])
        rows = list(range(n))
        T = max(1, max(data["response_lengths"]))
        lr = self.sched.get_last_lr()[0]  # the rate of this rollout's (first) step
        # the rollout is cut into num_steps_per_rollout optimiser steps of equal size, each into micro-batches
        steps = cfg.trainer.num_steps_per_rollout
        per_step = n // steps
        assert per_step * steps == n, f"{n} samples do not split into {steps} equal optimiser steps"
        step_rows = [rows[s * per_step:(s + 1) * per_step] for s in range(steps)]
        step_mbs = [self._micro_batches(data, r, T) for r in step_rows]
        mbs = [mb for group in step_mbs for mb in group]
        loss_mask = torch.cat([mb.loss_mask.cpu() for mb in mbs])
        rollout_lp = response_tensor(data, "rollout_log_probs", rows, T)
        metrics: Dict[str, float] = {}

        # 1. old-policy log-probs (recomputed, unless the rollout's are used as-is), the reference's,
        #    and the critic's values
        old_lp = self._log_probs_all(mbs)
        logprob_gap = ((old_lp - rollout_lp).abs() * loss_mask).sum()
        if algo.use_rollout_logprobs:
            old_lp = rollout_lp
        ref_lp = None
        if self.needs_ref:
            with self.swapped_in(self.ref_state):
                ref_lp = self._log_probs_all(mbs)
        if self.critic is not None:
            with self.autocast():
                values = self.critic.values(mbs)
        else:
            values = None

        # 2. advantages (and the critic's targets) on the whole local batch
        rewards = torch.tensor(data["rewards"], dtype=torch.float32)
        adv, returns = A.compute_advantages(algo, rewards=rewards, loss_mask=loss_mask, old_log_probs=old_lp,
                                            ref_log_probs=ref_lp, values=values,
                                            all_reduce=self._allreduce if self.world_size > 1 else None)
        # token means over every rank's samples: the log-prob gap, |advantage| and the critic's values
        value_sum = (values * loss_mask).sum() if values is not None else torch.tensor(0.0)
        totals = self._allreduce(torch.stack([loss_mask.float().sum(), logprob_gap.float(),
                                              (adv.abs() * loss_mask).sum(), value_sum.float()]))
        tokens = float(totals[0].clamp(min=1))
        metrics["train_rollout_logprob_abs_diff"] = float(totals[1]) / tokens
        metrics["advantage_abs_mean"] = float(totals[2]) / tokens
        if values is not None:  # how well the critic predicted these returns, before its update
            metrics["explained_variance"] = explained_variance(values, returns, loss_mask)
            metrics["values_mean"] = float(totals[3]) / tokens

        # 3. the optimiser steps; for the first num_critic_only_steps rollouts only the critic trains
        train_actor = self.rollouts_done >= algo.num_critic_only_steps
        sums: Dict[str, float] = defaultdict(float)
        for these_rows, group in zip(step_rows, step_mbs):
            counts = self._allreduce(torch.tensor([float(len(these_rows)), float(loss_mask[these_rows].sum())]))
            reducer = A.Reducer(algo.loss_reduction, num_samples=int(counts[0]), num_tokens=int(counts[1]),
                                max_len=cfg.rollout.max_response_len)
            step_metrics: Dict[str, float] = {}
            if self.critic is not None:
                with self.autocast():
                    step_metrics.update(self.critic.train_step(group, reducer, values, returns))
            if train_actor:
                step_metrics.update(self._actor_step(group, reducer, old_lp, ref_lp, rollout_lp, adv))
            for key, v in step_metrics.items():
                sums[key] += v / steps
        self.rollouts_done += 1
        metrics["lr"] = lr
        if self.critic is not None:
            metrics["critic_lr"] = self.critic.sched.get_last_lr()[0]
        for key, v in sums.items():
            per_rank = key.endswith("grad_norm")  # the same on every rank after DDP: average, not sum
            metrics[key] = float(self._allreduce(torch.tensor([v]))[0]) / (self.world_size if per_rank else 1)
        return metrics

    def _actor_step(self, mbs: List[MicroBatch], reducer: A.Reducer, old_lp: torch.Tensor,
                    ref_lp: Optional[torch.Tensor], rollout_lp: torch.Tensor, adv: torch.Tensor) -> Dict[str, float]:
        """One optimiser step of the policy loss over the step's micro-batches."""
        algo = self.cfg.algo
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        out: Dict[str, float] = defaultdict(float)
        for k, mb in enumerate(mbs):
            sync = k == len(mbs) - 1 or self.world_size == 1
            with contextlib.nullcontext() if sync else self.net.no_sync():
                lp, ent = self._forward_log_probs(mb, with_entropy=True)
                idx = mb.indices
                loss, m = A.policy_loss(
                    algo, reducer, log_probs=lp, old_log_probs=old_lp[idx].to(lp.device),
                    advantages=adv[idx].to(lp.device), loss_mask=mb.loss_mask,
                    ref_log_probs=None if ref_lp is None else ref_lp[idx].to(lp.device),
                    rollout_log_probs=rollout_lp[idx].to(lp.device), entropy=ent)
                # DDP averages gradients over ranks; the reducer already divides by step totals.
                (loss * self.world_size).backward()
            for key, v in m.items():
                out[key] += float(v)
        out["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), algo.clip_grad))
        self.opt.step()
        self.sched.step()
        self.steps_done += 1
        return out

    # ---------------------------------------------------------------------------- checkpoints
    def save(self, out_dir: str, tokenizer_dir: Optional[str]) -> None:
        """Rank 0: ``out_dir/hf`` (loads with from_pretrained), ``out_dir/trainer.pt`` and, with a critic,
        ``out_dir/critic.pt``."""
        master = self.model.state_dict()
        self.model.save_pretrained(os.path.join(out_dir, "hf"), state_dict=dict(self.named_weights()))
        if tokenizer_dir:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(os.path.join(out_dir, "hf"))
        state = {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(), "steps_done": self.steps_done,
                 "rollouts_done": self.rollouts_done, "ref": self.ref_state, "rng": torch.get_rng_state(),
                 "master": master if self.compute_dtype != next(self.model.parameters()).dtype else None}
        torch.save(state, os.path.join(out_dir, "trainer.pt"))
        if self.critic is not None:
            torch.save(self.critic.state_dict(), os.path.join(out_dir, "critic.pt"))

    def load(self, ckpt_dir: str) -> None:
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
        self.steps_done = state["steps_done"]
        self.rollouts_done = state["rollouts_done"]
        if state.get("master") is not None:  # the float32 weights, not their bfloat16 copy in hf/
            self.model.load_state_dict(state["master"])
        if self.critic is not None:
            path = os.path.join(ckpt_dir, "critic.pt")
            if not os.path.exists(path):
                raise FileNotFoundError(f"{ckpt_dir} has no critic.pt: it was not saved by a run with a critic "
                                        "(advantage_estimator=ppo); start a new run from its hf/ with model.path instead")
            self.critic.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
        if self.needs_ref and state.get("ref") is not None:
            for k, v in self.ref_state.items():
                v.copy_(state["ref"][k])
        torch.set_rng_state(state["rng"])
