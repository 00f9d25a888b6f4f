"""The one place that turns a user hook into a callable: a dotted path ``"pkg.mod.fn"``, a Hydra node
``{_target_: pkg.mod.fn, **kwargs}`` (the extra keys bound as keyword arguments), or a callable. Errors
name the spec, so a typo in a config is reported as such.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Mapping


class HookError(ValueError):
    """A hook spec that cannot be turned into a callable."""


def _import_dotted(spec: str) -> Any:
    """Import the longest importable module prefix of ``spec`` and walk the rest as attributes."""
    parts = spec.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise HookError(f"hook {spec!r}: expected a dotted path like 'package.module.function'")
    module, n_mod = None, 0
    for n in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:n])
        try:
            module, n_mod = importlib.import_module(name), n
            break
        except ModuleNotFoundError as e:
            # this very module (or a parent) missing means "try a shorter prefix"; one it imports is a bug
            if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
                raise HookError(f"hook {spec!r}: importing {name!r} failed: {e}") from e
    if module is None:
        raise HookError(f"hook {spec!r}: no module {'.'.join(parts[:-1])!r} can be imported")
    obj = module
    for i in range(n_mod, len(parts)):
        if not hasattr(obj, parts[i]):
            where = ".".join(parts[:i])
            hint = f" (and no module {'.'.join(parts[:i + 1])!r})" if inspect.ismodule(obj) else ""
            raise HookError(f"hook {spec!r}: {where!r} has no attribute {parts[i]!r}{hint}")
        obj = getattr(obj, parts[i])
    return obj


def _instantiate(spec: Any) -> Any:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    extra = {} if "_convert_" in spec else {"_convert_": "all"}  # plain dicts for the bound kwargs
    try:
        return instantiate(spec, _partial_=True, **extra)
    except Exception as e:  # hydra wraps import errors in its own exception types
        detail = OmegaConf.to_container(spec) if OmegaConf.is_config(spec) else dict(spec)
        raise HookError(f"hook {detail!r}: cannot instantiate {spec.get('_target_')!r}: {e}") from e


def load_hook(spec: Any) -> Callable:
    """``spec`` (dotted path, ``_target_`` dict / DictConfig, or callable) -> a callable."""
    from omegaconf import OmegaConf

    if spec is None:
        raise HookError("hook spec is None")
    if isinstance(spec, str):
        fn = _import_dotted(spec.strip())
    elif isinstance(spec, Mapping) or OmegaConf.is_dict(spec):
        if "_target_" not in spec:
            raise HookError(f"hook {dict(spec)!r}: a mapping needs a '_target_' key")
        fn = _instantiate(spec)
    elif callable(spec):
        return spec
    else:
        raise HookError(f"hook {spec!r}: expected a dotted path, a _target_ mapping or a callable, "
                        f"got {type(spec).__name__}")
    if not callable(fn):
        raise HookError(f"hook {spec!r}: resolves to a {type(fn).__name__}, which is not callable")
    return fn


async def call_maybe_async(fn: Callable, *args: Any, **kw: Any) -> Any:
    """Call ``fn`` (sync ones in the caller's thread); await the result if it is awaitable."""
    result = fn(*args, **kw)
    if inspect.isawaitable(result):
        result = await result
    return result
