"""triton.language placeholders (``tl.constexpr``, ``tl.program_id``, ...); see triton/__init__.py."""

from triton import _Placeholder


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder()
