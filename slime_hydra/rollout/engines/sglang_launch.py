"""``python -m slime_hydra.rollout.engines.sglang_launch ARGS`` (``rollout.sglang_fork_workers``, on by default):
SGLang's ``python -m sglang.launch_server ARGS``, whose worker processes (scheduler, detokenizer) are forked from a
process that imported most of their code while the server imported its own.

Why: SGLang's server imports its stack (about 20 s on the H200) before it parses its arguments; then it
spawns the scheduler, which imports the same stack again (about 20 s more) before it touches the GPU
(``bench/measured/h200_sglang_startup.md``). Here a multiprocessing forkserver starts first and imports
``WORKER_MODULES`` without initialising CUDA (``sglang_preload``) beside the server's own imports, and
``multiprocessing.Process`` (what SGLang starts its workers with) forks from it, so most of the second import
overlaps the first: a server was ready in 40.5 s instead of 50.2-51.0 s on one H200
(``bench/measured/h200_sglang_startup_forkserver.md``).

A worker forked so keeps what a spawned one had:
- the server's environment when the worker starts (SGLang sets NCCL and CUDA variables just before):
  ``WorkerProcess`` carries it over;
- torch_memory_saver's ``LD_PRELOAD`` (``--enable-memory-saver``), which must be there when a process begins:
  the forkserver begins with it;
- a worker's death stops the server: SGLang's own watchdog polls its workers (a forkserver that died reads
  as every worker dead);
- the server's death stops its workers, even when it is killed outright (its owner, the engine actor, killed by
  ``ray.kill``): the forkserver and each worker die with their parent (``die_with_parent``). Without that, a
  scheduler forked here outlived a run stopped during its start on the H200 and kept 70 GB of the GPU.
Where a process forked from the forkserver could not use CUDA (``sglang_preload`` tries one), the workers are
spawned as SGLang spawns them, and the server's log says so.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import runpy
import sys
import tempfile
from typing import Any, Dict, Iterator, List, Optional, Sequence

from slime_hydra.rollout.engines import sglang_preload
from slime_hydra.utils.proc import die_with_parent

log = logging.getLogger(__name__)

# what the forkserver imports for SGLang's workers: ServerArgs' module, which the workers' modules import first
# and which brings in most of the stack (torch, transformers, ...: about 18 of the 20 s on the H200). Not the
# workers' own modules (scheduler, detokenizer): they load sgl_kernel, which touches the CUDA driver as it
# imports, and a worker forked after that cannot use CUDA (sglang_preload checks, and spawns then)
WORKER_MODULES = ("sglang.srt.server_args",)
STATUS_TIMEOUT_S = 300.0  # the forkserver's imports take about 20 s on an H200

_status: Dict[str, Any] = {}  # the forkserver's answer (sglang_preload), read at the first worker's start
_status_path: List[str] = []  # where main() told the forkserver to write it
_forkserver_env: Dict[str, str] = {}  # the environment the forkserver starts in (start_forkserver)


def forkserver_status() -> Dict[str, Any]:
    if "fork" not in _status:
        got = sglang_preload.read_status(_status_path[0], STATUS_TIMEOUT_S, _forkserver_alive) if _status_path \
            else None
        _status.update(got or {"fork": False, "left": {"forkserver": "no answer"}})
        if _status["fork"]:
            log.info("sglang_launch: workers forked from the forkserver (it imported %s in %s s)",
                     ", ".join(_status["imported"]) or "nothing", _status["seconds"])
        else:
            log.warning("sglang_launch: workers spawned, not forked (the forkserver's preload: %s)", _status)
    return _status


def _forkserver_alive() -> bool:
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    try:
        return pid is not None and os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return False


class WorkerProcess(multiprocessing.context.ForkServerProcess):
    """A process forked from the forkserver (spawned where the forkserver says it may not fork) that runs in its
    parent's environment as it was at ``start``, as a spawned process would, not the forkserver's."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        if forkserver_status()["fork"]:
            return multiprocessing.context.ForkServerProcess._Popen(process_obj)
        return multiprocessing.context.SpawnProcess._Popen(process_obj)

    def start(self) -> None:
        self._environ = dict(os.environ)
        self._parent = os.getpid()  # where it spawns
        if forkserver_status()["fork"]:  # its parent is the forkserver: started again, as at first, if it died
            with environment(_forkserver_env):
                multiprocessing.forkserver.ensure_running()
            self._parent = multiprocessing.forkserver._forkserver._forkserver_pid
        super().start()

    def run(self) -> None:
        die_with_parent(self._parent)
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


@contextlib.contextmanager
def environment(extra: Dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def memory_saver_preload(argv: List[str]) -> Dict[str, str]:
    """With ``--enable-memory-saver``: torch_memory_saver's ``LD_PRELOAD`` (its hook mode ``preload``, as SGLang
    sets it for a spawned scheduler)."""
    if "--enable-memory-saver" not in argv:
        return {}
    from torch_memory_saver.hooks.mode_preload import configure_subprocess

    with configure_subprocess():
        return {"LD_PRELOAD": os.environ["LD_PRELOAD"]}


def start_forkserver(argv: List[str], worker_modules: Sequence[str], status_path: str) -> None:
    """multiprocessing's forkserver, started now: it imports ``worker_modules`` (``sglang_preload``) in the
    background and writes its answer to ``status_path``."""
    multiprocessing.set_forkserver_preload([sglang_preload.__name__])
    _forkserver_env.clear()
    _forkserver_env.update({**memory_saver_preload(argv), "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
                            sglang_preload.MODULES_ENV: ",".join(worker_modules),
                            sglang_preload.STATUS_ENV: status_path, sglang_preload.SERVER_ENV: str(os.getpid())})
    with environment(_forkserver_env):
        multiprocessing.forkserver.ensure_running()


def main(argv: List[str], server_module: str = "sglang.launch_server",
         worker_modules: Sequence[str] = WORKER_MODULES, status_path: Optional[str] = None) -> None:
    """Start the forkserver, then run ``python -m server_module argv`` here, its ``multiprocessing.Process``
    forking from that server."""
    if status_path is None:
        fd, status_path = tempfile.mkstemp(prefix="sglang_preload_", suffix=".json")
        os.close(fd)
        os.unlink(status_path)  # the forkserver writes it whole when its imports are done
    _status_path[:] = [status_path]
    start_forkserver(argv, worker_modules, status_path)
    multiprocessing.Process = WorkerProcess  # SGLang starts its workers with multiprocessing.Process(...)
    sys.argv = [server_module, *argv]
    try:
        runpy.run_module(server_module, run_name="__main__", alter_sys=True)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(status_path)


if __name__ == "__main__":
    # by its module name, so that the forkserver's children can unpickle WorkerProcess
    from slime_hydra.rollout.engines.sglang_launch import main as _main

    _main(sys.argv[1:])
