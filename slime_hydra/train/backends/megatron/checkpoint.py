"""Checkpoints of the megatron backend. ``hf/``: safetensors shards, config and tokenizer, by global rank 0.
``megatron/``: a ``dist_checkpointing`` checkpoint (torch_dist) every rank writes its part of: the model
chunks' and the optimizer's sharded state (``fully_reshardable``), the reference weights (``ref.*``), each
rank's RNG states, and in the common part the step count, the parallel layout and the RL step's counters.
A resume may change the layout (shards are cut anew); RNG states come back only under the saving layout.
Written against megatron-core 0.16.1 with torch's Adam: :func:`init_optimizer_state`, :func:`load_optimizer`.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from dataclasses import replace
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from slime_hydra.train.backends.megatron.model import inner_optimizers
from slime_hydra.train.backends.megatron.weights import DEFAULT_BUCKET_BYTES

log = logging.getLogger(__name__)

CKPT_FORMAT = "torch_dist"  # megatron.core.dist_checkpointing's backend
# the distributed optimizer's state re-shardable over TP / PP / EP / DP, gathered over gloo in host memory (a
# colocated run saves while the engines hold the GPU), keyed by parameter name without the chained prefixes
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                      "distrib_optim_fully_reshardable_mem_efficient": True}


def write_hf(weights: Iterable[Tuple[str, torch.Tensor]], out_dir: str, *, writes: bool, hf_config,
             model_path: str, tokenizer_dir: Optional[str]) -> None:
    """Safetensors shards of ``weights`` with an index, the config, ``model_path``'s generation config and the
    tokenizer, on the rank that ``writes``; the others iterate ``weights`` for its collectives."""
    from safetensors.torch import save_file

    weight_map: Dict[str, str] = {}
    shard: Dict[str, torch.Tensor] = {}
    used = files = 0
    if writes:
        os.makedirs(out_dir, exist_ok=True)

    def flush():
        nonlocal shard, used, files
        if shard:
            files += 1
            name = f"model-{files:05d}.safetensors"
            save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, used = {}, 0

    for name, t in weights:
        shard[name] = t.detach().to("cpu").contiguous().clone()
        used += t.numel() * t.element_size()
        if used >= DEFAULT_BUCKET_BYTES:
            flush()
    if not writes:
        return
    flush()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    hf_config.save_pretrained(out_dir)
    gen = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen):
        shutil.copy(gen, out_dir)
    if tokenizer_dir:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)


def rng_state(cuda: bool) -> Dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if cuda else None,
            "tracker": get_cuda_rng_tracker().get_states() if cuda else None}


def set_rng_state(rng: Dict[str, Any], cuda: bool) -> None:
    torch.set_rng_state(rng["cpu"])
    if cuda and rng["cuda"] is not None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.cuda.set_rng_state(rng["cuda"])
        get_cuda_rng_tracker().set_states(rng["tracker"])


def save(be, out_dir: str, trainer_state: Dict[str, Any]) -> None:
    """Every rank of backend ``be`` writes its shards of ``out_dir/megatron``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    path = os.path.join(out_dir, "megatron")
    os.makedirs(path, exist_ok=True)
    sd = _sharded_state(be, loading=False, rng=True)
    sd.update(steps_done=be.steps_done, layout=_layout(be), has_ref=be.ref_state is not None,
              trainer_state=trainer_state)
    dist_checkpointing.save(sd, path, sharded_strategy=get_default_save_sharded_strategy(CKPT_FORMAT))
    dist.barrier()


def load(be, ckpt_dir: str) -> Dict[str, Any]:
    """Restore ``ckpt_dir/megatron`` into ``be``'s layout (any saving layout); returns the saved ``trainer_state``."""
    from megatron.core import dist_checkpointing

    path = os.path.join(ckpt_dir, "megatron")
    if not dist_checkpointing.check_is_distributed_checkpoint(path):
        legacy = sorted(glob.glob(os.path.join(path, "rank_*.pt")))
        if legacy:
            raise ValueError(f"{legacy[0]}: a per-rank megatron checkpoint of an earlier slime_hydra, which "
                             f"this version does not resume (checkpoints are megatron.core.dist_checkpointing "
                             f"now); start a new run from {os.path.join(ckpt_dir, 'hf')} with model.path")
        raise FileNotFoundError(f"{path}: no megatron checkpoint (dist_checkpointing's metadata.json is missing)")
    common = dist_checkpointing.load_common_state_dict(path)
    same_layout = common["layout"] == _layout(be)
    sd = _sharded_state(be, loading=True, rng=same_layout)
    if not common["has_ref"]:
        sd.pop("ref", None)
    ref_targets = {k: v.data for k, v in sd.get("ref", {}).items()}
    state = dist_checkpointing.load(sd, path)
    for i, c in enumerate(be.chunks):
        c.module.load_state_dict(state[f"model{i}"])
    load_optimizer(be.opt, state["optimizer"])
    with torch.no_grad():
        for k, t in state.get("ref", {}).items():
            ref_targets[k].copy_(t)
    if same_layout:
        set_rng_state(state["rng"], be.cuda)
    else:
        log.info("%s: saved with parallel layout %s, this run has %s: the shards were re-sharded, the RNG "
                 "states are not restored", path, common["layout"], _layout(be))
    be.steps_done = state["steps_done"]
    return state["trainer_state"]


def _layout(be) -> Dict[str, Any]:
    p = be.parallel
    return {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "ep": p.ep, "world_size": be.world_size}


def _sharded_state(be, *, loading: bool, rng: bool) -> Dict[str, Any]:
    """The checkpoint as megatron's sharded state dict (see the module docstring)."""
    from megatron.core.dist_checkpointing import ShardedObject

    init_optimizer_state(be.opt)
    sd: Dict[str, Any] = {f"model{i}": c.module.sharded_state_dict() for i, c in enumerate(be.chunks)}
    sd["optimizer"] = be.opt.sharded_state_dict(sd, is_loading=loading, metadata=OPTIMIZER_SHARDING)
    if be.ref_state is not None:
        sd["ref"] = _ref_sharded(be)
    if rng:
        sd["rng"] = ShardedObject("rng_state", rng_state(be.cuda), (be.world_size,), (be.rank,), replica_id=0)
    return sd


def _ref_sharded(be) -> Dict[str, Any]:
    """The reference weights: the model's sharded entries renamed ``ref.<key>``, the host copies as data."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    ref = {id(p): t for p, t in zip(be._params(), be.ref_state)}
    out: Dict[str, Any] = {}
    for i, c in enumerate(be.chunks):
        for name, v in c.module.sharded_state_dict().items():
            if isinstance(v, (ShardedTensor, ShardedTensorFactory)) and id(v.data) in ref:
                out[f"{i}.{name}"] = replace(v, key="ref." + v.key, data=ref.pop(id(v.data)))
    if ref:
        raise RuntimeError(f"reference weights: {len(ref)} parameter(s) have no entry in the model's sharded "
                           "state dict")
    return out


def init_optimizer_state(opt) -> None:
    """Create Adam's state, without which the distributed optimizer builds no sharded state dict: a step at
    learning rate 0 on zero gradients, its step counts then reset to 0 (a fresh bias correction)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for o in inner_optimizers(opt):
        if not isinstance(o, DistributedOptimizer) or o.optimizer.state:
            continue
        lrs = [g["lr"] for g in o.optimizer.param_groups]
        for g in o.optimizer.param_groups:
            g["lr"] = 0.0
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        o.optimizer.step()
        o.optimizer.zero_grad(set_to_none=True)
        for g, lr in zip(o.optimizer.param_groups, lrs):
            g["lr"] = lr
        for st in o.optimizer.state.values():
            st["step"] = torch.zeros_like(st["step"])


def load_optimizer(opt, state: Dict[Any, Any]) -> None:
    """``opt.load_state_dict(state)``, past two bugs of the distributed optimizer with torch's Adam: its
    fully_reshardable load copies every per-parameter state entry, torch's ``step`` counts included, from
    a checkpoint that keeps the step elsewhere (KeyError: 'step'); and it gives every parameter the same
    ``step`` tensor, which Adam then increments once per parameter. The counts are held aside during the
    copy and put back, one tensor each."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = inner_optimizers(opt)
    for o, st in zip(inner, per_optimizer(state, len(inner))):
        if not isinstance(o, DistributedOptimizer):
            o.load_state_dict(st)
            continue
        o.load_state_dict({k: v for k, v in st.items() if k != "param_state"})  # steps, groups, scaler
        steps = {p: ps.pop("step") for p, ps in o.optimizer.state.items() if "step" in ps}
        o.load_parameter_state_from_fully_reshardable(st["param_state"])
        for p, step in steps.items():
            o.optimizer.state[p]["step"] = step.clone()
    if len(inner) > 1:
        opt._synchronize_steps()


def per_optimizer(state: Dict[Any, Any], n: int) -> List[Dict[str, Any]]:
    """The loaded optimizer state, one dict per optimizer of this run. megatron chains one optimizer per
    data-parallel group (dense and expert parameters at EP > 1), so the count may change with the layout:
    the common parts come keyed by the saving run's count, the sharded ``param_state`` by this run's."""
    keyed = sorted(k for k in state if isinstance(k, int))
    saved = [state[k] for k in keyed] if keyed else [state]
    if len(saved) == n:
        return saved
    if any(s.get("param_state_sharding_type") != "fully_reshardable" for s in saved):
        raise ValueError(f"the checkpoint's optimizer is chained from {len(saved)} optimizer(s), this run's from {n} "
                         "(the expert-parallel size changed); only the distributed optimizer "
                         "(trainer.use_distributed_optimizer=true) re-shards across that")
    groups = [g for s in saved for g in s["optimizer"]["param_groups"]]
    common = {k: v for k, v in saved[0].items() if k != "param_state"}
    common["optimizer"] = {**saved[0]["optimizer"], "param_groups": groups}
    mine = [state] if n == 1 else [state[i] for i in range(n)]
    return [{**common, "param_state": m["param_state"]} for m in mine]
