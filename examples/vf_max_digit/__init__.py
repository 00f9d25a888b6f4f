"""A verifiers taskset that the tiny CPU model can earn: the largest digit of four ("3815=" -> "8").

    python run.py experiment=verifiers_max_digit

Written for verifiers (``verifiers.v1``) alone: a task type, a ``@vf.reward`` and a taskset that yields the
tasks; ``rollout.agent=verifiers rollout.agent_env=examples.vf_max_digit`` trains on it (docs/recipes/agents.md).
"""

from __future__ import annotations

import random

import verifiers.v1 as vf
from verifiers.v1.types import content_text


class MaxDigitData(vf.TaskData):
    answer: str


class MaxDigitTask(vf.Task[MaxDigitData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the reply starts with the largest digit."""
        reply = content_text(trace.messages[-1].content) if trace.messages else ""
        return float(reply.strip()[:1] == self.data.answer)


class MaxDigitTaskset(vf.Taskset[MaxDigitTask]):
    def load(self):
        rng = random.Random(0)
        for code in rng.sample(range(10**4), 512):
            digits = f"{code:04d}"
            yield MaxDigitTask(MaxDigitData(prompt=digits + "=", answer=max(digits)), self.config.task)


__all__ = ["MaxDigitTaskset"]
