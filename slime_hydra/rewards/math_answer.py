"""Math answer reward: the final answer of a response (after the last ``</think>``: the last ``\\boxed{...}``,
else the last number or the ``$...$`` span around it) compared with the label by mathematical equivalence
(math_verify: ``\\frac{1}{2}`` == ``0.5``). math_verify's ``signal.alarm`` timeouts work only in the main
thread, so they are passed only there (``math_pool`` runs checks in worker processes). Failures follow the
rule in :mod:`slime_hydra.rewards.hub`.
"""

from __future__ import annotations

import re
import threading
from typing import Any, List, Optional, Tuple

from slime_hydra.rewards import counters

MAX_ANSWER_CHARS = 1000  # sympy on a huge expression can take minutes; such answers score 0
# a leading minus is a sign only when it does not follow an operand ("5-3" ends with 3, not -3)
_NUMBER = re.compile(r"(?:(?<![\w)}])-)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|\.\d+)")
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_verifier_checked = False  # check_verifier passed in this process
Failure = Optional[Tuple[str, str]]  # (counter name, what happened), None when the check ran


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
    return (parse(f"${cleaned}$", parsing_timeout=timeout, raise_on_error=True)
            or parse(cleaned, parsing_timeout=timeout, raise_on_error=True))


def _signal_timeout(timeout_s: Optional[int]) -> Optional[int]:
    """math_verify's timeout argument: ``timeout_s`` in the main thread, None elsewhere."""
    return timeout_s if threading.current_thread() is threading.main_thread() else None


def _equal(answer: str, label: Any, timeout: Optional[int]) -> bool:
    """math_verify's verdict; raises what it raises (its TimeoutException included)."""
    from math_verify import verify

    gold_text = str(label)
    gold_text = last_boxed(gold_text) or gold_text
    if len(answer) > MAX_ANSWER_CHARS or len(gold_text) > MAX_ANSWER_CHARS:
        return False
    gold, pred = _parse(gold_text, timeout), _parse(answer, timeout)
    if not gold or not pred:
        return _clean(answer) == _clean(gold_text) != ""
    return bool(verify(gold, pred, timeout_seconds=timeout, raise_on_error=True))


def check_verifier() -> None:
    """Raise unless math_verify finds ``1/2 == 0.5`` and ``1/2 != 0.6`` (once per process)."""
    global _verifier_checked
    if _verifier_checked:
        return
    try:
        timeout = _signal_timeout(5)
        ok = _equal(r"\frac{1}{2}", "0.5", timeout) and not _equal(r"\frac{1}{2}", "0.6", timeout)
        why = "" if ok else "it got them wrong"
    except BaseException as e:  # noqa: BLE001 - math_verify's TimeoutException is a BaseException
        ok, why = False, f"{type(e).__name__}: {e}"
    if not ok:
        from importlib.metadata import version

        raise RuntimeError(f"math reward: math_verify {version('math-verify')} cannot check 1/2 == 0.5 ({why}); its "
                           "API or install is broken, and every math reward would be 0")
    _verifier_checked = True


def _judge(answer: str, label: Any, timeout_s: Optional[int], who: str, what: str) -> Tuple[bool, Failure]:
    """(whether ``answer`` equals ``label``, the failure if the verifier raised or ran out of time)."""
    from math_verify.errors import TimeoutException

    check_verifier()
    try:
        return _equal(answer, label, _signal_timeout(timeout_s)), None
    except TimeoutException:
        return False, ("reward_verifier_timeout", f"{who}: math_verify ran over {timeout_s}s on {what}")
    except Exception as e:  # noqa: BLE001 - sympy can raise nearly anything on odd input
        return False, ("reward_verifier_error", f"{who}: math_verify raised {type(e).__name__}: {str(e)[:200]} "
                                                f"on {what}")


def math_verdict(response: str, label: Any, timeout_s: Optional[int] = 5) -> Tuple[float, Failure]:
    """(1.0 when the extracted answer equals the label mathematically else 0.0, the failure if the verifier
    raised or ran out of time). ``timeout_s`` (whole seconds) holds in the main thread. Counts nothing."""
    check_verifier()
    answer = extract_answer(response)
    if answer is None:
        return 0.0, None
    what = f"answer {answer[:200]!r}, label {str(label)[:200]!r}"
    ok, failure = _judge(answer, label, timeout_s, "math reward", what)
    return float(ok), failure and (failure[0], failure[1] + "; scored 0")


def math_equal(answer: str, label: Any, timeout_s: Optional[int] = 5) -> bool:
    """Is ``answer`` (already extracted) mathematically equal to ``label``? A verifier failure is counted."""
    ok, failure = _judge(answer, label, timeout_s, "math_equal", f"{answer[:200]!r}")
    if failure is not None:
        counters.count(*failure)
    return ok


def math_reward(response: str, label: Any, timeout_s: Optional[int] = 5) -> float:
    """``math_verdict``'s score; a verifier failure is counted here."""
    score, failure = math_verdict(response, label, timeout_s)
    if failure is not None:
        counters.count(*failure)
    return score
