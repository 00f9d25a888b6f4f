"""The SGLang launcher's process model (the forked workers of slime_hydra/rollout/engines/sglang/fast_start.py),
run with a server module of the same shape as sglang.launch_server (sglang itself does not install on the CPU machines):
it forces the spawn start method, changes its environment, then starts a worker with multiprocessing.Process."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import running

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = """
import os
import sys
import time

IMPORTED_IN = os.getpid()
time.sleep(1.0)  # a slow import, as SGLang's scheduler's (about 20 s on an H200)


def run(pipe):
    pipe.send({"pid": os.getpid(), "imported_in": IMPORTED_IN, "late": os.environ.get("SET_LATE"),
               "server_argv": os.environ.get("SERVER_ARGV")})
"""

SERVER = """
import json
import multiprocessing as mp
import os
import sys

if __name__ == "__main__":
    if os.environ.get("FORCE_SPAWN"):  # as if a child of the forkserver could not use CUDA (fast_start.preload)
        from slime_hydra.rollout.engines.sglang import fast_start

        fast_start._status.update(fork=False)
    mp.set_start_method("spawn", force=True)  # as sglang's _set_envs_and_config
    os.environ["SET_LATE"] = "set just before the worker starts"
    os.environ["SERVER_ARGV"] = " ".join(sys.argv[1:])
    from worker import run

    reader, writer = mp.Pipe(duplex=False)
    proc = mp.Process(target=run, args=(writer,))
    proc.start()
    got = reader.recv()
    proc.join()
    print(json.dumps({**got, "server_pid": os.getpid(), "exitcode": proc.exitcode,
                      "process_class": type(proc).__name__}))
"""


def launch(tmp_path, **env):
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    (tmp_path / "server.py").write_text(textwrap.dedent(SERVER))
    code = ("import sys; from slime_hydra.rollout.engines.sglang.fast_start import serve; "
            "serve(sys.argv[1:], server_module='server', worker_modules=('worker', 'no_such_module'))")
    env = {**os.environ, **env,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, "--port", "30000"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["exitcode"] == 0 and got["process_class"] == "WorkerProcess"
    return got, out.stderr


def test_workers_fork_from_a_preloaded_server_in_the_servers_environment(tmp_path):
    got, _ = launch(tmp_path)
    # the worker's module was imported in the forkserver, not in the worker (nor in the server); a module
    # that does not import there (no_such_module) does not stop the workers from forking
    assert got["imported_in"] not in (got["pid"], got["server_pid"])
    # what the server set in its environment just before the worker started reached the worker
    assert got["late"] == "set just before the worker starts"
    assert got["server_argv"] == "--port 30000"


def test_workers_are_spawned_where_the_forkserver_may_not_fork(tmp_path):
    got, _ = launch(tmp_path, FORCE_SPAWN="1")
    assert got["imported_in"] == got["pid"]  # imported again in the worker: spawned, as SGLang does it
    assert got["late"] == "set just before the worker starts" and got["server_argv"] == "--port 30000"


def test_preload_leaves_modules_that_initialise_cuda_to_the_worker(tmp_path, monkeypatch):
    """A module that would initialise CUDA as it imports is refused (the CPU build of torch has no
    ``_cuda_init``: a stand-in takes its place), the others import, and torch is as it was after."""
    import torch

    from slime_hydra.rollout.engines.sglang import fast_start

    (tmp_path / "wants_cuda.py").write_text("import torch\ntorch._C._cuda_init()\n")
    (tmp_path / "plain.py").write_text("import json\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_init", lambda: calls.append("init"), raising=False)
    init, capability = torch._C._cuda_init, torch.cuda.get_device_capability
    got = fast_start.preload(["wants_cuda", "plain"])
    assert got["imported"] == ["plain"] and "CudaAtImport" in got["left"]["wants_cuda"]
    assert got["fork"] and not got["torch_cuda_initialized"] and got["probe"] is None
    assert torch._C._cuda_init is init and torch.cuda.get_device_capability is capability and calls == []


@pytest.mark.integration
def test_the_probe_reports_a_child_that_cannot_initialise_cuda(monkeypatch):
    """The forked child initialises CUDA as a worker would: on this machine's CPU build of torch that fails
    (it has no CUDA), which is what a forkserver whose imports touched the CUDA driver looks like; the GPU
    check is made believe there is one."""
    import torch

    from slime_hydra.rollout.engines.sglang import fast_start

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    problem = fast_start.cuda_after_fork()
    assert problem and "CUDA" in problem
    got = fast_start.preload(["json"])
    assert not got["fork"] and got["probe"] == problem and got["imported"] == ["json"]


def test_a_module_that_catches_the_refusal_makes_the_workers_spawn(tmp_path, monkeypatch):
    """A module that catches the refusal and imports anyway keeps a CPU-only answer (SGLang's fla utils cache
    "cpu" so); a worker forked from there would inherit it, so the workers are spawned, and the status names
    where the refusal was caught."""
    import torch

    from slime_hydra.rollout.engines.sglang import fast_start

    (tmp_path / "falls_back.py").write_text(
        "import torch\ntry:\n    torch._C._cuda_init()\n    DEVICE = 'cuda'\nexcept Exception:\n    DEVICE = 'cpu'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch._C, "_cuda_init", lambda: None, raising=False)
    got = fast_start.preload(["falls_back"])
    assert got["imported"] == ["falls_back"] and not got["fork"] and got["probe"] is None
    assert len(got["refusals_caught"]) == 1 and "falls_back.py:3" in got["refusals_caught"][0]


def test_imports_are_answered_as_a_spawned_worker_is_before_cuda_starts(tmp_path, monkeypatch):
    """While the modules import: torch's accelerator is CUDA where NVML sees a GPU (asking the CUDA runtime
    would initialise the driver), the current device is 0 and the capability NVML's; a reference a module keeps
    asks torch itself once CUDA is initialised; and torch is as it was afterwards."""
    import sys
    import types

    import torch

    from slime_hydra.rollout.engines.sglang import fast_start

    (tmp_path / "asks.py").write_text(
        "import torch\nfrom torch.cuda import current_device\n"
        "ACCELERATOR = torch._C._get_accelerator().type\nDEVICE = current_device()\n"
        "CAPABILITY = torch.cuda.get_device_capability()\nNAME = torch.cuda.get_device_name(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as NVML answers on a GPU machine
    nvml = types.SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: i,
                                 nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0),
                                 nvmlDeviceGetName=lambda h: b"NVIDIA H200")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(fast_start, "cuda_after_fork", lambda: None)  # no GPU here to fork a probe for
    originals = (torch._C._get_accelerator, torch.cuda.current_device, torch.cuda.get_device_capability,
                 torch.cuda.get_device_name)
    got = fast_start.preload(["asks"])
    asks = sys.modules.pop("asks")
    assert got["fork"] and got["imported"] == ["asks"] and got["refusals_caught"] == []
    assert (asks.ACCELERATOR, asks.DEVICE, asks.CAPABILITY, asks.NAME) == ("cuda", 0, (9, 0), "NVIDIA H200")
    assert (torch._C._get_accelerator, torch.cuda.current_device, torch.cuda.get_device_capability,
            torch.cuda.get_device_name) == originals
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # in the worker, once CUDA is up
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 3, raising=False)
    assert asks.current_device() == 3


def test_a_package_left_to_the_workers_may_be_caught_by_its_one_importer(tmp_path, monkeypatch):
    """sgl_kernel is never imported in the forkserver: its import is refused before any of its code runs. The
    importer named in ``LEFT_TO_WORKERS`` may catch that and import on (the workers still fork); any other
    importer that catches it makes the workers spawn; one that does not catch it is left to the workers."""
    import sys

    from slime_hydra.rollout.engines.sglang import fast_start

    (tmp_path / "kernels.py").write_text("LOADED = True\n")
    guarded = "try:\n    import kernels\n    HAVE = True\nexcept ImportError:\n    HAVE = False\n"
    (tmp_path / "tolerant.py").write_text(guarded)
    (tmp_path / "other.py").write_text(guarded)
    (tmp_path / "needs.py").write_text("import kernels\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(fast_start, "LEFT_TO_WORKERS", {"kernels": ("tolerant", "a test's reason")})
    monkeypatch.setattr(fast_start, "cuda_after_fork", lambda: None)
    for name in ("kernels", "tolerant", "other", "needs"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    got = fast_start.preload(["tolerant", "needs"])
    assert got["fork"] and got["imported"] == ["tolerant"] and "left to the workers" in got["left"]["needs"]
    assert got["refusals_caught"] == [] and got["tolerated"] == ["kernels, imported by tolerant"]
    assert sys.modules["tolerant"].HAVE is False and "kernels" not in sys.modules
    got = fast_start.preload(["other"])
    assert not got["fork"] and got["refusals_caught"] == ["kernels, imported by other"]
    # the tolerated importer, but from a function of it that another module calls as it imports: not vouched for
    (tmp_path / "lazy.py").write_text("def load():\n" + "".join("    " + line + "\n" for line in guarded.splitlines())
                                      + "    return HAVE\n")
    (tmp_path / "caller.py").write_text("import lazy\nHAVE = lazy.load()\n")
    monkeypatch.setattr(fast_start, "LEFT_TO_WORKERS", {"kernels": ("lazy", "a test's reason")})
    got = fast_start.preload(["caller"])
    assert got["imported"] == ["caller"] and got["tolerated"] == [] and sys.modules["caller"].HAVE is False
    assert not got["fork"] and got["refusals_caught"] == ["kernels, imported by lazy"]
    assert fast_start.LeaveToWorkers not in map(type, sys.meta_path)  # removed after the imports
    for name in ("tolerant", "other", "needs", "lazy", "caller"):
        sys.modules.pop(name, None)


SLEEPER = """
import time


def run():
    time.sleep(600)
"""

LONG_SERVER = """
import json
import multiprocessing as mp
import multiprocessing.forkserver
import os
import time

if __name__ == "__main__":
    if os.environ.get("FORCE_SPAWN"):  # as if a child of the forkserver could not use CUDA (fast_start.preload)
        from slime_hydra.rollout.engines.sglang import fast_start

        fast_start._status.update(fork=False)
    mp.set_start_method("spawn", force=True)
    from sleeper import run

    proc = mp.Process(target=run)
    proc.start()
    print(json.dumps({"worker": proc.pid, "forkserver": mp.forkserver._forkserver._forkserver_pid}), flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("spawned", [False, True], ids=["forked", "spawned"])
def test_a_server_killed_outright_takes_its_forkserver_and_workers_with_it(tmp_path, spawned):
    # on the H200 a run stopped during SGLang's start killed the engine actor, and so the server (PDEATHSIG), but
    # the scheduler forked from the forkserver lived on with 70 GB of the GPU
    import select
    import signal
    import time

    (tmp_path / "sleeper.py").write_text(textwrap.dedent(SLEEPER))
    (tmp_path / "server.py").write_text(textwrap.dedent(LONG_SERVER))
    code = ("import sys; from slime_hydra.rollout.engines.sglang.fast_start import serve; "
            "serve(sys.argv[1:], server_module='server', worker_modules=('sleeper',))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]),
           **({"FORCE_SPAWN": "1"} if spawned else {})}
    server = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    pids = {}
    try:
        assert select.select([server.stdout], [], [], 120)[0], "the server printed no pids within 120 s"
        pids = json.loads(server.stdout.readline())
        assert running(pids["worker"]) and running(pids["forkserver"])
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        deadline = time.monotonic() + 10
        while any(map(running, pids.values())) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [name for name, pid in pids.items() if running(pid)]
    finally:
        server.kill()
        for pid in pids.values():
            if running(pid):
                os.kill(pid, signal.SIGKILL)
