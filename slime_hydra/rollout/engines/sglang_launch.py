"""``python -m slime_hydra.rollout.engines.sglang_launch ARGS``: SGLang's ``python -m sglang.launch_server
ARGS``, whose worker processes (scheduler, detokenizer) are forked from a process that imported their
code while the server imported its own.

Why: SGLang's server imports its stack (about 20 s on the H200) before it parses its arguments; then it
spawns the scheduler, which imports the same stack again (about 20 s more) before it touches the GPU
(``bench/measured/h200_sglang_startup.md``). Here a multiprocessing forkserver starts first and imports the
workers' modules (``WORKER_MODULES``) beside the server's own imports, and ``multiprocessing.Process`` (what
SGLang starts its workers with) forks from it, so the second import overlaps the first.

A worker forked so keeps what a spawned one had:
- the server's environment when the worker starts (SGLang sets NCCL and CUDA variables just before):
  ``WorkerProcess`` carries it over;
- torch_memory_saver's ``LD_PRELOAD`` (``--enable-memory-saver``), which must be there when a process begins:
  the forkserver begins with it;
- a worker's death stops the server: SGLang's own watchdog polls its workers (a forkserver that died reads
  as every worker dead).
The forkserver imports torch and SGLang but does not touch CUDA, so the workers may.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import runpy
import sys
from typing import Iterator, List, Sequence

# what SGLang's workers run (sglang 0.5.17: run_scheduler_process, run_detokenizer_process and, with
# --dp-size, run_data_parallel_controller_process); importing the scheduler's imports most of the stack
WORKER_MODULES = ("sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager",
                  "sglang.srt.managers.data_parallel_controller")


class WorkerProcess(multiprocessing.context.ForkServerProcess):
    """A process forked from the forkserver that runs in its parent's environment as it was at ``start``
    (as a spawned process would), not the forkserver's."""

    def start(self) -> None:
        self._environ = dict(os.environ)
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


@contextlib.contextmanager
def memory_saver_preload(argv: List[str]) -> Iterator[None]:
    """With ``--enable-memory-saver``, torch_memory_saver's ``LD_PRELOAD`` (its hook mode ``preload``, as SGLang
    sets it for a spawned scheduler), for a process started within."""
    if "--enable-memory-saver" not in argv:
        yield
        return
    from torch_memory_saver import configure_subprocess

    with configure_subprocess():
        yield


def main(argv: List[str], server_module: str = "sglang.launch_server",
         worker_modules: Sequence[str] = WORKER_MODULES) -> None:
    """Start multiprocessing's forkserver, which imports ``worker_modules`` in the background, then run
    ``python -m server_module argv`` here, its ``multiprocessing.Process`` forking from that server."""
    multiprocessing.set_forkserver_preload(list(worker_modules))
    with memory_saver_preload(argv):
        multiprocessing.forkserver.ensure_running()
    multiprocessing.Process = WorkerProcess  # SGLang starts its workers with multiprocessing.Process(...)
    sys.argv = [server_module, *argv]
    runpy.run_module(server_module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    # by its module name, so that the forkserver's children can unpickle WorkerProcess
    from slime_hydra.rollout.engines.sglang_launch import main as _main

    _main(sys.argv[1:])
