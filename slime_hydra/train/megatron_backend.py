"""The megatron-core trainer backend (:class:`~slime_hydra.train.backend.TrainerBackend`): a ``GPTModel``
built from the checkpoint's Hugging Face config (:mod:`slime_hydra.train.megatron`), tensor / pipeline
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
optimizer's float32 main weights and Adam moments move to the host (``MegatronOptimizer.offload_to_cpu``,
pageable memory). Small buffers (rotary tables) stay.

Checkpoints: ``hf/`` (sharded safetensors with an index, config and tokenizer) and, per rank,
``megatron/rank_XXXXX.pt`` (the rank's model shards, the optimizer's main weights and Adam state, the
step count, RNG). Per-rank files, not ``megatron.core.dist_checkpointing``: our module spec's
``SDPAttention`` and the parallel layout are not re-shardable through it without TE-free sharded
state dict support we have not verified on 0.16.1; so a resume needs the same parallel layout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from slime_hydra.train import algorithms as A
from slime_hydra.train.backend import PolicyLossFn, StepResult, TrainerBackend
from slime_hydra.train.megatron.packing import PackedBatch, pack
from slime_hydra.train.megatron.weights import DEFAULT_BUCKET_BYTES
from slime_hydra.train.optim import lr_lambda

if TYPE_CHECKING:
    from slime_hydra.config.schema import AlgoConfig, ModelConfig, ParallelismConfig, TrainerConfig

log = logging.getLogger(__name__)


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

        from slime_hydra.train.megatron.convert import Layout, stage_shard
        from slime_hydra.train.megatron.model import Parallel, build_gpt_model, transformer_config
        from slime_hydra.train.megatron.weights import load_hf_weights

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
        self._offloaded = False
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

    def hf_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        from slime_hydra.train.megatron.weights import export_hf_weights, model_chunks_state

        chunks = model_chunks_state(self.chunks, self.shards)
        if self._offloaded and any(g is not None for g in (self.tp_group, self.pp_group, self.ep_group)):
            # offloaded weights are on the host; the gathers run over NCCL: bring this rank's shards back
            chunks = [({k: v.to(self.device) if torch.is_tensor(v) else v for k, v in st.items()}, sh)
                      for st, sh in chunks]
        for bucket in export_hf_weights(chunks, self.layout, bucket_bytes=DEFAULT_BUCKET_BYTES,
                                        tp_group=self.tp_group, pp_group=self.pp_group, ep_group=self.ep_group,
                                        etp_group=self.etp_group):
            if self.pushes_weights:
                for name, t in bucket:
                    yield name, t.to(self.dtype)

    def _buffers(self):
        for c in self.chunks:
            yield from c.buffers + c.expert_parallel_buffers

    def offload(self) -> None:
        """Weights to pinned host memory (the parameters point at it, so :meth:`hf_weights` still reads
        them), gradient buffers freed, optimizer state (main weights, Adam moments) to the host."""
        if not self.cuda or self._offloaded:
            return
        torch.cuda.synchronize()
        for b in self._buffers():
            if b.param_data is not None:  # the distributed optimizer's contiguous parameter buffer
                host = self._host.get(id(b))
                if host is None:
                    host = self._host[id(b)] = torch.empty(b.param_data.shape, dtype=b.param_data.dtype,
                                                           pin_memory=True)
                host.copy_(b.param_data)
                for p in b.params:
                    start, end, _ = b.param_index_map[p]
                    self._views[id(p)] = p.data
                    p.data = host[start:end].view(p.shape)
                self._param_bytes[id(b)] = b.param_data.untyped_storage().size()
                b.param_data.untyped_storage().resize_(0)
            b.offload_to_cpu(move_params=False, move_grads=True)
        if not self.ddp_config.use_distributed_optimizer:  # no parameter buffer: the parameters one by one
            for p in self._params():
                host = self._host.get(id(p))
                if host is None:
                    host = self._host[id(p)] = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                host.copy_(p.data)
                p.data = host
        self.opt.offload_to_cpu()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self._offloaded = True

    def onload(self) -> None:
        if not self.cuda or not self._offloaded:
            return
        for b in self._buffers():
            if b.param_data is not None:
                b.param_data.untyped_storage().resize_(self._param_bytes[id(b)])
                b.param_data.copy_(self._host[id(b)], non_blocking=True)
                for p in b.params:
                    p.data = self._views.pop(id(p))
            b.reload_from_cpu(move_params=False, move_grads=True)
        if not self.ddp_config.use_distributed_optimizer:
            for p in self._params():
                p.data = p.data.to(self.device, non_blocking=True)
        self.opt.restore_from_cpu()
        for o in self._inner_optimizers():  # restore_from_cpu moves Adam's step counts too: torch wants them on CPU
            for st in o.optimizer.state.values():
                if torch.is_tensor(st.get("step")) and st["step"].is_cuda:
                    st["step"] = st["step"].cpu()
        torch.cuda.synchronize()
        self._offloaded = False

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

        from slime_hydra.train.megatron.logprobs import packed_response_log_probs

        vocab, tp_group = self.hf.vocab_size, self.tp_group

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            b = mb.packed
            out = model(b.input_ids, b.position_ids, None, packed_seq_params=b.packed_seq_params())

            def loss_func(output):
                lp, ent = packed_response_log_probs(output, b, vocab_size=vocab, temperature=temperature,
                                                    tp_group=tp_group, with_entropy=not forward_only)
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
            got.append(lp.float().cpu())
            return lp.new_zeros(()), {}

        self._forward_backward(mbs, temperature, keep, forward_only=True)
        rows, width = sum(len(mb.indices) for mb in mbs), mbs[0].width if mbs else 0
        out = torch.cat(got) if got else torch.zeros(rows, width)
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

        sums: Dict[str, float] = {}
        for metrics in self._forward_backward(mbs, temperature, loss_of, forward_only=False) or []:
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        return sums

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

    def _rank_file(self, ckpt_dir: str) -> str:
        return os.path.join(ckpt_dir, "megatron", f"rank_{self.rank:05d}.pt")

    def save(self, out_dir: str, trainer_state: Dict[str, Any]) -> None:
        """Every rank writes ``out_dir/megatron/rank_XXXXX.pt``; rank 0 adds ``trainer_state``."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        os.makedirs(os.path.join(out_dir, "megatron"), exist_ok=True)
        opts = []
        for o in self._inner_optimizers():
            main = [p.detach().cpu() for g in o.optimizer.param_groups for p in g["params"]]
            opts.append({"adam": o.optimizer.state_dict(), "main": main})
        state = {
            "layout": {"tp": self.parallel.tp, "pp": self.parallel.pp, "vpp": self.parallel.vpp,
                       "ep": self.parallel.ep, "world_size": self.world_size},
            "model": [p.detach().cpu() for p in self._params()],
            "optimizers": opts, "steps_done": self.steps_done, "ref": self.ref_state,
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if self.cuda else None,
            "tracker": get_cuda_rng_tracker().get_states() if self.cuda else None,
            "trainer_state": trainer_state,
        }
        torch.save(state, self._rank_file(out_dir))
        dist.barrier()

    def load(self, ckpt_dir: str) -> Dict[str, Any]:
        path = self._rank_file(ckpt_dir)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no megatron checkpoint for trainer rank {self.rank} (a resume needs the "
                                    "layout the checkpoint was saved with; to change it, start from its hf/ with "
                                    "model.path)")
        state = torch.load(path, map_location="cpu", weights_only=False)
        want = {"tp": self.parallel.tp, "pp": self.parallel.pp, "vpp": self.parallel.vpp, "ep": self.parallel.ep,
                "world_size": self.world_size}
        if state["layout"] != want:
            raise ValueError(f"{path}: saved with parallel layout {state['layout']}, this run has {want}; start from "
                             f"{os.path.join(ckpt_dir, 'hf')} with model.path instead")
        with torch.no_grad():
            for p, t in zip(self._params(), state["model"]):
                p.copy_(t)
            for o, s in zip(self._inner_optimizers(), state["optimizers"]):
                o.optimizer.load_state_dict(s["adam"])
                for p, t in zip([p for g in o.optimizer.param_groups for p in g["params"]], s["main"]):
                    p.copy_(t)
        if self.ref_state is not None and state.get("ref") is not None:
            for v, t in zip(self.ref_state, state["ref"]):
                v.copy_(t)
        self.steps_done = state["steps_done"]
        self._set_lr()
        torch.set_rng_state(state["rng"])
        if self.cuda and state.get("cuda_rng") is not None:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            torch.cuda.set_rng_state(state["cuda_rng"])
            get_cuda_rng_tracker().set_states(state["tracker"])
        return state["trainer_state"]


def _recompute_overrides(recompute: str) -> Dict[str, Any]:
    """``trainer.recompute`` as ``TransformerConfig`` fields (slime's --recompute-granularity)."""
    if recompute == "none":
        return {}
    if recompute == "selective":
        return {"recompute_granularity": "selective"}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    raise ValueError(f"trainer.recompute: {recompute!r} is not one of none, selective, full")
