"""String rewards: exact match and SQuAD token F1. Pure functions ``(response, label) -> float``."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any, List


def _norm_exact(x: Any) -> str:
    s = str(x).strip()
    return s[:-1].rstrip() if s.endswith(".") else s


def exact_reward(response: str, label: Any) -> float:
    """1.0 when the response equals the label after stripping whitespace and one trailing period."""
    return 1.0 if _norm_exact(response) == _norm_exact(label) else 0.0


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def squad_tokens(text: Any) -> List[str]:
    """SQuAD normalisation: lower case, no punctuation, no articles, split on whitespace."""
    s = "".join(ch for ch in str(text).lower() if ch not in _PUNCT)
    return _ARTICLES.sub(" ", s).split()


def f1_reward(response: str, label: Any) -> float:
    """Token-level F1 between response and label (SQuAD); a list label scores its best answer."""
    if isinstance(label, (list, tuple)):
        return max((f1_reward(response, x) for x in label), default=0.0)
    pred, gold = squad_tokens(response), squad_tokens(label)
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)
