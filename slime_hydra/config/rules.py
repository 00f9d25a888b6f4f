"""Helpers for the components' config rules (``slime_hydra/*/rules.py``: ``check(cfg) -> list of problems``,
each ``<dotted.path>: <what is wrong>``), so that the common cases are worded the same everywhere."""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Iterable, List, Tuple, Type

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def choice(errs: List[str], path: str, value: Any, allowed: Iterable[Any]) -> bool:
    """Whether ``value`` is allowed; if not, one problem naming the allowed values."""
    allowed = list(allowed)
    if value not in allowed:
        errs.append(f"{path}: {value!r} is not one of {allowed}")
        return False
    return True


def looks_local(path: str) -> bool:
    """A filesystem path rather than a Hugging Face hub id like ``Qwen/Qwen3-4B``."""
    return path.startswith(("/", ".", "~")) or os.sep in path and not HUB_ID.match(path)


def data_file(path: str) -> str:
    """Strip an optional row slice: ``data.jsonl@[0:100]`` -> ``data.jsonl``."""
    return path.split("@[", 1)[0]


def loads(errs: List[str], where: str, load: Callable[[], Any], explained: Tuple[Type[Exception], ...] = ()) -> Any:
    """``load()`` (a hook import, a dataset read), or None with its failure as one problem of ``where``.
    ``explained``: error types whose message says enough (HookError always); others are reported with their type."""
    from slime_hydra.utils.hooks import HookError

    try:
        return load()
    except (HookError, *explained) as e:
        errs.append(f"{where}: {e}")
    except Exception as e:  # noqa: BLE001 - the user's module or file failed in its own way
        errs.append(f"{where}: {type(e).__name__}: {e}")
    return None
