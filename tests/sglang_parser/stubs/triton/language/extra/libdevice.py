"""triton.language.extra.libdevice placeholders (sglang 0.5.17 imports it for its FLA kernels); see
triton/__init__.py."""

from triton import _Placeholder


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder()
