"""Checks that answer after validation: a component's ``check`` that would wait (a parser in a child process)
leaves its check running within ``deferred_checks``, and the run takes the answers while its parts start,
before a trainer starts (launch/loop.py)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional, Protocol


class DeferredCheck(Protocol):
    def problems(self) -> List[str]:
        """Validation's problems (waits for the answer)."""

    def kill(self) -> None:
        """Not needed any more (validation failed anyway)."""


_pending: Optional[List[DeferredCheck]] = None


@contextlib.contextmanager
def deferred_checks() -> Iterator[List[DeferredCheck]]:
    """Within, ``defer`` appends the checks it starts to the yielded list."""
    global _pending
    outer, _pending = _pending, []
    try:
        yield _pending
    finally:
        _pending = outer


def defer(start: Callable[[], DeferredCheck]) -> bool:
    """Within ``deferred_checks``: start the check and leave it running (True); outside, nothing (False)."""
    if _pending is None:
        return False
    _pending.append(start())
    return True
