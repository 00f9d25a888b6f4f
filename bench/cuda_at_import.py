"""Which import initialises the CUDA driver in the fast start's forkserver.

A process forked after ``cuInit`` cannot use CUDA ("CUDA error: initialization error"), so the forkserver's
preload (``slime_hydra/rollout/engines/sglang/fast_start.py``) must import without it. This runs the same preload
in a fresh process and, after each module that finishes importing, asks the driver whether it was initialised
(``cuDeviceGetCount`` answers CUDA_ERROR_NOT_INITIALIZED until ``cuInit``; asking initialises nothing). It
prints the first module after which the driver was initialised, with the modules importing it, and the
preload's own answer (its forked probe included).

    BENCH_SGLANG=1 source bench/gpu/env.sh && python3 bench/cuda_at_import.py [--memory-saver]

``--memory-saver`` starts it again under torch_memory_saver's ``LD_PRELOAD``, as the launcher starts its
forkserver for ``--enable-memory-saver``.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.abc
import json
import os
import sys
import traceback
from typing import Any, Dict, Optional


def driver_state(lib: Optional[ctypes.CDLL]) -> Optional[int]:
    """cuDeviceGetCount's answer: 0 once the driver is initialised, 3 before; None without a driver."""
    if lib is None:
        return None
    n = ctypes.c_int(0)
    return int(lib.cuDeviceGetCount(ctypes.byref(n)))


class Watch(importlib.abc.MetaPathFinder):
    """Wraps every module's loader: after a module's code ran, note the first time the driver is initialised."""

    def __init__(self, lib: Optional[ctypes.CDLL], trace: str = ""):
        self.lib, self.stack, self.trace = lib, [], trace  # type: ignore[var-annotated]
        self.first: Optional[Dict[str, Any]] = None
        self.call: Optional[Dict[str, Any]] = None  # the call that initialised it, inside ``trace``

    def _profile(self, frame, event, arg):  # noqa: ANN001 - sys.setprofile's protocol
        if self.call is None and event in ("c_return", "return") and driver_state(self.lib) == 0:
            where = frame
            chain = []
            while where is not None and len(chain) < 12:
                chain.append(f"{where.f_code.co_filename}:{where.f_lineno} {where.f_code.co_name}")
                where = where.f_back
            self.call = {"event": event, "c_function": repr(arg) if event == "c_return" else None,
                         "stack": chain}
            sys.setprofile(None)

    def find_spec(self, name, path, target=None):  # noqa: ANN001 - importlib's protocol
        if self.first is not None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        watch = self

        class Loader(importlib.abc.Loader):
            def create_module(self, s):  # noqa: ANN001
                return loader.create_module(s)

            def exec_module(self, module):  # noqa: ANN001
                watch.stack.append(name)
                traced = name == watch.trace
                if traced:
                    sys.setprofile(watch._profile)
                try:
                    loader.exec_module(module)
                finally:
                    if traced:
                        sys.setprofile(None)
                    if watch.first is None and driver_state(watch.lib) == 0:
                        watch.first = {"module": name, "importing": list(watch.stack)}
                    watch.stack.pop()

        spec.loader = Loader()
        return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", default="sglang.srt.server_args")
    ap.add_argument("--trace", default="", help="a module: find the very call in its import that initialised it")
    ap.add_argument("--memory-saver", action="store_true", help="run under torch_memory_saver's LD_PRELOAD")
    args = ap.parse_args()
    if args.memory_saver and "torch_memory_saver" not in os.environ.get("LD_PRELOAD", ""):
        from torch_memory_saver.hooks.mode_preload import configure_subprocess

        with configure_subprocess():
            os.execv(sys.executable, [sys.executable, *sys.argv])
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # as the launcher sets it for its forkserver
    try:
        lib: Optional[ctypes.CDLL] = ctypes.CDLL("libcuda.so.1")
    except OSError:
        lib = None
    report: Dict[str, Any] = {"ld_preload": os.environ.get("LD_PRELOAD", ""), "at_start": driver_state(lib)}
    watch = Watch(lib, args.trace)
    sys.meta_path.insert(0, watch)
    import torch  # noqa: F401

    report["after_torch"] = driver_state(lib)
    from slime_hydra.rollout.engines.sglang import fast_start as sglang_preload

    stacks = []  # each refusal's stack: who asked, through which imports
    refuse = sglang_preload.Refusals._raise

    def noted(self, *a, **k):  # noqa: ANN001, ANN202
        stacks.append([line.strip() for line in traceback.format_stack(limit=16)[:-2]])
        return refuse(self, *a, **k)

    sglang_preload.Refusals._raise = noted
    status = sglang_preload.preload([m for m in args.modules.split(",") if m])
    sys.meta_path.remove(watch)
    report.update(after_preload=driver_state(lib), first_initialised_after=watch.first, call=watch.call, preload=status,
                  refusal_stacks=stacks)
    print(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
