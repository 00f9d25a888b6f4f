"""A stand-in for torchvision, so that sglang 0.5.17's ServerArgs parser imports without it.

Installed next to sglang by tests/sglang_parser/install.py. sglang imports torchvision at module level
(``torchvision.io.decode_jpeg`` in sglang/srt/utils/common.py, ``torchvision.transforms`` in its
multimodal configs) for image inputs that parsing arguments never touches; a real torchvision must match
torch's exact version and brings its own kernels. Every ``torchvision.*`` submodule imports here as a
module of inert placeholders (the triton stand-in's). transformers takes it for a torchvision (sglang's
image-processor registrations need one) of version 0.0.0; nothing that parses arguments runs it.
"""

import importlib.abc
import importlib.machinery
import sys
import types

from triton import _Placeholder

__version__ = "0.0.0"


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds any ``torchvision.<x>`` as a package of placeholders."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder()


sys.meta_path.append(_Submodules())
