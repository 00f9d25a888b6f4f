"""Which CUDA IPC handle each tensor-parallel rank of a colocated engine gets: the one to the copy on
its own GPU (CUDA cannot copy from another GPU's IPC memory: seen on two H200s as "CUDA error: invalid
argument" in SGLang's rank 1 with one shared handle)."""

import pytest
import torch

from slime_hydra.sync.sender import Endpoint, WeightSender, WeightSyncError, needs_every_rank

GPU = torch.device("cuda", 0)


def test_only_cuda_ipc_to_multi_gpu_engines_needs_every_rank():
    two, one = [Endpoint("http://10.0.0.1:1", 2)], [Endpoint("http://10.0.0.1:1", 1)]
    assert needs_every_rank("tensor", two, GPU)
    assert not needs_every_rank("tensor", one, GPU)
    assert not needs_every_rank("tensor", two, torch.device("cpu"))  # shared memory: any process reads it
    assert not needs_every_rank("distributed", two, GPU) and not needs_every_rank("disk", two, GPU)


def test_each_engine_rank_gets_the_handle_on_its_gpu():
    by_gpu = {("10.0.0.1", g): f"h{g}" for g in range(4)} | {("10.0.0.2", g): f"n2h{g}" for g in range(2)}
    assert WeightSender._engine_handles(Endpoint("http://10.0.0.1:80", 2, first_gpu=2), by_gpu) == ["h2", "h3"]
    assert WeightSender._engine_handles(Endpoint("http://10.0.0.2:80", 2, first_gpu=0), by_gpu) == ["n2h0", "n2h1"]


def test_an_engine_gpu_without_a_trainer_rank_is_an_error():
    by_gpu = {("10.0.0.1", 0): "h0"}
    with pytest.raises(WeightSyncError, match=r"no trainer rank sits on GPU\(s\) \[1\]"):
        WeightSender._engine_handles(Endpoint("http://10.0.0.1:80", 2, first_gpu=0), by_gpu)
