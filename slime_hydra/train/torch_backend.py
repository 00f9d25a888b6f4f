"""The torch trainer backend: a Hugging Face causal LM, AdamW, data parallel across trainer actors
(DDP over gloo on CPU, NCCL on GPUs).

``train(data)`` is one rollout's worth of training: recompute the old (and reference) log-probs,
compute advantages, then ``num_steps_per_rollout`` optimiser steps over micro-batches. The
algorithm is entirely in :mod:`slime_hydra.train.algorithms`; this file only moves tensors.
The reference model costs no second model: its weights are a frozen CPU copy, swapped into the
policy for its forward pass (like slime's TensorBackuper).
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
        dtype = getattr(torch, cfg.model.dtype)
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
        total = (cfg.trainer.num_rollout or 1) * cfg.trainer.num_steps_per_rollout
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(algo, total))
        self.needs_ref = bool(algo.kl_loss_coef or algo.kl_coef)
        pin = device.type == "cuda"
        self.ref_state = self._cpu_copy(pin) if self.needs_ref else None
        self._backup = self._cpu_copy(pin) if self.needs_ref else None
        self.pad_id = self.model.config.pad_token_id or 0
        self.steps_done = 0

    # ------------------------------------------------------------------------------ weights
    def _cpu_copy(self, pin: bool) -> Dict[str, torch.Tensor]:
        out = {}
        for k, v in self.model.state_dict().items():
            t = torch.empty(v.shape, dtype=v.dtype, pin_memory=pin)
            t.copy_(v.detach())
            out[k] = t
        return out

    @contextlib.contextmanager
    def swapped_in(self, state: Dict[str, torch.Tensor]) -> Iterator[None]:
        """Run the policy model with ``state``'s weights, then restore its own."""
        params = self.model.state_dict()
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

    def named_weights(self) -> List[Tuple[str, torch.Tensor]]:
        """Hugging Face names -> tensors, as the engines load them."""
        return list(self.model.state_dict().items())

    def offload(self) -> None:
        """Colocated GPUs: move parameters and optimiser state to CPU while the engines generate."""
        self._move("cpu")

    def onload(self) -> None:
        self._move(self.device)

    def _move(self, device) -> None:
        if self.device.type != "cuda":
            return
        self.model.to(device)
        for state in self.opt.state.values():
            for k, v in state.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    state[k] = v.to(device, non_blocking=True)
        torch.cuda.synchronize()
        if device == "cpu":
            torch.cuda.empty_cache()

    # --------------------------------------------------------------------------------- train
    def _forward_log_probs(self, mb: MicroBatch, with_entropy: bool = False):
        pos = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)
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
        mbs = self._micro_batches(data, rows, T)
        loss_mask = torch.cat([mb.loss_mask.cpu() for mb in mbs])
        rollout_lp = response_tensor(data, "rollout_log_probs", rows, T)
        metrics: Dict[str, float] = {}

        # 1. old-policy log-probs (recomputed, unless the rollout's are used as-is) and the reference
        old_lp = self._log_probs_all(mbs)
        diff = ((old_lp - rollout_lp).abs() * loss_mask).sum() / loss_mask.sum().clamp(min=1)
        metrics["train_rollout_logprob_abs_diff"] = float(diff)
        if algo.use_rollout_logprobs:
            old_lp = rollout_lp
        ref_lp = None
        if self.needs_ref:
            with self.swapped_in(self.ref_state):
                ref_lp = self._log_probs_all(mbs)

        # 2. advantages on the whole local batch
        rewards = torch.tensor(data["rewards"], dtype=torch.float32)
        adv, _returns = A.compute_advantages(algo, rewards=rewards, loss_mask=loss_mask, old_log_probs=old_lp,
                                             ref_log_probs=ref_lp)
        metrics["advantage_abs_mean"] = float((adv.abs() * loss_mask).sum() / loss_mask.sum().clamp(min=1))

        # 3. optimiser steps: the rollout is cut into num_steps_per_rollout steps of equal size
        steps = cfg.trainer.num_steps_per_rollout
        per_step = n // steps
        self.model.train()
        sums: Dict[str, float] = defaultdict(float)
        for step in range(steps):
            step_rows = rows[step * per_step:(step + 1) * per_step]
            counts = self._allreduce(torch.tensor([float(len(step_rows)), float(loss_mask[step_rows].sum())]))
            reducer = A.Reducer(algo.loss_reduction, num_samples=int(counts[0]), num_tokens=int(counts[1]),
                                max_len=cfg.rollout.max_response_len)
            step_mbs = self._micro_batches(data, step_rows, T)
            self.opt.zero_grad(set_to_none=True)
            for k, mb in enumerate(step_mbs):
                sync = k == len(step_mbs) - 1 or self.world_size == 1
                ctx = contextlib.nullcontext() if sync else self.net.no_sync()
                with ctx:
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
                    sums[key] += float(v) / steps
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), algo.clip_grad)
            sums["grad_norm"] += float(grad_norm) / steps
            self.opt.step()
            self.sched.step()
            self.steps_done += 1
        metrics["lr"] = self.sched.get_last_lr()[0]
        for key, v in sums.items():
            metrics[key] = float(self._allreduce(torch.tensor([v]))[0]) / (self.world_size if key == "grad_norm" else 1)
        return metrics

    # ---------------------------------------------------------------------------- checkpoints
    def save(self, out_dir: str, tokenizer_dir: Optional[str]) -> None:
        """Rank 0: ``out_dir/hf`` (loads with from_pretrained) and ``out_dir/trainer.pt``."""
        self.model.save_pretrained(os.path.join(out_dir, "hf"))
        if tokenizer_dir:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(os.path.join(out_dir, "hf"))
        state = {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(), "steps_done": self.steps_done,
                 "ref": self.ref_state, "rng": torch.get_rng_state()}
        torch.save(state, os.path.join(out_dir, "trainer.pt"))

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
        if self.needs_ref and state.get("ref") is not None:
            for k, v in state["ref"].items():
                self.ref_state[k].copy_(v)
        torch.set_rng_state(state["rng"])
