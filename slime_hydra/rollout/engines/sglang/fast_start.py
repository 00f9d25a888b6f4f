"""SGLang's fast start (``rollout.sglang_fast_start``, on by default; docs/startup.md says why):

- ``python -m ...fast_start ARGS`` (``serve``): SGLang's ``launch_server ARGS``, its workers forked from a
  forkserver that imported most of their code (``preload``) instead of each worker importing it again;
- ``python -m ...fast_start prebuild --model-path M ...``: SGLang's JIT CUDA kernels for the model, built side by
  side beside the server's first start;
- ``ServerArgsCheck``: sglang's parser checks ``rollout.server_args`` in a child process, its answer cached.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import json
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import runpy
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from slime_hydra.utils.proc import die_with_parent

log = logging.getLogger(__name__)
MODULE = "slime_hydra.rollout.engines.sglang.fast_start"  # this module by name (__main__ when run with -m)


def cache_dir() -> str:
    """``$SLIME_HYDRA_CACHE``, else ``$XDG_CACHE_HOME/slime_hydra``, else ``~/.cache/slime_hydra``."""
    return os.environ.get("SLIME_HYDRA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "slime_hydra")


def _answer_path(sglang_dirs: List[str], server_args: Dict[str, Any]) -> Optional[str]:
    """The parser's cached answer for these arguments, sglang and ``args.py``; None without sglang's file."""
    import hashlib

    found = (f for d in sglang_dirs if os.path.isfile(f := os.path.join(d, "sglang", "srt", "server_args.py")))
    source = next(found, None)
    if source is None:
        return None
    rules = os.path.join(os.path.dirname(os.path.abspath(__file__)), "args.py")  # MANAGED_SERVER_ARGS, the messages
    files = [(os.path.realpath(f), st.st_size, st.st_mtime_ns) for f in (source, rules) for st in [os.stat(f)]]
    key = json.dumps([files, server_args], sort_keys=True, default=str)
    return os.path.join(cache_dir(), "sglang_server_args", hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _read_answer(path: Optional[str]) -> Optional[List[Tuple[str, str]]]:
    try:
        with open(path) as f:
            return [tuple(pair) for pair in json.load(f)]
    except (TypeError, OSError, ValueError):  # no path, no file, an older layout: ask the parser
        return None


def _write_answer(path: Optional[str], answer: List[Tuple[str, str]]) -> None:
    if path is None:
        return
    with contextlib.suppress(OSError):  # a read-only home: the next run asks the parser again
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(answer, f)
        os.replace(tmp, path)


class ServerArgsCheck:
    """``args.check_server_args`` in a child process (``python -m ...sglang.args``), started at once and answered
    by ``result``: importing sglang's ServerArgs is slow, and in the driver it would set variables that the Ray
    workers inherit. Answers are cached in ``cache_dir()`` by sglang's ``server_args.py`` (path, size, mtime),
    ``args.py`` and the arguments, so a run with the same ``rollout.server_args`` starts no child."""

    def __init__(self, server_args: Dict[str, Any]):
        import importlib.util
        import subprocess

        spec = importlib.util.find_spec("sglang")
        if spec is None:
            raise ImportError("sglang is not installed")
        # the child sees the sglang this process sees, and this slime_hydra
        paths = [os.path.dirname(p) for p in (spec.submodule_search_locations or [])]
        self.proc: Optional["subprocess.Popen"] = None
        self.cache_path = _answer_path(paths, server_args)
        self.cached = _read_answer(self.cache_path)
        if self.cached is not None:
            return
        import slime_hydra

        paths.append(os.path.dirname(os.path.dirname(os.path.abspath(slime_hydra.__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])}
        # its output to files, not pipes: nobody reads them before ``result``, and a full pipe would stop it
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "slime_hydra.rollout.engines.sglang.args"],
                                     stdin=subprocess.PIPE, stdout=self.out, stderr=self.err, text=True, env=env)
        self.proc.stdin.write(json.dumps(server_args, default=str))
        self.proc.stdin.close()

    def result(self, timeout: float = 600.0) -> List[Tuple[str, str]]:
        """[(key, problem)]; raises ImportError when sglang's parser did not run."""
        if self.cached is not None:
            return self.cached
        try:
            self.proc.wait(timeout=timeout)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise
        self.out.seek(0)
        self.err.seek(0)
        out, err = self.out.read(), self.err.read()
        if self.proc.returncode != 0:
            tail = err.strip().splitlines()[-1:] or [f"exit status {self.proc.returncode}"]
            raise ImportError(f"sglang's parser failed in a child process: {tail[0]}")
        self.cached = [tuple(pair) for pair in json.loads(out.strip().splitlines()[-1])]
        _write_answer(self.cache_path, self.cached)
        return self.cached

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def problems(self) -> List[str]:
        """``result`` as validation's problems; [] with a warning when sglang's parser did not run."""
        try:
            return [f"rollout.server_args.{key}: {problem}" for key, problem in self.result()]
        except ImportError as e:
            log.warning("rollout.server_args not checked: sglang's ServerArgs did not import (%s)", e)
            return []


# what the forkserver imports for SGLang's workers: ServerArgs' module brings in most of the stack. Not the
# workers' own modules: they load sgl_kernel, which touches the CUDA driver, and a worker forked after that cannot
# use CUDA (``preload`` checks, and the workers are spawned then)
WORKER_MODULES = ("sglang.srt.server_args",)
STATUS_TIMEOUT_S = 300.0  # how long a worker's start waits for the forkserver's imports

_status: Dict[str, Any] = {}  # the forkserver's answer (``preload``), read at the first worker's start
_status_path: List[str] = []  # where serve() told the forkserver to write it
_forkserver_env: Dict[str, str] = {}  # the environment the forkserver starts in (start_forkserver)


def forkserver_status() -> Dict[str, Any]:
    if "fork" not in _status:
        got = read_status(_status_path[0], STATUS_TIMEOUT_S, _forkserver_alive) if _status_path else None
        _status.update(got or {"fork": False, "left": {"forkserver": "no answer"}})
        if _status["fork"]:
            log.info("fast start: SGLang's workers forked from the forkserver (it imported %s in %s s)",
                     ", ".join(_status["imported"]) or "nothing", _status["seconds"])
        else:
            log.warning("fast start: SGLang's workers spawned, not forked (the forkserver's preload: %s)", _status)
    return _status


def _forkserver_alive() -> bool:
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    try:
        return pid is not None and os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return False


class WorkerProcess(multiprocessing.context.ForkServerProcess):
    """Forked from the forkserver (spawned where it may not fork), in its parent's environment at ``start``."""

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
    """With ``--enable-memory-saver``: torch_memory_saver's ``LD_PRELOAD``, as SGLang sets it for its scheduler."""
    if "--enable-memory-saver" not in argv:
        return {}
    from torch_memory_saver.hooks.mode_preload import configure_subprocess

    with configure_subprocess():
        return {"LD_PRELOAD": os.environ["LD_PRELOAD"]}


def start_forkserver(argv: List[str], worker_modules: Sequence[str], status_path: str) -> None:
    """The forkserver, started now: it imports ``worker_modules`` and writes its answer to ``status_path``."""
    multiprocessing.set_forkserver_preload([MODULE])
    _forkserver_env.clear()
    _forkserver_env.update({**memory_saver_preload(argv), "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
                            MODULES_ENV: ",".join(worker_modules), STATUS_ENV: status_path,
                            SERVER_ENV: str(os.getpid())})
    with environment(_forkserver_env):
        multiprocessing.forkserver.ensure_running()


def serve(argv: List[str], server_module: str = "sglang.launch_server",
          worker_modules: Sequence[str] = WORKER_MODULES, status_path: Optional[str] = None) -> None:
    """Start the forkserver, then run ``python -m server_module argv`` here, its ``multiprocessing.Process``
    forking from the forkserver. A forked worker keeps what a spawned one had: the server's environment
    (``WorkerProcess``), torch_memory_saver's ``LD_PRELOAD``, and the server's death, even by SIGKILL, takes the
    forkserver and the workers with it (``die_with_parent``)."""
    if status_path is None:
        fd, status_path = tempfile.mkstemp(prefix="sglang_fast_start_", suffix=".json")
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


# The forkserver (``STATUS_ENV`` set) imports the workers' first modules without initialising CUDA (a process
# forked after that cannot use it): capability and name come from NVML, device 0, ``is_available`` through NVML.
# Anything else that would initialise CUDA raises ``CudaAtImport`` and that module is left to the workers; a module
# that catches the refusal and imports anyway makes the workers spawn; ``LEFT_TO_WORKERS`` are refused outright.
# Last, a forked child initialises CUDA (``cuda_after_fork``): only if it can are the workers forked.

MODULES_ENV = "SLIME_HYDRA_SGLANG_PRELOAD"  # comma-separated modules to import
STATUS_ENV = "SLIME_HYDRA_SGLANG_PRELOAD_STATUS"  # where to write what happened
SERVER_ENV = "SLIME_HYDRA_SGLANG_SERVER_PID"  # the server that started the forkserver: it dies with it
CUDA_ENTRY_POINTS = ("_cuda_init", "_cuda_getDeviceCount")
# packages refused whatever they ask of torch -> (the one importer that may catch the refusal and import on, why)
LEFT_TO_WORKERS = {
    "sgl_kernel": ("sglang.srt.utils.common",
                   "sgl_kernel loads its CUDA kernels as it imports, which touches the driver without torch; "
                   "sglang.srt.utils.common imports it in a try only to set is_intel_amx_backend_available, "
                   "which is False without it and False with sgl_kernel's CUDA build"),
}


class CudaAtImport(ImportError):
    """A module asked to initialise CUDA while the forkserver imported it."""


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
        """Where the refusals a module caught and imported past were raised (not tolerated, or tolerated ones)."""
        return [w for i, w in enumerate(self.where) if i not in stopped and self.tolerated[i] == tolerated]

    def stopped(self, error: BaseException) -> Optional[int]:
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
        # tolerated only from the importer's own top level, the import statement LEFT_TO_WORKERS vouches for
        at_top = frame is not None and frame.f_code.co_name == "<module>"
        self.refusals._raise(f"{package}, imported by {importer}", f"{package} is left to the workers",
                             tolerated=at_top and importer == LEFT_TO_WORKERS[package][0])


def nvml_handle(device: Any) -> Any:
    """NVML's handle of torch's ``device`` (None, an int, "cuda:N" or a torch.device) under CUDA_VISIBLE_DEVICES."""
    import pynvml
    import torch

    pynvml.nvmlInit()
    index = device.index if isinstance(device, torch.device) else device
    index = int(str(index).rsplit(":", 1)[-1]) if index not in (None, "cuda") else 0
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    entry = visible[index].strip() if visible else str(index)
    return (pynvml.nvmlDeviceGetHandleByIndex(int(entry)) if entry.isdigit()
            else pynvml.nvmlDeviceGetHandleByUUID(entry))


def until_cuda(original: Callable[..., Any], stand_in: Callable[..., Any]) -> Callable[..., Any]:
    """``stand_in`` until CUDA is initialised, then ``original`` (for a module that keeps a reference)."""

    import torch

    def call(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs) if torch.cuda.is_initialized() else stand_in(*args, **kwargs)

    return call


def nvml_capability(device: Any = None) -> Tuple[int, int]:
    import pynvml

    return tuple(pynvml.nvmlDeviceGetCudaComputeCapability(nvml_handle(device)))


def nvml_name(device: Any = None) -> str:
    import pynvml

    name = pynvml.nvmlDeviceGetName(nvml_handle(device))
    return name.decode() if isinstance(name, bytes) else name


def cuda_after_fork() -> Optional[str]:
    """None if a child forked from here can initialise CUDA (or there is no GPU), else why not."""
    import torch

    if not torch.cuda.is_available():  # NVML's answer here (PYTORCH_NVML_BASED_CUDA_CHECK)
        return None
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: initialise CUDA, say what failed, and leave at once
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
    swaps += [(torch.cuda, "get_device_capability", until_cuda(torch.cuda.get_device_capability, nvml_capability)),
              (torch.cuda, "get_device_name", until_cuda(torch.cuda.get_device_name, nvml_name)),
              (torch.cuda, "current_device", until_cuda(torch.cuda.current_device, lambda: 0))]  # none picked yet
    if hasattr(torch._C, "_get_accelerator"):  # CUDA where NVML sees a GPU (PYTORCH_NVML_BASED_CUDA_CHECK)
        accelerator = torch._C._get_accelerator
        swaps.append((torch._C, "_get_accelerator", until_cuda(
            accelerator, lambda: torch.device("cuda") if torch.cuda.is_available() else accelerator())))
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


# sglang 0.5.17 compiles some kernels with nvcc on first use, one after another in its CUDA-graph capture.
# ``prebuild`` builds them all at once, a thread each, into the same caches (the server loads a built one, or waits
# on its build's lock); a kernel missed here the server builds itself. No GPU is touched (NVML, no visible devices).

# model types whose sglang 0.5.17 implementation normalises queries and keys per head (apply_qk_norm)
QK_NORM_MODELS = frozenset({"qwen3", "qwen3_moe", "qwen3_next", "olmo2", "glm4_moe", "llama4", "bailing_moe"})
# model types whose sglang 0.5.17 implementation rotates interleaved pairs (is_neox_style=False), not halves
INTERLEAVED_ROPE_MODELS = frozenset({"glm4", "chatglm"})
DTYPE_BYTES = {"bfloat16": 2, "float16": 2}  # float32 servers run the transformers implementation (engine.py)
TORCH_DTYPES = ("bfloat16", "float16", "int64")  # the kernels' arguments that name a torch dtype


@dataclass(frozen=True)
class Kernel:
    """One build: ``module.function(*args)`` (sglang's own memoised loader; dtypes by name)."""

    name: str
    module: str
    function: str
    args: Tuple[Any, ...] = ()


def kernels_for(config: Dict[str, Any], dtype: str, tp: int) -> List[Kernel]:
    """The kernels sglang 0.5.17 compiles on first use of a model with this ``config.json`` (a dict) served in
    ``dtype`` over ``tp`` GPUs: norm, activation and position for every model; attention ones from the heads (none
    for multi-head latent attention, ``kv_lora_rank``); the query-key norm where the model type has it."""
    config = {**(config.get("text_config") or {}), **config}  # a multimodal config keeps the language model's inside
    if dtype == "auto":  # the checkpoint's, and SGLang serves a float32 one in float16
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("float32", "float16")
    if dtype not in DTYPE_BYTES:
        return []
    out = [Kernel("flashinfer norm", "flashinfer.norm", "get_norm_module"),  # the longest build: first
           Kernel("activation", "sglang.kernels.ops.activation.activation", "activation_module", (dtype,)),
           Kernel("clamp_position", "sglang.kernels.ops.attention.clamp_position", "_jit_clamp_position_module",
                  ("int64",))]
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config.get("hidden_size") or 0) // (heads or 1)
    if not heads or not head_dim or config.get("kv_lora_rank"):
        return out
    head_dim = int(head_dim)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    row_bytes = max(1, kv_heads // max(1, tp)) * head_dim * DTYPE_BYTES[dtype]  # a KV head is replicated past TP=kv
    # the rotary share: top level in older configs, in rope_parameters (transformers 5) or rope_scaling
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    rotary = int(head_dim * float(config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0))
    out += [Kernel("kvcache", "sglang.kernels.ops.kvcache.kvcache", "_jit_kvcache_module", (row_bytes, row_bytes)),
            Kernel("fused_rope", "sglang.kernels.ops.attention.rope", "_jit_fused_rope_module",
                   (config.get("model_type") not in INTERLEAVED_ROPE_MODELS, rotary, dtype, dtype))]
    if config.get("model_type") in QK_NORM_MODELS or config.get("use_qk_norm"):
        out.append(Kernel("qknorm", "sglang.kernels.ops.layernorm.norm", "_jit_qknorm_module", (head_dim, dtype)))
    return out


def load_module(kernel: Kernel) -> Optional[str]:
    """Import the kernel's module (in one thread: concurrent imports can deadlock); None, or why it failed."""
    try:
        importlib.import_module(kernel.module)
        if kernel.module.startswith("sglang."):
            pin_sglang_target()
        return None
    except Exception as e:  # noqa: BLE001 - the server builds it itself when it needs it
        return f"{type(e).__name__}: {e}"[:300]


def build(kernel: Kernel, since: float = 0.0) -> Dict[str, Any]:
    """Build one kernel (load it, as sglang's loader does); what happened, and when (seconds after ``since``)."""
    import torch

    t0 = time.monotonic()
    try:
        fn = getattr(importlib.import_module(kernel.module), kernel.function)
        fn(*(getattr(torch, a) if a in TORCH_DTYPES else a for a in kernel.args))
        status = "ok"
    except Exception as e:  # noqa: BLE001 - the server builds it itself when it needs it
        status = f"{type(e).__name__}: {e}"[:300]
    t1 = time.monotonic()
    print(f"kernel {kernel.name}{kernel.args}: {status} in {t1 - t0:.2f} s", flush=True)
    return {"kernel": kernel.name, "args": list(kernel.args), "status": status, "seconds": round(t1 - t0, 2),
            "started_s": round(t0 - since, 2), "ended_s": round(t1 - since, 2)}


def capabilities() -> List[Tuple[int, int]]:
    """The compute capability of each GPU CUDA would see here, from NVML."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return []
    import pynvml

    pynvml.nvmlInit()
    try:
        count = len([e for e in visible.split(",") if e.strip()]) if visible is not None else \
            pynvml.nvmlDeviceGetCount()
        return [tuple(pynvml.nvmlDeviceGetCudaComputeCapability(nvml_handle(i))) for i in range(count)]
    finally:
        pynvml.nvmlShutdown()


def answer_without_gpus(caps: Sequence[Tuple[int, int]]) -> None:
    """Compile for ``caps`` with no GPU visible (FlashInfer's arch list; torch's answers to sglang)."""
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = " ".join(sorted({f"{major}.{minor}" for major, minor in caps}))
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda device=None: tuple(caps[0])


def pin_sglang_target() -> None:
    """``TVM_FFI_CUDA_ARCH_LIST`` set for the whole process: sglang's loader sets and removes it around each build,
    and a build started after another removed it would compile for the wrong target."""
    from sglang.kernels.jit.utils import get_jit_cuda_arch

    os.environ.setdefault("TVM_FFI_CUDA_ARCH_LIST", get_jit_cuda_arch().target_name)


def prebuild(model_path: str, dtype: str, tp: int, trust_remote_code: bool = False) -> Dict[str, Any]:
    """Build ``kernels_for`` the model at ``model_path`` (a folder or a Hugging Face id) side by side."""
    t0 = time.monotonic()
    caps = capabilities()
    if not caps:
        return {"kernels": [], "seconds": 0.0, "skipped": "no GPU visible"}
    kernels = kernels_for(model_config(model_path, trust_remote_code), dtype, tp)
    held = claim(kernels, caps)  # open until this returns
    if held is None:
        return {"kernels": [], "seconds": round(time.monotonic() - t0, 2),
                "skipped": "another prebuild on this machine builds the same kernels"}
    answer_without_gpus(caps)
    print(f"building {', '.join(k.name for k in kernels) or 'no kernels'} for compute capability "
          f"{caps[0][0]}.{caps[0][1]}", flush=True)
    failed, started = [], []
    with ThreadPoolExecutor(max_workers=max(1, len(kernels))) as pool:
        for k in kernels:  # each build starts once its module has imported, the longest (FlashInfer's norm) first
            problem = load_module(k)
            if problem:
                print(f"kernel {k.name}{k.args}: {problem}", flush=True)
                failed.append({"kernel": k.name, "args": list(k.args), "status": problem, "seconds": 0.0})
            else:
                started.append(pool.submit(build, k, t0))
        results = [f.result() for f in started] + failed
    return {"capability": list(caps[0]), "kernels": results, "seconds": round(time.monotonic() - t0, 2)}


def claim(kernels: Sequence[Kernel], caps: Sequence[Tuple[int, int]]) -> Optional[IO[str]]:
    """A lock (in ``cache_dir()``) on building these kernels for these GPUs here, so a node runs one prebuild; the
    open file holds it, None when another process does."""
    import fcntl
    import hashlib

    key = hashlib.sha256(repr((list(kernels), list(caps))).encode()).hexdigest()[:16]
    os.makedirs(cache_dir(), exist_ok=True)
    f = open(os.path.join(cache_dir(), f"sglang_prebuild_{key}.lock"), "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def model_config(model_path: str, trust_remote_code: bool = False) -> Dict[str, Any]:
    """The model's ``config.json`` as a dict, from a folder, else through transformers (a Hugging Face id)."""
    path = os.path.join(model_path, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).to_dict()


def prebuild_main(argv: List[str]) -> int:
    import argparse

    from slime_hydra.logging.metrics import write_json_atomic

    parser = argparse.ArgumentParser(prog="fast_start prebuild")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--report", required=True, help="where the JSON report goes")
    a = parser.parse_args(argv)
    try:
        report = prebuild(a.model_path, a.dtype, a.tp, a.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a model config or NVML that does not answer: the server builds
        report = {"kernels": [], "skipped": f"{type(e).__name__}: {e}"[:300]}
    print(f"no kernels built: {report['skipped']}" if report.get("skipped") else f"done in {report['seconds']:.2f} s",
          flush=True)
    write_json_atomic(a.report, report)
    return 0


if os.environ.get(STATUS_ENV):  # in the forkserver (the launcher sets these for it alone)
    from slime_hydra.logging.metrics import write_json_atomic

    # the server killed outright takes the forkserver with it, and so the workers forked here
    die_with_parent(int(os.environ[SERVER_ENV]) if os.environ.get(SERVER_ENV) else None)
    write_json_atomic(os.environ[STATUS_ENV], preload([m for m in os.environ.get(MODULES_ENV, "").split(",") if m]))

if __name__ == "__main__":
    # by its module name, so that the forkserver's children can unpickle WorkerProcess
    _module = importlib.import_module(MODULE)
    if sys.argv[1:2] == ["prebuild"]:
        sys.exit(_module.prebuild_main(sys.argv[2:]))
    _module.serve(sys.argv[1:])
