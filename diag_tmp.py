import os, sys, traceback
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
import torch
maps = lambda: "libcuda.so" in open("/proc/self/maps").read()
print("libcuda after import torch:", maps())
import triton
print("libcuda after import triton:", maps())
from slime_hydra.rollout.engines import sglang_preload as P
seen = []
def refuse(*a, **k):
    seen.append("".join(traceback.format_stack(limit=14)))
    raise P.CudaAtImport("x")
for n in P.CUDA_ENTRY_POINTS: setattr(torch._C, n, refuse)
torch.cuda.get_device_capability = P.nvml_capability(torch.cuda.get_device_capability)
for m in ["sglang.srt.server_args", "sglang.srt.managers.detokenizer_manager", "sglang.srt.managers.scheduler"]:
    try:
        __import__(m); print("imported", m, "libcuda:", maps())
    except Exception as e:
        print("FAILED", m, type(e).__name__, "libcuda:", maps())
        print(seen[-1] if seen else "")
