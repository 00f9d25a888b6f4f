"""The megatron-core trainer backend (:class:`~slime_hydra.train.backend.TrainerBackend`): a ``GPTModel``
built from the checkpoint's Hugging Face config (:mod:`slime_hydra.train.backends.megatron`), tensor / pipeline
(with virtual stages) / expert parallel as ``parallelism.*`` says, megatron's DDP and distributed
optimizer (Adam with float32 main weights), packed micro-batches cut by a token budget.

Layout: megatron's ``parallel_state`` owns the groups. The data-parallel rank and size are megatron's
(context parallelism is refused by the config rules: the SDP attention spec has none); global rank 0
pushes the weights and writes ``hf/``; the ranks with TP rank 0 on the last pipeline stage report
metrics (the loss function runs on the last stage only).

Loss scaling: megatron's schedule divides each micro-batch's loss by the number of micro-batches and
DDP averages gradients over the data-parallel group, so each share is multiplied by both: the gradient
is that of the sum of the shares over micro-batches and ranks, as the interface asks.

Reference model (``needs_ref``): a pinned CPU copy of this rank's local shards, swapped into the model
for the reference pass through a CPU staging copy of the policy's own (as the torch backend does).

Offload (colocated engines): DDP's parameter buffer goes to a pinned host copy that the parameters
point at meanwhile (the driver pushes weights while the trainer is offloaded; with
``use_distributed_optimizer=false`` there is no parameter buffer and the parameters move one by one), the
gradient buffers' storage is freed (``_ParamAndGradBuffer.offload_to_cpu``; zeroed on return), and the
optimizer's float32 main weights and Adam moments move to pinned host buffers allocated once (not
``MegatronOptimizer.offload_to_cpu``: it copies into new pageable memory at every step, and its
``restore_from_cpu`` moves Adam's step counts too, which torch's fused kernel then rejects on the host,
or the foreach kernel pays a sync for on the GPU). Small buffers (rotary tables) stay.

Checkpoints: ``hf/`` (sharded safetensors with an index, config and tokenizer) and ``megatron/``, a
``megatron.core.dist_checkpointing`` checkpoint (torch_dist format) that every rank writes its part of:
the model chunks' ``sharded_state_dict`` (each tensor under its global name and shape, the vocabulary's
padding allowed to differ), the optimizer's (main weights and Adam moments; the distributed optimizer's in
its ``fully_reshardable`` form, gathered to each data-parallel group's first rank to save), the reference
weights (``ref.*``), each rank's RNG states, and in the common part the step count, the parallel layout
and the RL step's counters. So a resume may change the parallel layout (tested on CPU: TP, PP, EP and DP
of 2 resumed at 1): the shards are cut anew; RNG states come back only under the layout that saved them.
The data position is the driver's ``data_state.json``, the learning rate follows from the step count, and
the crash-safe write (``step_N.tmp`` renamed once complete) is :mod:`slime_hydra.checkpoint.ckpt`'s. The
SDP attention spec has no parameters and our RMSNorm is a plain module, so megatron's default sharded
state dict (replicated over TP) covers them; GLM-4's post norms ride on the row-parallel linears' own.
Checkpoints of the earlier per-rank format (``megatron/rank_XXXXX.pt``) are refused with an error naming
the file. Around megatron-core 0.16.1 with torch's Adam (no Transformer Engine, no apex):
:meth:`MegatronBackend._init_optimizer_state` and :meth:`MegatronBackend._load_optimizer`.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from slime_hydra.train import algorithms as A
from slime_hydra.train.backend import PolicyLossFn, StepResult, TrainerBackend, WarmUpShape
from slime_hydra.train.backends.megatron.packing import PackedBatch, pack
from slime_hydra.train.backends.megatron.weights import DEFAULT_BUCKET_BYTES
from slime_hydra.train.backends.torch.offload import pinned_buffer
from slime_hydra.train.optim import lr_lambda, read_metrics

if TYPE_CHECKING:
    from slime_hydra.config.schema import AlgoConfig, ModelConfig, ParallelismConfig, TrainerConfig

log = logging.getLogger(__name__)

CKPT_FORMAT = "torch_dist"  # megatron.core.dist_checkpointing's backend
# the distributed optimizer's state in a form that re-shards over TP / PP / EP / DP, gathered to save on each
# DP group's first rank over gloo in host memory (not over NCCL into every rank's GPU: a colocated run saves
# while the engines hold the GPU); keyed by parameter name, without the chained optimizers' prefixes
_OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                       "distrib_optim_fully_reshardable_mem_efficient": True}


@dataclass
class PackedMicroBatch:
    """A packed micro-batch (on the device) and the width of the response-aligned tensors of its rows."""

    packed: PackedBatch
    width: int

    @property
    def indices(self) -> List[int]:
        return self.packed.indices


def contiguous_budget_groups(lengths: Sequence[int], max_tokens: Optional[int], max_samples: int) -> List[List[int]]:
    """Consecutive positions ``0..n-1`` cut into groups of at most ``max_tokens`` tokens (None: no token
    budget) and ``max_samples`` samples. Consecutive, because the RL step wants the rows in order."""
    groups: List[List[int]] = []
    cur: List[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if max_tokens is not None and n > max_tokens:
            raise ValueError(f"trainer.max_tokens_per_micro_batch: a sample has {n} tokens, more than the budget "
                             f"{max_tokens}")
        if cur and ((max_tokens is not None and used + n > max_tokens) or len(cur) >= max_samples):
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


def compile_layers(chunks: Sequence[torch.nn.Module]) -> None:
    """``trainer.compile``: each decoder layer of each model chunk under torch.compile, dynamic shapes (one
    graph, and its backward, serves every layer and packed length; the no-grad log-prob pass gets its own),
    as the torch backend does. A dense layer is one graph: the packed RoPE reads nothing on the host
    (``spec.packed_rotary_pos_emb``), the linears pass their TP group (``spec._PassTPGroup``: megatron's own
    warn on every call, and a warning breaks the graph), and on GPUs the packed attention is one varlen flash
    call; only the layer's last call, ``make_viewless_tensor``, which sets ``.data``, runs eagerly after it.
    MoE layers' expert linears are megatron's own (their warnings split those graphs)."""
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            layer.compile(dynamic=True)


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


class MegatronBackend(TrainerBackend):
    def __init__(self, *, model: ModelConfig, algo: AlgoConfig, trainer: TrainerConfig,
                 parallelism: ParallelismConfig, model_path: str, rank: int, world_size: int, device: torch.device):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from transformers import AutoConfig

        from slime_hydra.train.backends.megatron.convert import Layout, stage_shard
        from slime_hydra.train.backends.megatron.model import (
            Parallel,
            build_gpt_model,
            transformer_config,
            use_fused_adam,
        )
        from slime_hydra.train.backends.megatron.weights import load_hf_weights

        self.algo, self.trainer_cfg, self.model_cfg = algo, trainer, model
        self.rank, self.world_size, self.device = rank, world_size, device
        self.model_path = model_path
        self.cuda = device.type == "cuda"
        self.dtype = getattr(torch, model.dtype)
        if not dist.is_initialized():  # the actor makes a group only for several ranks; megatron needs one
            from slime_hydra.utils.proc import free_port

            dist.init_process_group("nccl" if self.cuda else "gloo", rank=0, world_size=1,
                                    init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}")
        p = parallelism
        vpp = p.virtual_pipeline_parallel
        self.parallel = Parallel(tp=p.tensor_parallel, pp=p.pipeline_parallel, vpp=vpp, cp=p.context_parallel,
                                 ep=p.expert_parallel, etp=p.expert_tensor_parallel,
                                 sequence_parallel=p.sequence_parallel)
        ps.initialize_model_parallel(tensor_model_parallel_size=p.tensor_parallel,
                                     pipeline_model_parallel_size=p.pipeline_parallel,
                                     virtual_pipeline_model_parallel_size=vpp,
                                     context_parallel_size=p.context_parallel,
                                     expert_model_parallel_size=p.expert_parallel,
                                     expert_tensor_parallel_size=p.expert_tensor_parallel)
        if self.cuda:
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(torch.initial_seed() - rank)  # the actor seeded seed + rank
        self.hf = AutoConfig.from_pretrained(model_path, trust_remote_code=model.trust_remote_code)
        overrides = _recompute_overrides(trainer.recompute)
        if not self.cuda:  # torch.compile'd fusions only cost compile time on CPU
            overrides.update(bias_activation_fusion=False, bias_dropout_fusion=False)
        overrides.update(trainer.megatron or {})
        self.config = transformer_config(self.hf, self.parallel, dtype=self.dtype, overrides=overrides,
                                         cpu_init=not self.cuda)
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        ep_rank = ps.get_expert_model_parallel_rank()
        etp_rank = ps.get_expert_tensor_parallel_rank()
        stages = [None] if vpp is None else list(range(vpp))
        chunks, self.shards = [], []
        for vp in stages:
            shard = stage_shard(self.config, tp_rank=self.tp_rank, ep_rank=ep_rank, etp_rank=etp_rank,
                                pp_rank=self.pp_rank, vp_stage=vp)
            chunks.append(build_gpt_model(self.hf, self.config, attention="auto",
                                          pre_process=shard.pre_process, post_process=shard.post_process,
                                          vp_stage=vp, pp_rank=self.pp_rank).to(device))
            self.shards.append(shard)
        if trainer.compile:
            compile_layers(chunks)
        self.layout = Layout.from_hf(self.hf, tp=p.tensor_parallel)
        load_hf_weights(chunks, model_path, self.layout, self.shards)

        self.ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=trainer.use_distributed_optimizer,
            overlap_grad_reduce=False)
        self.chunks = [DistributedDataParallel(config=self.config, ddp_config=self.ddp_config, module=c,
                                               disable_bucketing=len(chunks) > 1 and i > 0)
                       for i, c in enumerate(chunks)]
        self.config.finalize_model_grads_func = finalize_model_grads
        half = self.dtype in (torch.bfloat16, torch.float16)
        self.opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=algo.lr, min_lr=algo.min_lr, weight_decay=algo.weight_decay,
            adam_beta1=algo.adam_beta1, adam_beta2=algo.adam_beta2, adam_eps=algo.adam_eps,
            clip_grad=algo.clip_grad, bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16,
            params_dtype=self.dtype, use_distributed_optimizer=trainer.use_distributed_optimizer,
            main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
        ), self.chunks)
        use_fused_adam(self.opt)
        if half:
            self.config.grad_scale_func = self.opt.scale_loss
        self.steps_done = 0
        self.set_num_rollout(trainer.num_rollout or 1)

        self.tp_group = ps.get_tensor_model_parallel_group() if p.tensor_parallel > 1 else None
        self.pp_group = ps.get_pipeline_model_parallel_group() if p.pipeline_parallel > 1 else None
        self.ep_group = ps.get_expert_model_parallel_group() if p.expert_parallel > 1 else None
        self.etp_group = ps.get_expert_tensor_parallel_group() if _size(ps.get_expert_tensor_parallel_group()) > 1 \
            else None
        self.dp_group = ps.get_data_parallel_group()
        self._dp_rank, self._dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.is_last_stage = self.pp_rank == p.pipeline_parallel - 1
        self.pp_last_global = dist.get_global_rank(self.pp_group, p.pipeline_parallel - 1) if self.pp_group else rank
        self.pad_id = getattr(self.hf, "pad_token_id", None) or 0

        self.critic = None  # PPO's critic: not with megatron (the RL step refuses advantage_estimator=ppo)
        needs_ref = A.needs_ref(algo)
        self.ref_state = self._cpu_copy() if needs_ref else None
        self._backup = self._cpu_copy() if needs_ref else None
        self._offloaded = False  # the weights are on the host
        self._state_offloaded = False  # gradients freed, optimizer state on the host
        self._host: Dict[int, torch.Tensor] = {}  # id(buffer or parameter) -> its pinned host copy
        self._views: Dict[int, torch.Tensor] = {}  # id(parameter) -> its view of the GPU buffer, while offloaded
        self._param_bytes: Dict[int, int] = {}

    # ------------------------------------------------------------------------------ layout
    @property
    def dp_rank(self) -> int:
        return self._dp_rank

    @property
    def dp_size(self) -> int:
        return self._dp_size

    @property
    def pushes_weights(self) -> bool:
        return self.rank == 0

    @property
    def reports_metrics(self) -> bool:
        return self.is_last_stage and self.tp_rank == 0

    def dp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self._dp_size > 1:
            t = t.to(self.device)
            dist.all_reduce(t, group=self.dp_group)
        return t.cpu()

    def set_num_rollout(self, num_rollout: int) -> None:
        self.total_steps = max(1, num_rollout - self.algo.num_critic_only_steps) * \
            (self.trainer_cfg.num_steps_per_rollout or 1)
        self._set_lr()

    def _set_lr(self) -> None:
        lr = self.algo.lr * lr_lambda(self.algo, self.total_steps)(self.steps_done)
        for g in self.opt.param_groups:
            g["lr"] = lr

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    # ------------------------------------------------------------------------------ weights
    def _params(self) -> List[torch.Tensor]:
        seen, out = set(), []
        for c in self.chunks:
            for p in c.module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _cpu_copy(self) -> List[torch.Tensor]:
        out = []
        for p in self._params():
            t = torch.empty(p.shape, dtype=p.dtype, pin_memory=self.cuda)
            t.copy_(p.detach())
            out.append(t)
        return out

    @contextlib.contextmanager
    def swapped_in(self, state: List[torch.Tensor]) -> Iterator[None]:
        """Run the model with ``state``'s weights (this rank's shards), then restore its own."""
        params = self._params()
        with torch.no_grad():
            for p, b, s in zip(params, self._backup, state):
                b.copy_(p, non_blocking=True)
                p.copy_(s, non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(params, self._backup):
                    p.copy_(b, non_blocking=True)
            if self.cuda:
                torch.cuda.synchronize()

    def hf_weights(self, every_rank: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
        from slime_hydra.train.backends.megatron.weights import export_hf_weights, model_chunks_state

        chunks = model_chunks_state(self.chunks, self.shards)
        if self._offloaded and any(g is not None for g in (self.tp_group, self.pp_group, self.ep_group)):
            # offloaded weights are on the host; the gathers run over NCCL: bring this rank's shards back
            chunks = [({k: v.to(self.device) if torch.is_tensor(v) else v for k, v in st.items()}, sh)
                      for st, sh in chunks]
        for bucket in export_hf_weights(chunks, self.layout, bucket_bytes=DEFAULT_BUCKET_BYTES,
                                        tp_group=self.tp_group, pp_group=self.pp_group, ep_group=self.ep_group,
                                        etp_group=self.etp_group):
            if self.pushes_weights or every_rank:
                for name, t in bucket:
                    yield name, t.to(self.dtype)

    def _buffers(self):
        for c in self.chunks:
            yield from c.buffers + c.expert_parallel_buffers

    def offload(self, keep_weights: bool = False) -> None:
        """Gradient buffers freed, optimizer state (main weights, Adam moments) to the host, then the
        weights to pinned host memory (the parameters point at it, so :meth:`hf_weights` still reads them).
        ``keep_weights``: the weights stay on the GPU, where the push reads them at GPU speed; the next
        ``offload()`` moves them."""
        if not self.cuda or self._offloaded:
            return
        torch.cuda.synchronize()
        if not self._state_offloaded:
            for b in self._buffers():
                b.offload_to_cpu(move_params=False, move_grads=True)
            for t in self._optimizer_tensors():  # into pinned buffers kept across steps, asynchronously
                host = pinned_buffer(self._host, id(t), t)
                host.copy_(t.data, non_blocking=True)
                t.data = host
            self._state_offloaded = True
        if not keep_weights:
            self._offload_weights()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def _offload_weights(self) -> None:
        for b in self._buffers():
            if b.param_data is not None:  # the distributed optimizer's contiguous parameter buffer
                host = pinned_buffer(self._host, id(b), b.param_data)
                host.copy_(b.param_data)
                for p in b.params:
                    start, end, _ = b.param_index_map[p]
                    self._views[id(p)] = p.data
                    p.data = host[start:end].view(p.shape)
                self._param_bytes[id(b)] = b.param_data.untyped_storage().size()
                b.param_data.untyped_storage().resize_(0)
        if not self.ddp_config.use_distributed_optimizer:  # no parameter buffer: the parameters one by one
            for p in self._params():
                host = pinned_buffer(self._host, id(p), p)
                host.copy_(p.data)
                p.data = host
        self._offloaded = True

    def _rehook_grads(self) -> None:
        """Hook megatron's DDP into the parameters' gradient accumulators again. A parameter whose ``.data``
        moves between devices gets a new accumulator from torch (``set_data`` drops the old one), and DDP's
        hook on the old one no longer runs: backward then leaves ``main_grad`` at zero and the optimizer
        steps on nothing (every step after an offload, until this; tests/gpu/test_megatron_offload.py).
        As ``DistributedDataParallel.__init__`` registers them (megatron-core 0.16.1)."""
        for chunk in self.chunks:
            chunk.grad_accs = []
            for param in chunk.module.parameters():
                if param.requires_grad:
                    acc = param.expand_as(param).grad_fn.next_functions[0][0]
                    acc.register_hook(chunk._make_backward_post_hook(param))
                    chunk.grad_accs.append(acc)

    def _optimizer_tensors(self) -> Iterator[torch.Tensor]:
        """The optimizer's float32 main weights and Adam moments (each once), not its step counts: those
        stay where torch's kernel reads them (on the GPU for the fused one, which fails on host counts)."""
        seen = set()
        for o in self._inner_optimizers():
            opt = o.optimizer
            tensors = [p for g in opt.param_groups for p in g["params"]]
            tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
            for t in tensors:
                if id(t) not in seen:
                    seen.add(id(t))
                    yield t

    def onload(self) -> None:
        if not self.cuda or not (self._offloaded or self._state_offloaded):
            return
        for b in self._buffers():
            if b.param_data is not None and self._offloaded:
                b.param_data.untyped_storage().resize_(self._param_bytes[id(b)])
                b.param_data.copy_(self._host[id(b)], non_blocking=True)
                for p in b.params:
                    p.data = self._views.pop(id(p))
            if self._state_offloaded:
                b.reload_from_cpu(move_params=False, move_grads=True)
        if not self.ddp_config.use_distributed_optimizer and self._offloaded:
            for p in self._params():
                p.data = p.data.to(self.device, non_blocking=True)
        if self._state_offloaded:
            for t in self._optimizer_tensors():
                t.data = t.data.to(self.device, non_blocking=True)
        self._rehook_grads()
        torch.cuda.synchronize()
        self._offloaded = self._state_offloaded = False

    # --------------------------------------------------------------------------------- data
    def micro_batches(self, data: Dict[str, list], rows: Sequence[int], response_len: int) -> List[PackedMicroBatch]:
        t = self.trainer_cfg
        lengths = [len(data["tokens"][i]) for i in rows]
        groups = contiguous_budget_groups(lengths, t.max_tokens_per_micro_batch,
                                          t.micro_batch_size if t.max_tokens_per_micro_batch is None else len(rows))
        multiple = self.parallel.tp if self.parallel.sequence_parallel else 1
        out = []
        for g in groups:
            packed = pack(data["tokens"], data["response_lengths"], [rows[j] for j in g], data.get("loss_masks"),
                          pad_to_multiple=multiple, pad_id=self.pad_id)
            out.append(PackedMicroBatch(packed.to(self.device), response_len))
        return out

    # -------------------------------------------------------------------------------- passes
    def _forward_backward(self, mbs: Sequence[PackedMicroBatch], temperature: float, loss_of, forward_only: bool):
        """megatron's schedule over ``mbs``; ``loss_of(mb, log_probs [b, T], entropy [b, T] or None)`` runs on
        the last stage and returns (loss, metrics). Returns the metrics of the last stage's micro-batches."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from slime_hydra.train.backends.megatron.logprobs import packed_response_log_probs

        vocab, tp_group, fuse = self.hf.vocab_size, self.tp_group, bool(self.trainer_cfg.compile)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            b = mb.packed
            out = model(b.input_ids, b.position_ids, None, packed_seq_params=b.packed_seq_params())

            def loss_func(output):
                lp, ent = packed_response_log_probs(output, b, vocab_size=vocab, temperature=temperature,
                                                    tp_group=tp_group, with_entropy=not forward_only, fuse=fuse)
                return loss_of(mb, b.per_sample(lp, mb.width), None if ent is None else b.per_sample(ent, mb.width))

            return out, loss_func

        n = len(mbs)
        it = iter(mbs) if len(self.chunks) == 1 else [iter(mbs) for _ in self.chunks]
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=it, model=self.chunks if len(self.chunks) > 1
            else self.chunks[0], num_microbatches=n, seq_length=max(mb.packed.num_tokens for mb in mbs),
            micro_batch_size=1, forward_only=forward_only)

    @torch.no_grad()
    def _log_probs(self, mbs: Sequence[PackedMicroBatch], temperature: float) -> torch.Tensor:
        for c in self.chunks:
            c.eval()
        got: List[torch.Tensor] = []

        def keep(mb, lp, _):
            got.append(lp.float())  # on the device: one copy to the host at the end, not a wait a micro-batch
            return lp.new_zeros(()), {}

        self._forward_backward(mbs, temperature, keep, forward_only=True)
        rows, width = sum(len(mb.indices) for mb in mbs), mbs[0].width if mbs else 0
        out = torch.cat(got).cpu() if got else torch.zeros(rows, width)
        if self.pp_group is not None:  # every rank returns the last stage's
            buf = out.to(self.device)
            dist.broadcast(buf, src=self.pp_last_global, group=self.pp_group)
            out = buf.cpu()
        return out

    def log_probs(self, mbs: Sequence[PackedMicroBatch], temperature: float, *,
                  reference: bool = False) -> torch.Tensor:
        if not reference:
            return self._log_probs(mbs, temperature)
        if self.ref_state is None:
            raise RuntimeError("reference log-probs asked for, but algo has neither kl_coef nor kl_loss_coef, "
                               "so the backend kept no reference weights")
        with self.swapped_in(self.ref_state):
            return self._log_probs(mbs, temperature)

    def accumulate_grads(self, mbs: Sequence[PackedMicroBatch], temperature: float,
                         loss_fn: PolicyLossFn) -> Dict[str, float]:
        """Zeroed gradients, then forward and backward over ``mbs`` (reduced over data-parallel ranks
        into DDP's ``main_grad`` buffers); returns the loss function's metrics summed over this rank's
        micro-batches (empty off the last pipeline stage)."""
        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()
        self.opt.zero_grad()
        scale = len(mbs) * self._dp_size  # undo the schedule's 1 / micro-batches and DDP's 1 / DP

        def loss_of(mb, lp, ent):
            loss, metrics = loss_fn(mb.indices, lp, ent)
            return loss * scale, {k: v.detach() for k, v in metrics.items()}

        sums: Dict[str, torch.Tensor] = {}
        for metrics in self._forward_backward(mbs, temperature, loss_of, forward_only=False) or []:
            for k, v in metrics.items():  # summed on the device, read in one copy
                v = v.detach().float()
                sums[k] = sums[k] + v if k in sums else v
        return read_metrics(sums)

    def warm_up(self, temperature: float, shape: WarmUpShape) -> None:
        """Dummy rows of the step's shape (``warm_up_micro_batches``) through megatron's schedule as a training step
        runs them (the no-grad log-prob pass, then forward and backward), then DDP's gradient buffers zeroed: the first
        step's one-off costs (CUDA's set-up, the torch.compile'd fusions, ``trainer.compile``'s graphs) are paid
        while the engines start. No optimizer step; the random number generators (megatron's tracker too) are
        restored. Every rank calls it (the schedule's and DDP's collectives)."""
        rng = self._rng_state()
        mbs = self.warm_up_micro_batches(shape)
        self._log_probs(mbs, temperature)  # the step's no-grad pass (eval mode; the reference's is the same pass)
        self.accumulate_grads(mbs, temperature, lambda rows, lp, ent: (0.0 * lp.sum(), {}))
        for c in self.chunks:
            c.zero_grad_buffer()
        self.opt.zero_grad()
        self._set_rng_state(rng)
        self.free_cache()

    def train_step(self, mbs: Sequence[PackedMicroBatch], temperature: float, loss_fn: PolicyLossFn) -> StepResult:
        metrics = self.accumulate_grads(mbs, temperature, loss_fn)
        _, grad_norm, _ = self.opt.step()  # clips to algo.clip_grad; the norm is over all model-parallel ranks
        self.steps_done += 1
        self._set_lr()
        return StepResult(grad_norm=float(grad_norm or 0.0), metrics=metrics)

    # ---------------------------------------------------------------------------- checkpoints
    def export_hf(self, out_dir: str, tokenizer_dir: Optional[str]) -> None:
        """Every rank gathers; global rank 0 writes ``model.dtype`` safetensors shards (one per export
        bucket) with an index, the config and the tokenizer."""
        from safetensors.torch import save_file

        weight_map: Dict[str, str] = {}
        shard: Dict[str, torch.Tensor] = {}
        used, files = 0, 0
        limit = DEFAULT_BUCKET_BYTES
        if self.pushes_weights:
            os.makedirs(out_dir, exist_ok=True)

        def flush():
            nonlocal shard, used, files
            if shard:
                files += 1
                name = f"model-{files:05d}.safetensors"
                save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
                weight_map.update({k: name for k in shard})
                shard, used = {}, 0

        for name, t in self.hf_weights():
            shard[name] = t.detach().to("cpu").contiguous().clone()
            used += t.numel() * t.element_size()
            if used >= limit:
                flush()
        if not self.pushes_weights:
            return
        flush()
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
        self.hf.save_pretrained(out_dir)
        gen = os.path.join(self.model_path, "generation_config.json")
        if os.path.isfile(gen):
            shutil.copy(gen, out_dir)
        if tokenizer_dir:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)

    def _inner_optimizers(self):
        return getattr(self.opt, "chained_optimizers", [self.opt])

    def _layout(self) -> Dict[str, Any]:
        return {"tp": self.parallel.tp, "pp": self.parallel.pp, "vpp": self.parallel.vpp, "ep": self.parallel.ep,
                "world_size": self.world_size}

    def _rng_state(self) -> Dict[str, Any]:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if self.cuda else None,
                "tracker": get_cuda_rng_tracker().get_states() if self.cuda else None}

    def _set_rng_state(self, rng: Dict[str, Any]) -> None:
        torch.set_rng_state(rng["cpu"])
        if self.cuda and rng["cuda"] is not None:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            torch.cuda.set_rng_state(rng["cuda"])
            get_cuda_rng_tracker().set_states(rng["tracker"])

    def _ref_sharded(self) -> Dict[str, Any]:
        """The reference weights as sharded tensors: the model's own entries renamed ``ref.<key>``, with
        the pinned host copies as their data."""
        from dataclasses import replace

        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        ref = {id(p): t for p, t in zip(self._params(), self.ref_state)}
        out: Dict[str, Any] = {}
        for i, c in enumerate(self.chunks):
            for name, v in c.module.sharded_state_dict().items():
                if isinstance(v, (ShardedTensor, ShardedTensorFactory)) and id(v.data) in ref:
                    out[f"{i}.{name}"] = replace(v, key="ref." + v.key, data=ref.pop(id(v.data)))
        if ref:
            raise RuntimeError(f"reference weights: {len(ref)} parameter(s) have no entry in the model's sharded "
                               "state dict")
        return out

    def _init_optimizer_state(self) -> None:
        """Adam's state exists only after a first step, and megatron's distributed optimizer with torch's
        Adam (no Transformer Engine or apex) builds its sharded state dict only once it does (0.16.1
        asserts otherwise): a step at learning rate 0 on zero gradients creates it, leaving the weights
        as they are, and its step counts go back to 0 (so Adam's bias correction is a fresh one's)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        for o in self._inner_optimizers():
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

    def _load_optimizer(self, state: Dict[Any, Any]) -> None:
        """``self.opt.load_state_dict(state)``, past two megatron-core 0.16.1 bugs of the distributed
        optimizer with torch's Adam: its fully_reshardable load copies every per-parameter state entry,
        torch's ``step`` counts included, from a checkpoint that keeps the step elsewhere (KeyError:
        'step'); and it gives every parameter the same ``step`` tensor, which Adam then increments once
        per parameter. The counts are held aside during the copy and put back, one tensor each."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        inner = self._inner_optimizers()
        for o, st in zip(inner, _per_optimizer(state, len(inner))):
            if not isinstance(o, DistributedOptimizer):
                o.load_state_dict(st)
                continue
            o.load_state_dict({k: v for k, v in st.items() if k != "param_state"})  # steps, groups, scaler
            steps = {p: ps.pop("step") for p, ps in o.optimizer.state.items() if "step" in ps}
            o.load_parameter_state_from_fully_reshardable(st["param_state"])
            for p, step in steps.items():
                o.optimizer.state[p]["step"] = step.clone()
        if len(inner) > 1:
            self.opt._synchronize_steps()

    def _sharded_state(self, *, loading: bool, rng: bool) -> Dict[str, Any]:
        """The checkpoint as megatron's sharded state dict (see the module docstring)."""
        from megatron.core.dist_checkpointing import ShardedObject

        self._init_optimizer_state()
        sd: Dict[str, Any] = {f"model{i}": c.module.sharded_state_dict() for i, c in enumerate(self.chunks)}
        sd["optimizer"] = self.opt.sharded_state_dict(sd, is_loading=loading, metadata=_OPTIMIZER_SHARDING)
        if self.ref_state is not None:
            sd["ref"] = self._ref_sharded()
        if rng:
            sd["rng"] = ShardedObject("rng_state", self._rng_state(), (self.world_size,), (self.rank,), replica_id=0)
        return sd

    def save(self, out_dir: str, trainer_state: Dict[str, Any]) -> None:
        """Every rank writes its shards of ``out_dir/megatron`` (a dist_checkpointing checkpoint)."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

        path = os.path.join(out_dir, "megatron")
        os.makedirs(path, exist_ok=True)
        sd = self._sharded_state(loading=False, rng=True)
        sd.update(steps_done=self.steps_done, layout=self._layout(), has_ref=self.ref_state is not None,
                  trainer_state=trainer_state)
        dist_checkpointing.save(sd, path, sharded_strategy=get_default_save_sharded_strategy(CKPT_FORMAT))
        dist.barrier()

    def load(self, ckpt_dir: str) -> Dict[str, Any]:
        """Restore ``ckpt_dir/megatron`` into this run's layout, whichever layout saved it."""
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
        same_layout = common["layout"] == self._layout()
        sd = self._sharded_state(loading=True, rng=same_layout)
        if not common["has_ref"]:
            sd.pop("ref", None)
        ref_targets = {k: v.data for k, v in sd.get("ref", {}).items()}
        state = dist_checkpointing.load(sd, path)
        for i, c in enumerate(self.chunks):
            c.module.load_state_dict(state[f"model{i}"])
        self._load_optimizer(state["optimizer"])
        with torch.no_grad():
            for k, t in state.get("ref", {}).items():
                ref_targets[k].copy_(t)
        if same_layout:
            self._set_rng_state(state["rng"])
        else:
            log.info("%s: saved with parallel layout %s, this run has %s: the shards were re-sharded, the RNG "
                     "states are not restored", path, common["layout"], self._layout())
        self.steps_done = state["steps_done"]
        self._set_lr()
        return state["trainer_state"]



def _per_optimizer(state: Dict[Any, Any], n: int) -> List[Dict[str, Any]]:
    """The loaded optimizer state, one dict per optimizer of this run. megatron chains an optimizer per
    kind of parameter whose data-parallel group differs (dense and expert parameters at EP > 1, one
    optimizer at EP = 1), so the count may change with the layout: the common parts (parameter groups,
    step) come keyed by the saving run's count, the sharded ones (``param_state``) by this run's."""
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


def _recompute_overrides(recompute: str) -> Dict[str, Any]:
    """``trainer.recompute`` as ``TransformerConfig`` fields (slime's --recompute-granularity)."""
    if recompute == "none":
        return {}
    if recompute == "selective":
        return {"recompute_granularity": "selective"}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    raise ValueError(f"trainer.recompute: {recompute!r} is not one of none, selective, full")
