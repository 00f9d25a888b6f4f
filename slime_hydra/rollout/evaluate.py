"""Evaluation on ``eval.datasets``, all concurrently, each with its own sampling: ``eval/<name>/reward``,
response length, truncated ratio, pass@k, turns and tool calls, and a few examples."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from slime_hydra.data.sample import Sample, Status
from slime_hydra.rollout.sampling import GroupSampler, agent_metrics, sampling_params

if TYPE_CHECKING:
    from slime_hydra.config.schema import DataConfig, EvalDatasetConfig, RolloutConfig
    from slime_hydra.data.dataset import Row


@dataclass
class EvalSet:
    cfg: "EvalDatasetConfig"
    rows: List["Row"]
    prompts: List[str]  # rendered, in row order

    def groups(self) -> List[List[Sample]]:
        """One group of ``n_samples_per_prompt`` fresh samples per prompt."""
        k = self.cfg.n_samples_per_prompt
        groups = []
        for i, (row, prompt) in enumerate(zip(self.rows, self.prompts)):
            meta = dict(row.metadata, source=row.source)
            if row.tools is not None:
                meta["tools"] = row.tools
            groups.append([Sample(prompt=prompt, label=row.label, metadata=dict(meta), group_index=i, index=i * k + j)
                           for j in range(k)])
        return groups


def load_eval_sets(datasets: Sequence["EvalDatasetConfig"], data: "DataConfig", tokenizer: Any,
                   max_prompt_len: Optional[int] = None) -> Dict[str, EvalSet]:
    """``eval.datasets`` read and rendered as ``data`` renders prompts, by name."""
    from slime_hydra.data.source import load_eval_dataset

    return {ds.name: EvalSet(ds, *load_eval_dataset(ds, data, tokenizer, max_prompt_len)) for ds in datasets}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``c`` passing samples out of ``n`` (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


class Evaluator:
    """``sets`` sampled through ``sampler`` with ``rollout``'s sampling parameters overridden per dataset."""

    def __init__(self, sets: Dict[str, EvalSet], sampler: GroupSampler, rollout: "RolloutConfig",
                 reward_key: Optional[str] = None, log_samples: int = 0):
        self.sets, self.sampler, self.rollout = sets, sampler, rollout
        self.reward_key, self.log_samples = reward_key, log_samples

    async def run(self) -> Dict[str, Any]:
        parts = await asyncio.gather(*(self.dataset(name) for name in self.sets))
        return {k: v for part in parts for k, v in part.items()}

    async def dataset(self, name: str) -> Dict[str, Any]:
        """One dataset's metrics; pass@k for k = 1, 2, 4, ... and n_samples_per_prompt (a pass: reward > 0)."""
        es = self.sets[name]
        k = es.cfg.n_samples_per_prompt
        sp = sampling_params(self.rollout, es.cfg)
        done = await asyncio.gather(*(self.sampler.group(g, sp, True) for g in es.groups()))
        rewards = [[s.reward_value(self.reward_key) for s in g] for g in done]
        flat = [r for g in rewards for r in g]
        samples = [s for g in done for s in g]
        out: Dict[str, Any] = {
            f"eval/{name}/reward": sum(flat) / len(flat),
            f"eval/{name}/response_len": sum(s.response_length for s in samples) / len(flat),
            f"eval/{name}/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / len(flat)}
        if k > 1:
            for kk in sorted({2 ** i for i in range(k.bit_length()) if 2 ** i <= k} | {k}):
                passed = [pass_at_k(k, sum(r > 0 for r in g), kk) for g in rewards]
                out[f"eval/{name}/pass@{kk}"] = sum(passed) / len(passed)
        out.update(agent_metrics(samples, f"eval/{name}/"))
        out[f"eval/{name}/examples"] = [
            {"prompt": s.prompt, "response": s.response, "label": s.label, "reward": s.reward}
            for s in [g[0] for g in done[: self.log_samples]]]
        return out
