"""A stand-in for triton (1 GB), so that sglang's ServerArgs parser imports on a machine without it.

Installed next to sglang by tests/sglang_parser/install.py. sglang imports triton at module level
(sglang/srt/utils/common.py) to decorate kernels that parsing arguments never runs: every public
attribute here is an inert placeholder (decorators return the function they decorate).

It keeps torch and transformers from mistaking it for a real triton:
- ``__version__`` is "0.0.0", below every minimum that transformers checks (``is_triton_available()``).
- torch's cached ``has_triton_package()`` is answered False while this module is being imported,
  so torch's inductor never imports triton submodules that do not exist here.
A process with this stub on its path still must not use ``torch.compile``.
"""

import sys

__version__ = "0.0.0"


class _Placeholder:
    """Any attribute, call, subscript or decoration: another placeholder, or the decorated function."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # @triton.jit, @triton.autotune(...)(fn), ...
        return _Placeholder()

    def __getattr__(self, name):
        if name.startswith("__"):  # inspect, pickle, copy: behave like an ordinary object
            raise AttributeError(name)
        return _Placeholder()

    def __getitem__(self, item):
        return _Placeholder()

    def __mro_entries__(self, bases):  # class K(triton.X): ...
        return (object,)


class _Driver:
    @property
    def active(self):  # what triton says on a machine without a GPU; sglang then assumes a CPU device
        raise RuntimeError("0 active drivers ([]). There should only be one.")


class _Runtime(_Placeholder):
    driver = _Driver()


runtime = _Runtime()  # sglang 0.5.17 asks triton.runtime.driver.active for the device at import time


def __getattr__(name):
    if name.startswith("__"):  # module dunders (__file__, __path__, ...) must stay real or absent
        raise AttributeError(name)
    return _Placeholder()


def _hide_from_torch() -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return
    me = sys.modules.get(__name__)
    sys.modules[__name__] = None  # `import triton` raises ImportError while torch looks
    try:
        from torch.utils import _triton

        _triton.has_triton_package()  # functools.cache: False from now on
    except Exception:
        pass
    finally:
        sys.modules[__name__] = me


_hide_from_torch()
