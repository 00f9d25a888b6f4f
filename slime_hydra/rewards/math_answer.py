"""Math answer reward: extract the final answer of a response and compare it with the label by
mathematical equivalence (math_verify: ``\\frac{1}{2}`` == ``0.5``, ``5\\text{ cm}`` == ``5``, ...).

Extraction: the text after the last ``</think>`` (a response that opens ``<think>`` and never closes
it has no answer), then the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced),
else the last number, or the ``$...$`` span around it when the last number sits inside one.

math_verify bounds parsing and comparison with ``signal.alarm``, which only works in the main thread
(elsewhere it raises). So the timeouts are passed only there and are None (no limit) in other threads;
the async reward runs this in worker processes, whose main thread keeps the limit (``math_pool``).
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any, List, Optional

log = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 1000  # sympy on a huge expression can take minutes; such answers score 0
# a leading minus is a sign only when it does not follow an operand ("5-3" ends with 3, not -3)
_NUMBER = re.compile(r"(?:(?<![\w)}])-)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|\.\d+)")
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` with nested braces, or None (also when unbalanced)."""
    starts = [m.end() for m in _BOX.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def last_number(text: str) -> Optional[str]:
    """The last number, or the whole ``$...$`` / ``\\(...\\)`` span containing it (so
    ``$\\frac{1}{2}$`` gives ``\\frac{1}{2}``, not ``2``)."""
    nums = list(_NUMBER.finditer(text))
    if not nums:
        return None
    last = nums[-1]
    for span in _MATH_SPAN.finditer(text):
        if span.start() <= last.start() and last.end() <= span.end():
            return next(g for g in span.groups() if g is not None)
    return last.group()


def extract_answer(response: str) -> Optional[str]:
    """The final answer of a response, or None."""
    if "</think>" in response:
        response = response.rsplit("</think>", 1)[1]
    elif "<think>" in response:
        return None  # still thinking: cut off before an answer
    boxed = last_boxed(response)
    return boxed if boxed is not None else last_number(response)


def _clean(ans: str) -> str:
    ans = ans.strip().strip("$").strip()
    ans = re.sub(r"(?<=\d)\\[,!; ](?=\d{3}\b)", "", ans)  # thin-space thousands: 1\,000
    return ans.rstrip(".").strip()


def _parse(ans: str, timeout: Optional[int]) -> List[Any]:
    from math_verify import parse

    cleaned = _clean(ans)
    if not cleaned:
        return []
    # The $...$ anchor makes math_verify read the whole string as LaTeX (\frac12, 5\text{ cm}).
    return parse(f"${cleaned}$", parsing_timeout=timeout) or parse(cleaned, parsing_timeout=timeout)


def _signal_timeout(timeout_s: Optional[int]) -> Optional[int]:
    """math_verify's timeout argument: ``timeout_s`` in the main thread, None elsewhere."""
    return timeout_s if threading.current_thread() is threading.main_thread() else None


def math_equal(answer: str, label: Any, timeout_s: Optional[int] = 5) -> bool:
    """Is ``answer`` mathematically equal to ``label``? Never raises; a timeout counts as unequal."""
    from math_verify import verify

    timeout = _signal_timeout(timeout_s)
    try:
        gold_text = str(label)
        gold_text = last_boxed(gold_text) or gold_text
        if len(answer) > MAX_ANSWER_CHARS or len(gold_text) > MAX_ANSWER_CHARS:
            return False
        gold, pred = _parse(gold_text, timeout), _parse(answer, timeout)
        if not gold or not pred:
            return _clean(answer) == _clean(gold_text) != ""
        return bool(verify(gold, pred, timeout_seconds=timeout))
    except Exception as e:  # sympy can raise nearly anything on odd input
        log.debug("math_equal(%r, %r) failed: %s", answer, label, e)
        return False


def math_reward(response: str, label: Any, timeout_s: Optional[int] = 5) -> float:
    """1.0 when the extracted answer equals the label mathematically, else 0.0. ``timeout_s`` (whole
    seconds) bounds each parse and comparison when called in the main thread."""
    answer = extract_answer(response)
    return 1.0 if answer is not None and math_equal(answer, label, timeout_s) else 0.0
