"""Name tables whose entries are imported only when used: a ``LazyRegistry`` maps a config name to
``"package.module:attribute"``, so validation reads the allowed names without importing torch and the like.
``lazy_attributes`` gives a package the same laziness for its re-exported functions.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Iterator, Mapping


class LazyRegistry(Mapping[str, Any]):
    """A read-only mapping ``name -> object``; iterating and ``in`` import nothing."""

    def __init__(self, kind: str, targets: Mapping[str, str]):
        for name, target in targets.items():
            if ":" not in target:
                raise ValueError(f"{kind} {name!r}: target {target!r} is not 'package.module:attribute'")
        self.kind = kind  # for messages: "advantage estimator", "reward type", ...
        self._targets = dict(targets)
        self._loaded: Dict[str, Any] = {}

    def target(self, name: str) -> str:
        """Where ``name`` lives, without importing it."""
        if name not in self._targets:
            raise KeyError(f"unknown {self.kind} {name!r}; expected one of {list(self._targets)}")
        return self._targets[name]

    def __getitem__(self, name: str) -> Any:
        if name not in self._loaded:
            module, _, attribute = self.target(name).partition(":")
            self._loaded[name] = getattr(importlib.import_module(module), attribute)
        return self._loaded[name]

    def __contains__(self, name: object) -> bool:
        return name in self._targets

    def __iter__(self) -> Iterator[str]:
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)

    def __repr__(self) -> str:
        return f"LazyRegistry({self.kind!r}, {self._targets!r})"


def lazy_attributes(package: str, modules: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` (PEP 562) for ``package``: ``name`` is imported from
    ``package.<modules[name]>`` on first access."""

    def __getattr__(name: str) -> Any:
        if name not in modules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{modules[name]}"), name)

    return __getattr__
