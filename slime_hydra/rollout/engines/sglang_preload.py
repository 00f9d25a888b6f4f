"""Imported by ``sglang_launch``'s forkserver, and only there: the modules SGLang's workers import first,
imported without CUDA, then a word to the launcher on whether its workers may be forked from here.

A process forked after CUDA was initialised cannot use CUDA. So, while the modules import, what they ask of the
GPU is answered without initialising it, as a spawned worker would be answered at the same point of its imports:
- the GPU's compute capability and name are read from NVML (the same answers);
- the current device is 0 (a worker imports before it picks its device);
- torch's accelerator is CUDA when NVML sees a GPU (``torch.get_device_module()`` asks it, and asking the CUDA
  runtime initialises the driver: ``bench/cuda_at_import.py`` found SGLang's ``parallel_state`` doing so);
- ``torch.cuda.is_available()`` and ``device_count()`` use NVML too (``PYTORCH_NVML_BASED_CUDA_CHECK``, set
  by the launcher for this process only).
Each stand-in asks torch itself once CUDA is initialised (a module may keep a reference to it: in the worker it
answers as torch would). Anything else that would initialise CUDA through torch raises ``CudaAtImport``: that
module, and those that were importing it, are left for the worker to import. A module that catches the refusal
and imports anyway would keep a CPU-only answer that a worker forked from here inherits; so then the workers are
spawned. A library may also touch the CUDA driver without torch (sgl_kernel loads its kernels as it imports: a
worker forked after that failed with "CUDA error: initialization error" on the H200). So at the end a child is
forked and initialises CUDA, as a worker would; only if it can are the workers forked from here, else they are
spawned, as SGLang starts them. So sgl_kernel is never imported here (``LEFT_TO_WORKERS``): its import is
refused, and only the importer named there may carry on without it. ``STATUS_ENV`` names the file that says which
(JSON, written whole).
"""

from __future__ import annotations

import importlib
import importlib.abc
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional

MODULES_ENV = "SLIME_HYDRA_SGLANG_PRELOAD"  # comma-separated modules to import
STATUS_ENV = "SLIME_HYDRA_SGLANG_PRELOAD_STATUS"  # where to write what happened
SERVER_ENV = "SLIME_HYDRA_SGLANG_SERVER_PID"  # the server that started the forkserver: it dies with it
# torch's entry points that initialise CUDA (refused while the modules import)
CUDA_ENTRY_POINTS = ("_cuda_init", "_cuda_getDeviceCount")
# Packages refused here whatever they ask of torch, each with the one importer that may catch the refusal and import
# on (what that importer keeps is then what a worker computes), and why
LEFT_TO_WORKERS = {
    "sgl_kernel": ("sglang.srt.utils.common",
                   "sgl_kernel loads its CUDA kernels as it imports, which touches the driver without torch; "
                   "sglang.srt.utils.common imports it in a try only to set is_intel_amx_backend_available, "
                   "which is False without it and False with sgl_kernel's CUDA build"),
}


class CudaAtImport(ImportError):
    """A module asked torch to initialise CUDA while it was imported in the forkserver."""


class Refusals:
    """The refusals raised while the modules import, to tell those that stopped an import from those caught."""

    def __init__(self) -> None:
        self.raised: List[CudaAtImport] = []
        self.where: List[str] = []
        self.tolerated: List[bool] = []  # may be caught (``LEFT_TO_WORKERS``' importer)

    def refuse(self, *_args: Any, **_kwargs: Any) -> Any:
        caller = sys._getframe(1)
        self._raise(f"{caller.f_code.co_filename}:{caller.f_lineno}", "CUDA would be initialised in the forkserver")

    def _raise(self, where: str, why: str, tolerated: bool = False) -> Any:
        self.where.append(where)
        self.tolerated.append(tolerated)
        self.raised.append(CudaAtImport(why))
        raise self.raised[-1]

    def caught(self, stopped: set, tolerated: bool = False) -> List[str]:
        """Where the refusals were raised that a module caught and imported past: those not tolerated, or (with
        ``tolerated``) those ``LEFT_TO_WORKERS`` allows."""
        return [w for i, w in enumerate(self.where) if i not in stopped and self.tolerated[i] == tolerated]

    def stopped(self, error: BaseException) -> Optional[int]:
        """The index of the refusal that ``error`` (an import's failure) came from, if any."""
        seen = set()
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            for i, r in enumerate(self.raised):
                if r is error:
                    return i
            error = error.__cause__ or error.__context__
        return None


class LeaveToWorkers(importlib.abc.MetaPathFinder):
    """Refuses the packages of ``LEFT_TO_WORKERS`` (and their modules) before any of their code runs."""

    def __init__(self, refusals: Refusals):
        self.refusals = refusals

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        package = name.partition(".")[0]
        if package not in LEFT_TO_WORKERS:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith("<frozen"):  # importlib's own frames
            frame = frame.f_back
        importer = frame.f_globals.get("__name__", "?") if frame is not None else "?"
        # tolerated only from the importer's own top level: the import statement LEFT_TO_WORKERS vouches for, not
        # a function of that module that another one calls
        at_top = frame is not None and frame.f_code.co_name == "<module>"
        self.refusals._raise(f"{package}, imported by {importer}", f"{package} is left to the workers",
                             tolerated=at_top and importer == LEFT_TO_WORKERS[package][0])


def _cuda_initialized() -> bool:
    import torch

    return torch.cuda.is_initialized()


def nvml_handle(device: Any) -> Any:
    """NVML's handle of torch's ``device`` (None, an int, "cuda:N" or a torch.device), as CUDA_VISIBLE_DEVICES
    maps it."""
    import pynvml
    import torch

    pynvml.nvmlInit()
    index = device.index if isinstance(device, torch.device) else device
    index = int(str(index).rsplit(":", 1)[-1]) if index not in (None, "cuda") else 0
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    entry = visible[index].strip() if visible else str(index)
    return (pynvml.nvmlDeviceGetHandleByIndex(int(entry)) if entry.isdigit()
            else pynvml.nvmlDeviceGetHandleByUUID(entry))


def nvml_capability(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.cuda.get_device_capability`` answered by NVML until CUDA is initialised, then by ``original``."""

    def get_device_capability(device: Any = None) -> Any:
        if _cuda_initialized():
            return original(device)
        import pynvml

        return tuple(pynvml.nvmlDeviceGetCudaComputeCapability(nvml_handle(device)))

    return get_device_capability


def nvml_name(original: Callable[..., str]) -> Callable[..., str]:
    """``torch.cuda.get_device_name``: NVML's name of the device until CUDA is initialised, then ``original``'s."""

    def get_device_name(device: Any = None) -> str:
        if _cuda_initialized():
            return original(device)
        import pynvml

        name = pynvml.nvmlDeviceGetName(nvml_handle(device))
        return name.decode() if isinstance(name, bytes) else name

    return get_device_name


def first_device(original: Callable[[], int]) -> Callable[[], int]:
    """``torch.cuda.current_device``: 0 until CUDA is initialised (no device picked yet), then ``original``."""

    def current_device() -> int:
        return original() if _cuda_initialized() else 0

    return current_device


def cuda_accelerator(original: Callable[[], Any]) -> Callable[[], Any]:
    """``torch._C._get_accelerator``: CUDA where NVML sees a GPU until CUDA is initialised, then ``original``."""

    def get_accelerator() -> Any:
        import torch

        if not _cuda_initialized() and torch.cuda.is_available():  # NVML's answer (PYTORCH_NVML_BASED_CUDA_CHECK)
            return torch.device("cuda")
        return original()

    return get_accelerator


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
    refusals = Refusals()
    # (owner, name, what takes its place while the modules import)
    swaps = [(torch._C, name, refusals.refuse) for name in CUDA_ENTRY_POINTS if hasattr(torch._C, name)]
    swaps += [(torch.cuda, "get_device_capability", nvml_capability(torch.cuda.get_device_capability)),
              (torch.cuda, "get_device_name", nvml_name(torch.cuda.get_device_name)),
              (torch.cuda, "current_device", first_device(torch.cuda.current_device))]
    if hasattr(torch._C, "_get_accelerator"):
        swaps.append((torch._C, "_get_accelerator", cuda_accelerator(torch._C._get_accelerator)))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    for owner, name, stand_in in swaps:
        setattr(owner, name, stand_in)
    stopped = set()
    finder = LeaveToWorkers(refusals)
    sys.meta_path.insert(0, finder)
    try:
        for m in modules:
            try:
                importlib.import_module(m)
                imported.append(m)
            except Exception as e:  # noqa: BLE001 - the worker imports it itself (and fails there, if it must)
                left[m] = f"{type(e).__name__}: {e}"[:300]
                stopped.add(refusals.stopped(e))
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        if finder in sys.meta_path:  # a module may have replaced the list
            sys.meta_path.remove(finder)
    caught = refusals.caught(stopped)
    torch_cuda = torch.cuda.is_initialized()
    probe = None if torch_cuda or caught else cuda_after_fork()
    return {"fork": not torch_cuda and not caught and probe is None, "torch_cuda_initialized": torch_cuda,
            "refusals_caught": caught, "tolerated": refusals.caught(stopped, tolerated=True),
            "probe": probe, "imported": imported, "left": left,
            "seconds": round(time.monotonic() - t0, 2)}


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
    from slime_hydra.utils.proc import die_with_parent

    # the server killed outright takes the forkserver with it, and so the workers forked here
    die_with_parent(int(os.environ[SERVER_ENV]) if os.environ.get(SERVER_ENV) else None)

    write_json_atomic(os.environ[STATUS_ENV], preload([m for m in os.environ.get(MODULES_ENV, "").split(",") if m]))
