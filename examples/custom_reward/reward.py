"""Custom rewards on the built-in digits task (``3815=`` -> ``8``), for docs/recipes/custom-reward.md, and one for
word problems, for docs/recipes/smoke-test.md.

    python run.py reward.type=custom reward.custom._target_=examples.custom_reward.reward.digit_distance
    python run.py reward.type=custom reward.custom=examples.custom_reward.reward.rank_in_group reward.group=true

A reward is ``rm(cfg, sample) -> float | dict`` (``cfg`` is the RewardConfig), or with ``reward.group=true``
``rm(cfg, samples) -> list`` over one prompt's samples; sync or async. Keyword arguments come from the
``_target_`` node. A reward that raises or returns None or NaN stops the run with the sample's identity.
"""

from __future__ import annotations

import re
from typing import Any, List

from slime_hydra.data.sample import Sample


def digit_distance(cfg: Any, sample: Sample, scale: float = 9.0) -> float:
    """1 for the right digit, less the further the answer is from it, 0 when it is not a digit: a
    denser signal than exact match (partial credit for close answers)."""
    answer = sample.response.strip()[:1]
    if not answer.isdigit():
        return 0.0
    return max(0.0, 1.0 - abs(int(answer) - int(sample.label)) / scale)


def rank_in_group(cfg: Any, samples: List[Sample]) -> List[float]:
    """A group reward: every sample of the prompt is scored at once, here 1 for the right answer and
    0.5 for the group's most common wrong answer (a reward that needs the whole group)."""
    answers = [s.response.strip()[:1] for s in samples]
    wrong = [a for a, s in zip(answers, samples) if a != str(s.label)]
    common = max(set(wrong), key=wrong.count) if wrong else None
    return [1.0 if a == str(s.label) else 0.5 if a == common else 0.0 for a, s in zip(answers, samples)]


def first_number(cfg: Any, sample: Sample) -> float:
    """1 when the first number of the answer is the label ("Er hat 7 Äpfel." for "7"), 0.1 for another number
    (the answer has the right form), 0 for an answer without one."""
    found = re.search(r"-?\d+(?:[.,]\d+)?", sample.response)
    if found is None:
        return 0.0
    return 1.0 if found.group().replace(",", ".") == str(sample.label) else 0.1
