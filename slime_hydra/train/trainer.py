"""The RL step, the same for every trainer backend: one rollout's training on one rank (the old policy's,
reference's and critic's passes, advantages, ``num_steps_per_rollout`` optimiser steps with the losses of
:mod:`slime_hydra.train.algorithms`, metrics reduced over the data-parallel ranks). With one policy step per
rollout and no KL shaping, the old log-probs are the step's own forward pass's (detached).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

import torch

from slime_hydra.train import algorithms as A
from slime_hydra.train.backend import TrainerBackend
from slime_hydra.train.batch import response_mask, response_tensor

if TYPE_CHECKING:
    from slime_hydra.config.schema import AlgoConfig
    from slime_hydra.train.teacher import Teacher


def split_steps(n: int, steps: int) -> List[List[int]]:
    """Rows ``0..n-1`` cut into ``steps`` optimiser steps of equal size, in order."""
    per_step = n // steps
    if per_step * steps != n:
        raise ValueError(f"{n} samples do not split into {steps} equal optimiser steps")
    return [list(range(s * per_step, (s + 1) * per_step)) for s in range(steps)]


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> float:
    """``algorithms.explained_variance`` over every data-parallel rank's tokens (``all_reduce``: a sum over ranks)."""
    if all_reduce is None:
        return float(A.explained_variance(values, returns, mask))
    m = mask.double()
    r = returns.double() * m
    e = (returns.double() - values.double()) * m
    n, sr, srr, se, see = all_reduce(torch.stack([m.sum(), r.sum(), (r * r).sum(), e.sum(), (e * e).sum()])).tolist()
    n = max(n, 1.0)
    var_r = srr / n - (sr / n) ** 2
    if var_r <= 0:
        return float("nan")
    return 1.0 - (see / n - (se / n) ** 2) / var_r


class OnDevice:
    """The step's per-row CPU tensors, each copied to the loss's device once, from pinned memory (pageable syncs)."""

    def __init__(self, **tensors: Optional[torch.Tensor]):
        self.cpu, self.moved = tensors, {}

    def __call__(self, name: str, idx: Sequence[int], device: torch.device) -> torch.Tensor:
        key = (name, str(device))
        if key not in self.moved:
            t = self.cpu[name]
            if device.type == "cuda":
                t = t.pin_memory().to(device, non_blocking=True)
            self.moved[key] = t.to(device)
        # contiguous rows (the backends keep them in order) as a slice: no index tensor copied from the host
        idx = list(idx)
        rows = slice(idx[0], idx[-1] + 1) if idx and idx == list(range(idx[0], idx[0] + len(idx))) else idx
        return self.moved[key][rows]


class RLTrainer:
    """The RL step over a backend, and its counters (saved in checkpoints through the backend)."""

    def __init__(self, backend: TrainerBackend, algo: "AlgoConfig", num_steps_per_rollout: int,
                 reuse_step_log_probs: bool = True, teacher: Optional["Teacher"] = None):
        """``reuse_step_log_probs=False``: always recompute the old policy's log-probs (see the module's docs).
        ``teacher``: on-policy distillation's (``algo=opd``), scoring the sampled tokens."""
        self.backend, self.algo, self.num_steps = backend, algo, num_steps_per_rollout
        self.reuse_step_log_probs = reuse_step_log_probs
        self.teacher = teacher
        if A.needs_teacher(algo) and teacher is None:
            raise ValueError("algo.advantage_estimator=opd needs a teacher (teacher.path)")
        self.needs_ref = A.needs_ref(algo)
        self.critic = backend.critic if A.needs_critic(algo) else None
        if A.needs_critic(algo) and self.critic is None:
            raise ValueError(f"algo.advantage_estimator={algo.advantage_estimator!r} trains a critic, which the "
                             f"{type(backend).__name__} trainer backend does not have")
        self.steps_done = 0  # policy optimiser steps
        self.rollouts_done = 0  # train() calls, critic-only ones included

    def state_dict(self) -> Dict[str, Any]:
        return {"steps_done": self.steps_done, "rollouts_done": self.rollouts_done}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.steps_done, self.rollouts_done = state["steps_done"], state["rollouts_done"]

    def train(self, data: Dict[str, list], *, temperature: float, max_response_len: int) -> Dict[str, float]:
        """Train on this rank's share of a rollout (:data:`slime_hydra.train.batch.TRAIN_KEYS`), every
        data-parallel rank at once; ``temperature``: the engines' sampling temperature; ``max_response_len``:
        the generation budget. Returns metrics averaged over the ranks."""
        be, algo, critic = self.backend, self.algo, self.critic
        n = len(data["tokens"])
        T = max(1, max(data["response_lengths"]))
        lr = be.lr  # the rate of this rollout's (first) step
        step_rows = split_steps(n, self.num_steps)
        step_mbs = [be.micro_batches(data, rows, T) for rows in step_rows]
        mbs = [mb for group in step_mbs for mb in group]
        if [i for mb in mbs for i in mb.indices] != list(range(n)):
            raise RuntimeError(f"{type(be).__name__}.micro_batches must keep the rows in order")
        rows = list(range(n))
        loss_mask = response_mask(data, rows, T)
        rollout_lp = response_tensor(data, "rollout_log_probs", rows, T)
        all_reduce = be.dp_all_reduce if be.dp_size > 1 else None
        metrics: Dict[str, float] = {}
        train_actor = self.rollouts_done >= algo.num_critic_only_steps  # else only the critic trains

        # 1. old-policy log-probs (none yet where the policy step's forward pass gives them; the
        #    rollout's where they are used as-is), the reference's, and the critic's values
        from_step = (self.reuse_step_log_probs and self.num_steps == 1 and train_actor and not algo.kl_coef
                     and self.teacher is None)
        logprob_gap = torch.zeros(())  # sum over response tokens of |trainer log-prob - engine log-prob|
        old_lp: Optional[torch.Tensor] = None
        if not from_step:
            old_lp = be.log_probs(mbs, temperature)
            logprob_gap = ((old_lp - rollout_lp).abs() * loss_mask).sum()
        if algo.use_rollout_logprobs:
            old_lp = rollout_lp
        ref_lp = be.log_probs(mbs, temperature, reference=True) if self.needs_ref else None
        values = critic.values(mbs) if critic is not None else None
        teacher_lp = self.teacher.log_probs(data, T, temperature) if self.teacher is not None else None
        # forward passes over the batch besides the training step's: the old policy's log-probs and the
        # reference's (2N FLOPs a token each, for the MFU); the critic's values are another model's, not counted
        metrics["extra_forward_passes"] = float(not from_step) + float(self.needs_ref)

        # 2. advantages (and the critic's targets) on the whole local batch; only KL reward shaping
        #    reads the old log-probs here, and then they were computed above
        rewards = torch.tensor(data["rewards"], dtype=torch.float32)
        adv, returns = A.compute_advantages(algo, rewards=rewards, loss_mask=loss_mask, old_log_probs=old_lp,
                                            ref_log_probs=ref_lp, values=values, all_reduce=all_reduce,
                                            teacher_log_probs=teacher_lp)
        if values is not None:  # how well the critic predicted these returns, before its update
            metrics["explained_variance"] = explained_variance(values, returns, loss_mask, all_reduce)

        # 3. the optimiser steps
        sums: Dict[str, float] = defaultdict(float)
        on = OnDevice(values=values, returns=returns, mask=loss_mask, rollout=rollout_lp, old=old_lp, ref=ref_lp,
                      adv=adv)
        gaps: List[torch.Tensor] = []  # per micro-batch, on the device: summed and read once, after the steps
        for these_rows, group in zip(step_rows, step_mbs):
            counts = be.dp_all_reduce(torch.tensor([float(len(these_rows)), float(loss_mask[these_rows].sum())]))
            reducer = A.Reducer(algo.loss_reduction, num_samples=int(counts[0]), num_tokens=int(counts[1]),
                                max_len=max_response_len)

            # these two closures run within this step, with its reducer (hence the B023 noqa)
            def value_loss(idx: Sequence[int], v: torch.Tensor):
                d = v.device
                return A.value_loss(algo, reducer, values=v, old_values=on("values", idx, d),  # noqa: B023
                                    returns=on("returns", idx, d), loss_mask=on("mask", idx, d))

            def policy_loss(idx: Sequence[int], lp: torch.Tensor, entropy: torch.Tensor):
                d = lp.device
                mask, rollout = on("mask", idx, d), on("rollout", idx, d)
                if from_step:  # this forward pass is the old policy's; the gap stays on the device until the end
                    gaps.append(((lp.detach().float() - rollout).abs() * mask).sum())
                old = lp.detach() if old_lp is None else on("old", idx, d)
                return A.policy_loss(
                    algo, reducer, log_probs=lp, old_log_probs=old, advantages=on("adv", idx, d),  # noqa: B023
                    loss_mask=mask, ref_log_probs=None if ref_lp is None else on("ref", idx, d),
                    rollout_log_probs=rollout, entropy=entropy)

            step_metrics: Dict[str, float] = {}
            if critic is not None:
                result = critic.train_step(group, value_loss)
                step_metrics.update(result.metrics, critic_grad_norm=result.grad_norm)
            if train_actor:
                result = be.train_step(group, temperature, policy_loss)
                step_metrics.update(result.metrics, grad_norm=result.grad_norm)
                self.steps_done += 1
            for key, v in step_metrics.items():
                sums[key] += v / self.num_steps
        self.rollouts_done += 1
        if gaps:
            logprob_gap = logprob_gap + torch.stack(gaps).sum().cpu()

        # 4. over every rank, in one reduction: token means of the log-prob gap, |advantage| and the critic's
        #    values; step averages (sums of per-rank shares; the gradient norms, the same on every rank: their mean)
        value_sum = (values * loss_mask).sum() if values is not None else torch.tensor(0.0)
        # on-policy distillation: the sampled tokens' reverse KL to the teacher, log p_student - log p_teacher
        kl_sum = ((old_lp - teacher_lp) * loss_mask).sum() if teacher_lp is not None else torch.tensor(0.0)
        keys = sorted(sums)
        totals = be.dp_all_reduce(torch.stack([loss_mask.float().sum(), logprob_gap.float(),
                                               (adv.abs() * loss_mask).sum(), value_sum.float(), kl_sum.float(),
                                               *[torch.tensor(float(sums[k])) for k in keys]]))
        tokens = float(totals[0].clamp(min=1))
        if not A.is_sft(algo):  # SFT's samples are labels: no engine log-probs to compare
            metrics["train_rollout_logprob_abs_diff"] = float(totals[1]) / tokens
        if teacher_lp is not None:
            metrics["opd_reverse_kl"] = float(totals[4]) / tokens
        metrics["advantage_abs_mean"] = float(totals[2]) / tokens
        if values is not None:
            metrics["values_mean"] = float(totals[3]) / tokens
        metrics["lr"] = lr
        if critic is not None:
            metrics["critic_lr"] = critic.lr
        for key, v in zip(keys, totals[5:].tolist()):
            metrics[key] = v / (be.dp_size if key.endswith("grad_norm") else 1)
        return metrics
