"""Imported by ``sglang_launch``'s forkserver, and only there: the modules SGLang's workers import first,
imported without CUDA, then a word to the launcher on whether its workers may be forked from here.

A process forked after CUDA was initialised cannot use CUDA. So, while the modules import:
- the GPU's compute capability, which SGLang's modules ask for as they import, is read from NVML (the same
  answer; a function that kept a reference to it asks torch again once CUDA is initialised, in the worker);
- ``torch.cuda.is_available()`` and ``device_count()`` use NVML too (``PYTORCH_NVML_BASED_CUDA_CHECK``, set
  by the launcher for this process only);
- anything else that would initialise CUDA through torch raises ``CudaAtImport``: that module, and those that
  were importing it, are left for the worker to import.
A library may still touch the CUDA driver without torch (sgl_kernel loads its kernels as it imports: a worker
forked after that failed with "CUDA error: initialization error" on the H200). So at the end a child is forked
and initialises CUDA, as a worker would; only if it can are the workers forked from here, else they are
spawned, as SGLang starts them. ``STATUS_ENV`` names the file that says which (JSON, written whole).
"""

from __future__ import annotations

import importlib
import json
import os
import time
from typing import Any, Callable, Dict, List, Optional

MODULES_ENV = "SLIME_HYDRA_SGLANG_PRELOAD"  # comma-separated modules to import
STATUS_ENV = "SLIME_HYDRA_SGLANG_PRELOAD_STATUS"  # where to write what happened
# torch's entry points that initialise CUDA (refused while the modules import)
CUDA_ENTRY_POINTS = ("_cuda_init", "_cuda_getDeviceCount")


class CudaAtImport(ImportError):
    """A module asked torch to initialise CUDA while it was imported in the forkserver."""


def _refuse(*_args: Any, **_kwargs: Any) -> Any:
    raise CudaAtImport("CUDA would be initialised in the forkserver")


def nvml_capability(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.cuda.get_device_capability`` answered by NVML until CUDA is initialised, then by ``original``."""

    def get_device_capability(device: Any = None) -> Any:
        import torch

        if torch.cuda.is_initialized():
            return original(device)
        import pynvml

        pynvml.nvmlInit()
        index = device.index if isinstance(device, torch.device) else device  # None, an int or "cuda:N"
        index = int(str(index).rsplit(":", 1)[-1]) if index not in (None, "cuda") else 0
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        entry = visible[index].strip() if visible else str(index)
        handle = (pynvml.nvmlDeviceGetHandleByIndex(int(entry)) if entry.isdigit()
                  else pynvml.nvmlDeviceGetHandleByUUID(entry))
        return tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))

    return get_device_capability


def cuda_after_fork() -> Optional[str]:
    """None if a process forked from this one can initialise CUDA (or there is no GPU to initialise), else why
    not: a child is forked and tries, as a worker would."""
    import torch

    if not torch.cuda.is_available():  # NVML's answer here (PYTORCH_NVML_BASED_CUDA_CHECK)
        return None
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: initialise CUDA and make its context, say what failed, and leave at once
        os.close(r)
        problem = b""
        try:
            torch.cuda.init()
            torch.cuda.mem_get_info()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            problem = f"{type(e).__name__}: {e}".encode()[:300] or b"failed"
        os.write(w, problem)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        problem = f.read().decode(errors="replace")
    os.waitpid(pid, 0)
    return problem or None


def preload(modules: List[str]) -> Dict[str, Any]:
    """Import ``modules`` as described above; what was imported and whether workers may fork from here."""
    t0 = time.monotonic()
    imported: List[str] = []
    left: Dict[str, str] = {}
    try:
        import torch
    except ImportError as e:
        return {"fork": False, "imported": [], "left": {"torch": str(e)}, "seconds": 0.0}
    saved = {name: getattr(torch._C, name) for name in CUDA_ENTRY_POINTS if hasattr(torch._C, name)}
    capability = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = nvml_capability(capability)
    for name in saved:
        setattr(torch._C, name, _refuse)
    try:
        for m in modules:
            try:
                importlib.import_module(m)
                imported.append(m)
            except Exception as e:  # noqa: BLE001 - the worker imports it itself (and fails there, if it must)
                left[m] = f"{type(e).__name__}: {e}"[:300]
    finally:
        for name, f in saved.items():
            setattr(torch._C, name, f)
        torch.cuda.get_device_capability = capability
    torch_cuda = torch.cuda.is_initialized()
    probe = None if torch_cuda else cuda_after_fork()
    return {"fork": not torch_cuda and probe is None, "torch_cuda_initialized": torch_cuda, "probe": probe,
            "imported": imported, "left": left, "seconds": round(time.monotonic() - t0, 2)}


def read_status(path: str, timeout: float, alive: Callable[[], bool]) -> Optional[Dict[str, Any]]:
    """The forkserver's status once written; None if it is not within ``timeout`` s or the server died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            if not alive():
                return None
            time.sleep(0.05)
    return None


if os.environ.get(STATUS_ENV):  # in the forkserver (the launcher sets these for it alone)
    from slime_hydra.logging.metrics import write_json_atomic

    write_json_atomic(os.environ[STATUS_ENV], preload([m for m in os.environ.get(MODULES_ENV, "").split(",") if m]))
