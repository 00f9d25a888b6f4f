"""verifiers (``verifiers.v1``) tasksets as datasets: ``data.source=verifiers`` (``rollout.agent=verifiers``).

A taskset is named by its module name or hub id (``owner/name``), or by a dotted module path; tasksets whose tasks
need tool servers or a container are refused (:mod:`slime_hydra.rollout.verifiers_env` runs episodes in process).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Dict, List

INSTALL = "rollout.agent=verifiers needs the verifiers extra: pip install 'slime_hydra[verifiers]'"


@functools.cache
def taskset(env: str) -> Any:
    """The installed taskset ``env``, loaded with its default config; ValueError saying why it cannot run here."""
    try:
        from verifiers.v1 import Taskset, TasksetConfig
        from verifiers.v1.utils import loaders
        from verifiers.v1.utils.generic import concrete_type
    except ImportError as e:
        raise ValueError(f"{INSTALL} ({e})") from e
    try:
        cls = loaders.taskset_class(env) if "." not in env else _exported(importlib.import_module(env))
    except (ModuleNotFoundError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"rollout.agent_env={env!r} is not an installed verifiers taskset: {e}") from e
    ts = cls(loaders.taskset_config_type(env)(id=env) if "." not in env else
             (concrete_type(cls, TasksetConfig, origin=Taskset) or TasksetConfig)(id=env))
    task_cls = cls.task_type()
    if task_cls.NEEDS_CONTAINER or task_cls.toolsets(ts.config.task) or cls.toolsets(ts.config):
        raise ValueError(f"rollout.agent_env={env!r}: its tasks need tool servers or a container; rollout.agent="
                         "verifiers runs tool-less chat tasks in process")
    return ts


def _exported(module: Any) -> Any:
    """A dotted module's taskset (verifiers resolves only top-level names): its ``__all__``'s Taskset subclass."""
    from verifiers.v1 import Taskset

    found = [c for n in getattr(module, "__all__", []) if isinstance(c := getattr(module, n, None), type)
             and issubclass(c, Taskset) and c is not Taskset]
    if len(found) != 1:
        raise TypeError(f"{module.__name__} must export exactly one Taskset subclass in __all__, found {found}")
    return found[0]


@functools.cache
def tasks(env: str) -> List[Any]:
    return list(taskset(env))


def rows(env: str) -> List[Dict[str, Any]]:
    """The taskset's tasks as dataset records: the prompt, and the task's index as metadata."""
    out = []
    for task in tasks(env):
        p = task.data.prompt
        prompt = p if isinstance(p, str) else [m.model_dump(exclude_none=True) for m in p or []]
        out.append({"prompt": prompt, "metadata": {"vf_task": task.data.idx}})
    return out
