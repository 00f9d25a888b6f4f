"""triton.language.extra placeholders; see triton/__init__.py."""

from triton import _Placeholder


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder()
