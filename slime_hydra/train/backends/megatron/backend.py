"""The megatron-core trainer backend: ``GPTModel`` chunks from the checkpoint's Hugging Face config, tensor /
pipeline (virtual stages too) / expert parallel, megatron's DDP and distributed optimizer (Adam, float32 main
weights), packed micro-batches by token budget. Global rank 0 pushes the weights; TP rank 0 of the last
pipeline stage reports metrics (the loss runs on the last stage only).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from slime_hydra.train import algorithms as A
from slime_hydra.train.backend import PolicyLossFn, StepResult, TrainerBackend, WarmUpShape
from slime_hydra.train.backends.megatron import checkpoint
from slime_hydra.train.backends.megatron.model import inner_optimizers, parameters
from slime_hydra.train.backends.megatron.packing import PackedMicroBatch, contiguous_budget_groups, pack
from slime_hydra.train.backends.megatron.weights import DEFAULT_BUCKET_BYTES
from slime_hydra.train.optim import lr_lambda, read_metrics

if TYPE_CHECKING:
    from slime_hydra.config.schema import AlgoConfig, ModelConfig, ParallelismConfig, TrainerConfig


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

        from slime_hydra.train.backends.megatron.convert import Layout
        from slime_hydra.train.backends.megatron.model import (
            Parallel,
            build_chunks,
            recompute_overrides,
            transformer_config,
            use_fused_adam,
        )
        from slime_hydra.train.backends.megatron.offload import Offload
        from slime_hydra.train.backends.megatron.weights import load_hf_weights
        from slime_hydra.train.backends.torch.fsdp import ensure_process_group

        self.algo, self.trainer_cfg, self.model_cfg, self.model_path = algo, trainer, model, model_path
        self.rank, self.world_size, self.device = rank, world_size, device
        self.cuda = device.type == "cuda"
        self.dtype = getattr(torch, model.dtype)
        ensure_process_group(device)  # the actor makes a group only for several ranks; megatron needs one
        p = parallelism
        self.parallel = Parallel(tp=p.tensor_parallel, pp=p.pipeline_parallel, vpp=p.virtual_pipeline_parallel,
                                 cp=p.context_parallel, ep=p.expert_parallel, etp=p.expert_tensor_parallel,
                                 sequence_parallel=p.sequence_parallel)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor_parallel, pipeline_model_parallel_size=p.pipeline_parallel,
            virtual_pipeline_model_parallel_size=p.virtual_pipeline_parallel, context_parallel_size=p.context_parallel,
            expert_model_parallel_size=p.expert_parallel, expert_tensor_parallel_size=p.expert_tensor_parallel)
        if self.cuda:
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(torch.initial_seed() - rank)  # the actor seeded seed + rank
        self.hf = AutoConfig.from_pretrained(model_path, trust_remote_code=model.trust_remote_code)
        overrides = recompute_overrides(trainer.recompute)
        if not self.cuda:  # torch.compile'd fusions only cost compile time on CPU
            overrides.update(bias_activation_fusion=False, bias_dropout_fusion=False)
        overrides.update(trainer.megatron or {})
        self.config = transformer_config(self.hf, self.parallel, dtype=self.dtype, overrides=overrides,
                                         cpu_init=not self.cuda)
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        chunks, self.shards = build_chunks(self.hf, self.config, device, compile=bool(trainer.compile))
        self.layout = Layout.from_hf(self.hf, tp=p.tensor_parallel)
        load_hf_weights(chunks, model_path, self.layout, self.shards)

        # loss scaling: the schedule divides each micro-batch's loss by the number of micro-batches and DDP
        # averages over the data-parallel group, so accumulate_grads multiplies each share by both
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=trainer.use_distributed_optimizer)
        self.chunks = [DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=c,
                                               disable_bucketing=len(chunks) > 1 and i > 0)
                       for i, c in enumerate(chunks)]
        self.config.finalize_model_grads_func = finalize_model_grads
        self.opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=algo.lr, min_lr=algo.min_lr, weight_decay=algo.weight_decay,
            adam_beta1=algo.adam_beta1, adam_beta2=algo.adam_beta2, adam_eps=algo.adam_eps,
            clip_grad=algo.clip_grad, bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16,
            params_dtype=self.dtype, use_distributed_optimizer=trainer.use_distributed_optimizer,
            main_params_dtype=torch.float32, main_grads_dtype=torch.float32), self.chunks)
        use_fused_adam(self.opt)
        if self.dtype in (torch.bfloat16, torch.float16):
            self.config.grad_scale_func = self.opt.scale_loss
        self.steps_done = 0
        self.set_num_rollout(trainer.num_rollout or 1)

        self.tp_group = ps.get_tensor_model_parallel_group() if p.tensor_parallel > 1 else None
        self.pp_group = ps.get_pipeline_model_parallel_group() if p.pipeline_parallel > 1 else None
        self.ep_group = ps.get_expert_model_parallel_group() if p.expert_parallel > 1 else None
        etp_group = ps.get_expert_tensor_parallel_group()
        self.etp_group = etp_group if etp_group is not None and dist.get_world_size(etp_group) > 1 else None
        self.dp_group = ps.get_data_parallel_group()
        self._dp_rank, self._dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.is_last_stage = self.pp_rank == p.pipeline_parallel - 1
        self.pp_last_global = dist.get_global_rank(self.pp_group, p.pipeline_parallel - 1) if self.pp_group else rank
        self.pad_id = getattr(self.hf, "pad_token_id", None) or 0

        self.critic = None  # PPO's critic: not with megatron (the RL step refuses advantage_estimator=ppo)
        # the reference model: a pinned host copy of this rank's shards, swapped in through a staging copy
        self.ref_state = self._cpu_copy() if A.needs_ref(algo) else None
        self._backup = self._cpu_copy() if A.needs_ref(algo) else None
        self.offloader = Offload(self.chunks, self.opt, device, trainer.use_distributed_optimizer)

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

    def _params(self) -> List[torch.Tensor]:
        return parameters(self.chunks)

    def _inner_optimizers(self):
        return inner_optimizers(self.opt)

    def _cpu_copy(self) -> List[torch.Tensor]:
        return [torch.empty(p.shape, dtype=p.dtype, pin_memory=self.cuda).copy_(p.detach()) for p in self._params()]

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
        if self.offloader.weights and any(g is not None for g in (self.tp_group, self.pp_group, self.ep_group)):
            # offloaded weights are on the host; the gathers run over NCCL: bring this rank's shards back
            chunks = [({k: v.to(self.device) if torch.is_tensor(v) else v for k, v in st.items()}, sh)
                      for st, sh in chunks]
        for bucket in export_hf_weights(chunks, self.layout, bucket_bytes=DEFAULT_BUCKET_BYTES,
                                        tp_group=self.tp_group, pp_group=self.pp_group, ep_group=self.ep_group,
                                        etp_group=self.etp_group):
            if self.pushes_weights or every_rank:
                for name, t in bucket:
                    yield name, t.to(self.dtype)

    def offload(self, keep_weights: bool = False) -> None:
        """Gradients freed, optimizer state and then (unless ``keep_weights``) the weights to the host."""
        if self.cuda:
            self.offloader.offload(keep_weights)

    def onload(self) -> None:
        if self.cuda:
            self.offloader.onload()

    def micro_batches(self, data: Dict[str, list], rows: Sequence[int], response_len: int) -> List[PackedMicroBatch]:
        t = self.trainer_cfg
        lengths = [len(data["tokens"][i]) for i in rows]
        groups = contiguous_budget_groups(lengths, t.max_tokens_per_micro_batch,
                                          t.micro_batch_size if t.max_tokens_per_micro_batch is None else len(rows))
        multiple = self.parallel.tp if self.parallel.sequence_parallel else 1
        return [PackedMicroBatch(pack(data["tokens"], data["response_lengths"], [rows[j] for j in g],
                                      data.get("loss_masks"), multiple, self.pad_id).to(self.device), response_len)
                for g in groups]

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

        one = len(self.chunks) == 1
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs) if one else [iter(mbs) for _ in self.chunks],
            model=self.chunks[0] if one else self.chunks, num_microbatches=len(mbs),
            seq_length=max(mb.packed.num_tokens for mb in mbs), micro_batch_size=1, forward_only=forward_only)

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
        """Zeroed gradients, then forward and backward over ``mbs`` into DDP's ``main_grad``; returns the loss
        function's metrics summed over this rank's micro-batches (empty off the last pipeline stage)."""
        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()
        self.opt.zero_grad()
        scale = len(mbs) * self._dp_size  # undo the schedule's 1 / micro-batches and DDP's 1 / DP

        def loss_of(mb, lp, ent):
            loss, metrics = loss_fn(mb.indices, lp, ent)
            return loss * scale, {k: v.detach() for k, v in metrics.items()}

        return read_metrics(self._forward_backward(mbs, temperature, loss_of, forward_only=False) or [])

    def warm_up(self, temperature: float, shape: WarmUpShape) -> None:
        """Dummy rows of the step's shape through megatron's schedule as a step runs them (the no-grad pass,
        then forward and backward); no optimizer step, gradients zeroed, the RNGs (megatron's tracker too) restored."""
        rng = checkpoint.rng_state(self.cuda)
        mbs = self.warm_up_micro_batches(shape)
        self._log_probs(mbs, temperature)  # the step's no-grad pass (eval mode; the reference's is the same pass)
        self.accumulate_grads(mbs, temperature, lambda rows, lp, ent: (0.0 * lp.sum(), {}))
        for c in self.chunks:
            c.zero_grad_buffer()
        self.opt.zero_grad()
        checkpoint.set_rng_state(rng, self.cuda)
        self.free_cache()

    def train_step(self, mbs: Sequence[PackedMicroBatch], temperature: float, loss_fn: PolicyLossFn) -> StepResult:
        metrics = self.accumulate_grads(mbs, temperature, loss_fn)
        _, grad_norm, _ = self.opt.step()  # clips to algo.clip_grad; the norm is over all model-parallel ranks
        self.steps_done += 1
        self._set_lr()
        return StepResult(grad_norm=float(grad_norm or 0.0), metrics=metrics)

    def export_hf(self, out_dir: str, tokenizer_dir: Optional[str]) -> None:
        """Every rank gathers; global rank 0 writes safetensors shards, the config and the tokenizer."""
        checkpoint.write_hf(self.hf_weights(), out_dir, writes=self.pushes_weights, hf_config=self.hf,
                            model_path=self.model_path, tokenizer_dir=tokenizer_dir)

    def save(self, out_dir: str, trainer_state: Dict[str, Any]) -> None:
        """Every rank writes its shards of ``out_dir/megatron`` (a dist_checkpointing checkpoint)."""
        checkpoint.save(self, out_dir, trainer_state)

    def load(self, ckpt_dir: str) -> Dict[str, Any]:
        """Restore ``ckpt_dir/megatron`` into this run's layout, whichever layout saved it."""
        state = checkpoint.load(self, ckpt_dir)
        self._set_lr()
        return state
