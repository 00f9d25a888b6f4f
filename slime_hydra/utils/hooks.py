"""The one place that turns a user hook into a callable.

Every hook in the config (reward.custom, data.buffer_filter, rollout.generate, ...) is either a
dotted path ``"pkg.mod.fn"``, a Hydra node ``{_target_: pkg.mod.fn, **kwargs}`` (the extra keys are
bound as keyword arguments), or already a callable. Errors name the spec, so a typo in a config is
reported as such and not as a bare ``ModuleNotFoundError`` deep inside a rollout.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Mapping


class HookError(ValueError):
    """A hook spec that cannot be turned into a callable."""


def _import_dotted(spec: str) -> Any:
    """Import the longest importable module prefix of ``spec`` and walk the rest as attributes
    (so ``pkg.mod.Class.method`` works as well as ``pkg.mod.fn``)."""
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
            # Only "this very module (or a parent) is missing" means "try a shorter prefix";
            # a missing import *inside* the user's module is their bug, reported as is.
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

    target = spec.get("_target_")
    # plain dicts / lists for the bound kwargs (not DictConfig), unless the node says otherwise
    extra = {} if "_convert_" in spec else {"_convert_": "all"}
    try:
        return instantiate(spec, _partial_=True, **extra)
    except Exception as e:  # hydra wraps import errors in its own exception types
        detail = OmegaConf.to_container(spec) if OmegaConf.is_config(spec) else dict(spec)
        raise HookError(f"hook {detail!r}: cannot instantiate {target!r}: {e}") from e


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
    """Call ``fn``; await the result if it is awaitable (async functions, partials of them, or sync
    functions returning a coroutine). Sync functions run directly in the caller's thread."""
    result = fn(*args, **kw)
    if inspect.isawaitable(result):
        result = await result
    return result
