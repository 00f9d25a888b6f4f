"""``python -m slime_hydra.rollout.engines.sglang_kernels --model-path M --dtype D --tp N --report R.json``:
SGLang's just-in-time CUDA kernels for one model, built all at once beside the server's start
(``rollout.sglang_prebuild_kernels``; the engine actor starts it with the server).

Why: sglang 0.5.17 compiles some of its kernels with nvcc the first time it runs them, inside its CUDA-graph
capture, one after another. On a fresh H200 that was most of a 111.22 s start (the capture part 64.48 s): FlashInfer's
norm and five kernels of SGLang's own at 6-8 s each (qknorm, fused_rope, kvcache, activation, clamp_position;
``bench/measured/h200_rollout_cpu.md``). The builds land in caches kept across runs (``~/.cache/tvm-ffi``,
``~/.cache/flashinfer``), so only a machine's first start pays them. Here each runs in a thread of its own (nvcc is a
child process: one CPU a build), into the same caches, the longest (the norm, 28.67-41.03 s) first. The server,
reaching a kernel, loads it if it is built, else takes the build's lock (both libraries take one) and waits for it; a
library it finds half-written fails to load and is built again under the lock. A fresh H200 started in 55.75 s
(``bench/measured/h200_prebuild_kernels.md``). The engines of a node run one prebuild between them (``claim``).

Nothing here is required: a kernel this list misses, or one that fails to build here (another sglang: its
functions moved), the server builds itself as it would have; the report says which. The list (``kernels_for``) is
what sglang 0.5.17 builds for a dense bf16 or fp16 model with grouped-query attention, as far as the model's
``config.json`` tells (its head size, key-value heads per GPU, rotary size, query-key norm).

No GPU is touched: the GPUs' compute capability comes from NVML, and this process hides the GPUs from CUDA
(``CUDA_VISIBLE_DEVICES=""``, read when CUDA initialises) before anything could initialise it, so it holds no GPU
memory while the server measures what is free.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple

# model types whose sglang 0.5.17 implementation normalises queries and keys per head (apply_qk_norm)
QK_NORM_MODELS = frozenset({"qwen3", "qwen3_moe", "qwen3_next", "olmo2", "glm4_moe", "llama4", "bailing_moe"})
# model types whose sglang 0.5.17 implementation rotates interleaved pairs (is_neox_style=False), not halves
INTERLEAVED_ROPE_MODELS = frozenset({"glm4", "chatglm"})
DTYPE_BYTES = {"bfloat16": 2, "float16": 2}  # float32 servers run the transformers implementation (sglang.py)
TORCH_DTYPES = ("bfloat16", "float16", "int64")  # the kernels' arguments that name a torch dtype


@dataclass(frozen=True)
class Kernel:
    """One build: ``module.function(*args)`` (sglang's own memoised loader; dtypes by name)."""

    name: str
    module: str
    function: str
    args: Tuple[Any, ...] = ()


def kernels_for(config: Dict[str, Any], dtype: str, tp: int) -> List[Kernel]:
    """The kernels sglang 0.5.17 compiles on its first use of a model with this Hugging Face ``config`` (a
    ``config.json`` as a dict) served in ``dtype`` over ``tp`` GPUs. FlashInfer's norm and the activation and
    position kernels serve every model; the attention kernels need the model's heads (none for multi-head latent
    attention, ``kv_lora_rank``, whose kernels are others), the query-key norm a model type that has it."""
    config = {**(config.get("text_config") or {}), **config}  # a multimodal config keeps the language model's inside
    if dtype == "auto":  # the checkpoint's, and SGLang serves a float32 one in float16
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("float32", "float16")
    if dtype not in DTYPE_BYTES:
        return []
    out = [Kernel("flashinfer norm", "flashinfer.norm", "get_norm_module"),  # the longest (28.67-41.03 s, H200): first
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
    """Import the kernel's module; None, or why it does not import. Done in one thread, module after module: sglang's
    kernel modules import each other, and threads importing them at once deadlocked on Python's import locks (four of
    six builds lost on the H200). The builds started meanwhile import only their libraries' own build helpers. An
    sglang module's build target is pinned here too (``pin_sglang_target``)."""
    import importlib

    try:
        importlib.import_module(kernel.module)
        if kernel.module.startswith("sglang."):
            pin_sglang_target()
        return None
    except Exception as e:  # noqa: BLE001 - the server builds it itself when it needs it
        return f"{type(e).__name__}: {e}"[:300]


def build(kernel: Kernel, since: float = 0.0) -> Dict[str, Any]:
    """Build one kernel (load it, as sglang's loader does); what happened, when it started and ended (seconds after
    ``since``, a ``time.monotonic()``), printed as it ends."""
    import importlib

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
    """The compute capability of each GPU CUDA would see here (``CUDA_VISIBLE_DEVICES``), from NVML; [] where it
    names none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return []
    import pynvml

    from slime_hydra.rollout.engines.sglang_preload import nvml_handle  # CUDA's device index -> NVML's handle

    pynvml.nvmlInit()
    try:
        count = len([e for e in visible.split(",") if e.strip()]) if visible is not None else \
            pynvml.nvmlDeviceGetCount()
        return [tuple(pynvml.nvmlDeviceGetCudaComputeCapability(nvml_handle(i))) for i in range(count)]
    finally:
        pynvml.nvmlShutdown()


def answer_without_gpus(caps: Sequence[Tuple[int, int]]) -> None:
    """Set this process up to compile for ``caps`` with no GPU visible: FlashInfer reads its targets from
    ``FLASHINFER_CUDA_ARCH_LIST``; sglang asks torch for the current device's capability, answered here."""
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = " ".join(sorted({f"{major}.{minor}" for major, minor in caps}))
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda device=None: tuple(caps[0])


def pin_sglang_target() -> None:
    """sglang's loader sets ``TVM_FFI_CUDA_ARCH_LIST`` to its target (e.g. 9.0a) around each build and removes it
    after; with builds side by side, one could start after another removed it and compile for nvidia-smi's plain
    sm_90 into the 9.0a folder. Set for the whole process, every build puts back the same value."""
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
    """An exclusive lock on building these kernels for these GPUs on this machine, held while the returned file is
    open; None when another process holds it. So the engines of a node (eight on eight GPUs, colocated) run one
    prebuild between them, not eight processes importing torch and sglang to build the same kernels into the same
    caches. The file is in slime_hydra's cache folder (``sglang.cache_dir``)."""
    import fcntl
    import hashlib

    from slime_hydra.rollout.engines.sglang import cache_dir

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
    """The model's ``config.json`` as a dict: read as it is from a folder (importing transformers took seconds on a
    fresh machine, before the longest build could start), else through transformers (a Hugging Face id)."""
    path = os.path.join(model_path, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).to_dict()


def main(argv: List[str]) -> int:
    import argparse

    from slime_hydra.logging.metrics import write_json_atomic

    parser = argparse.ArgumentParser(prog="sglang_kernels")
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
    if report.get("skipped"):
        print(f"no kernels built: {report['skipped']}", flush=True)
    else:
        print(f"done in {report['seconds']:.2f} s", flush=True)
    write_json_atomic(a.report, report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
