"""The torch trainer backend (:class:`~slime_hydra.train.backend.TrainerBackend`): a Hugging Face causal LM,
AdamW, data parallel over the trainer ranks (DDP, or FSDP2 with ``trainer.strategy=fsdp``), LoRA through
PEFT with ``trainer.lora.rank``, the PPO critic (``critic.py``). On GPUs: float32 master weights, passes
under autocast in ``model.dtype``. Rank 0 pushes the weights and writes checkpoints (docs/backends.md).
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from slime_hydra.train import algorithms as A
from slime_hydra.train.backend import PolicyLossFn, StepResult, TrainerBackend, WarmUpShape
from slime_hydra.train.backends.torch import fsdp, lora as peft_lora
from slime_hydra.train.backends.torch.critic import Critic
from slime_hydra.train.backends.torch.offload import Offloader, data_parallel
from slime_hydra.train.batch import MicroBatch, make_micro_batch, response_log_probs
from slime_hydra.train.logprobs import fusable_head, fused_head
from slime_hydra.train.optim import accumulated_step, adamw, autocast, load_schedule, schedule

if TYPE_CHECKING:
    from slime_hydra.config.schema import AlgoConfig, ModelConfig, ParallelismConfig, TrainerConfig

# trainer.pt keys of the backend's own; the rest is the RL step's state given to save()
_OWN_STATE = ("optimizer", "scheduler", "ref", "rng", "master")


class TorchBackend(TrainerBackend):
    def __init__(self, *, model: ModelConfig, algo: AlgoConfig, trainer: TrainerConfig,
                 parallelism: Optional[ParallelismConfig] = None, model_path: str, rank: int, world_size: int,
                 device: torch.device):
        # parallelism: data parallel over all ranks is the only layout (validation refuses the others)
        self.algo, self.trainer_cfg = algo, trainer
        self.rank, self.world_size, self.device = rank, world_size, device
        self.compute_dtype = getattr(torch, model.dtype)
        self.fsdp = trainer.strategy == "fsdp"
        self.lora = trainer.lora if trainer.lora.rank else None
        # master weights: float32 on GPUs; LoRA's frozen base stays in model.dtype (its adapters are float32)
        dtype = torch.float32 if device.type == "cuda" and self.lora is None else self.compute_dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                          trust_remote_code=model.trust_remote_code)
        if trainer.gradient_checkpointing:  # non-reentrant for LoRA (frozen inputs) and FSDP2 (its hooks)
            kwargs = {"use_reentrant": False} if self.fsdp or self.lora is not None else None
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.model.config.use_cache = False
        if trainer.compile:  # the layers share their code: one compiled graph (and its backward) serves them all
            for layer in fsdp.decoder_layers(self.model):
                layer.compile(dynamic=True)
        if self.lora is not None:
            self.model = peft_lora.wrap(self.model, self.lora, model.arch.type)
        self.ref_model: Optional[torch.nn.Module] = None  # FSDP2's reference (KL): sharded like the policy
        if self.fsdp:  # each layer moves to the device as it is sharded
            self.net = fsdp.shard(self.model, device, self.compute_dtype, trainer.fsdp_cpu_offload)
            if A.needs_ref(algo) and self.lora is None:
                ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.compute_dtype,
                                                           trust_remote_code=model.trust_remote_code)
                ref.config.use_cache = False
                self.ref_model = fsdp.shard(ref, device, self.compute_dtype, trainer.fsdp_cpu_offload,
                                            trainable=False)
        else:
            self.net = self.model.to(device)
            if world_size > 1:
                self.net = data_parallel(self.model, device)
        self.opt = adamw([p for p in self.model.parameters() if p.requires_grad], algo, algo.lr)
        self.critic: Optional[Critic] = None
        if A.needs_critic(algo):
            self.critic = Critic(algo, model_path, dtype=dtype, compute_dtype=self.compute_dtype, device=device,
                                 world_size=world_size, gradient_checkpointing=trainer.gradient_checkpointing,
                                 trust_remote_code=model.trust_remote_code)
        self.set_num_rollout(trainer.num_rollout or 1)
        self.ref_state: Optional[Dict[str, torch.Tensor]] = None  # DDP's reference weights, by state-dict name
        if A.needs_ref(algo) and not self.fsdp and self.lora is None:  # LoRA's is the base: disable_adapter()
            self.ref_state = {k: v.detach().clone() for k, v in self._unique_state().items()}
        self.offloaders = [] if self.fsdp else \
            [Offloader(self.model, self.opt, device, extra=(self.ref_state or {}).values())]
        if self.critic is not None:
            self.offloaders.append(Offloader(self.critic.model, self.critic.opt, device))
        self.pad_id = self.model.config.pad_token_id or 0

    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def dp_size(self) -> int:
        return self.world_size

    @property
    def pushes_weights(self) -> bool:
        return self.rank == 0

    @property
    def reports_metrics(self) -> bool:
        return True  # every rank holds the whole model: its metrics, reduced over ranks, are complete

    def dp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            t = t.to(self.device)
            dist.all_reduce(t)
        return t.cpu()

    def set_num_rollout(self, num_rollout: int) -> None:
        steps = self.trainer_cfg.num_steps_per_rollout
        actor_steps = max(1, num_rollout - self.algo.num_critic_only_steps) * steps  # the actor waits for the critic
        self.sched = schedule(self.opt, self.algo, actor_steps)
        if self.critic is not None:
            self.critic.sched = schedule(self.critic.opt, self.algo, num_rollout * steps)

    def _unique_state(self) -> Dict[str, torch.Tensor]:
        """The state dict with each storage once (a tied LM head is the embedding: copied twice, a swap is undone)."""
        first: Dict[int, Tuple[str, torch.Tensor]] = {}
        for k, v in self.model.state_dict().items():
            first.setdefault(v.data_ptr(), (k, v))
        return dict(first.values())

    def _named_weights(self, on_device: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
        """Hugging Face names -> tensors in ``model.dtype``, cast one at a time (a push never holds a second
        copy of the model), each storage once (a tied LM head is the embedding, which the engines tie).
        ``on_device``: offloaded weights are cast on the device, not the host. FSDP2: each tensor is
        all-gathered as it comes, on every rank in the same order. LoRA: adapted weights come merged."""
        def full(t):
            if self.fsdp:
                return fsdp.full(t, self.device)
            return t.detach().to(self.device, non_blocking=True) if on_device else t.detach()

        if self.lora is not None:  # trainer.lora.push=merged; an adapter push would branch here
            named = peft_lora.merged_weights(self.model, fsdp.unique_state(peft_lora.hf_model(self.model)), full)
        elif self.fsdp:
            named = ((name, full(t)) for name, t in fsdp.unique_state(self.model))
        else:
            named = ((name, full(t)) for name, t in self._unique_state().items())
        for name, tensor in named:
            yield name, tensor.to(self.compute_dtype)

    def hf_weights(self, every_rank: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
        send = self.pushes_weights or every_rank
        if not send and not self.fsdp:
            return
        for name, tensor in self._named_weights(on_device=True):  # FSDP2: every rank takes part in the gathers
            if send:
                yield name, tensor

    def offload(self, keep_weights: bool = False) -> None:
        """Parameters and optimiser state (and the critic's) to pinned host buffers (FSDP2: its shards and
        AdamW state, unless ``trainer.fsdp_cpu_offload`` keeps them there). ``keep_weights``: the policy's
        parameters stay for the push (FSDP2: everything stays until the next ``offload()``)."""
        if self.fsdp:
            if keep_weights:
                return
            if self.device.type == "cuda" and not self.trainer_cfg.fsdp_cpu_offload:
                self.opt.zero_grad(set_to_none=True)
                fsdp.offload(self._fsdp_models(), [self.opt])
            return
        policy, *others = self.offloaders
        policy.offload(keep_weights=keep_weights)
        for o in others:  # the critic is not pushed: all of it goes at once
            o.offload()

    def onload(self) -> None:
        if self.fsdp:
            if self.device.type == "cuda" and not self.trainer_cfg.fsdp_cpu_offload:
                fsdp.onload(self._fsdp_models(), [self.opt], self.device)
            return
        moved = [o.onload() for o in self.offloaders]  # every one, in order
        if self.world_size > 1 and moved[0]:  # DDP's hooks stayed on the old gradient accumulators
            self.net = data_parallel(self.model, self.device, init_sync=False)
        if self.world_size > 1 and self.critic is not None and moved[-1]:
            self.critic.net = data_parallel(self.critic.model, self.device, init_sync=False)

    def _fsdp_models(self) -> List[torch.nn.Module]:
        return [self.model] + ([self.ref_model] if self.ref_model is not None else [])

    def micro_batches(self, data: Dict[str, list], rows: Sequence[int], response_len: int) -> List[MicroBatch]:
        size = self.trainer_cfg.micro_batch_size
        return [make_micro_batch(data, rows[s:s + size], response_len, self.pad_id).to(self.device)
                for s in range(0, len(rows), size)]

    @property
    def lr(self) -> float:
        return self.sched.get_last_lr()[0]

    def _forward(self, mb: MicroBatch, temperature: float, with_entropy: bool = False, reference: bool = False):
        """``reference``: DDP runs the policy's modules with the reference's weights, FSDP2 its sharded
        reference model, LoRA the policy without its adapters. No attention mask: rows are right-padded, so
        no real token sees a pad and SDPA takes its causal kernel. Positions 0..L-1 on every row, the pads'
        too: a restarting position reads to transformers as packing, which materialises a 4D mask."""
        inputs = {"input_ids": mb.input_ids}  # the model's own positions: arange(L) on each row
        entropy_grad, t = bool(self.algo.entropy_coef), self.trainer_cfg
        model = self.ref_model if reference and self.ref_model is not None else self.model
        head = fusable_head(model) if t.fused_logprobs else None
        fused = contextlib.nullcontext() if head is None else fused_head(
            head, mb.response_start, mb.response_ids, temperature, with_entropy, entropy_grad, fuse=t.compile)
        with autocast(self.device, self.compute_dtype), fused:
            if not reference:
                logits = self.net(**inputs).logits
            elif self.lora is not None:
                with self.model.disable_adapter():
                    logits = self.net(**inputs).logits
            elif self.ref_model is not None:
                logits = self.ref_model(**inputs).logits
            else:  # the tied LM head follows the embedding (tie_weights), buffers stay the model's
                logits = torch.func.functional_call(self.model, self.ref_state, (), inputs, strict=False).logits
        if head is not None:  # the head gave the response tokens' [B, T, 2] (log-prob, entropy), not logits
            entropy = logits[..., 1] if entropy_grad else logits[..., 1].detach()  # a metric only: no graph
            return logits[..., 0], (entropy if with_entropy else None)
        return response_log_probs(logits, mb, temperature, with_entropy, entropy_grad=entropy_grad)

    @torch.no_grad()
    def _log_probs(self, mbs: Sequence[MicroBatch], temperature: float, reference: bool = False) -> torch.Tensor:
        self.model.eval()
        # one copy to the host at the end, not a wait for the GPU after every micro-batch
        return torch.cat([self._forward(mb, temperature, reference=reference)[0].float() for mb in mbs]).cpu()

    def log_probs(self, mbs: Sequence[MicroBatch], temperature: float, *, reference: bool = False) -> torch.Tensor:
        if reference and self.ref_state is None and self.ref_model is None and self.lora is None:
            raise RuntimeError("reference log-probs asked for, but algo has neither kl_coef nor kl_loss_coef, "
                               "so the backend kept no reference weights")
        return self._log_probs(mbs, temperature, reference=reference)

    def train_step(self, mbs: Sequence[MicroBatch], temperature: float, loss_fn: PolicyLossFn) -> StepResult:
        def loss_of(mb: MicroBatch):
            log_probs, entropy = self._forward(mb, temperature, with_entropy=True)
            return loss_fn(mb.indices, log_probs, entropy)

        clip = (lambda params, max_norm: fsdp.clip_grad_norm(params, max_norm, self.device)) if self.fsdp else None
        return accumulated_step(self.net, self.model, self.opt, self.sched, mbs, loss_of, self.world_size,
                                self.algo.clip_grad, clip=clip, accumulate_unsynced=not self.fsdp)

    def warm_up(self, temperature: float, shape: WarmUpShape) -> None:
        """Dummy rows of the step's shape through the step's passes (no-grad log-probs, the reference's, forward
        and backward); no optimizer step, gradients dropped, the RNGs restored (LoRA's dropout draws)."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            mbs = self.warm_up_micro_batches(shape)
            self.log_probs(mbs, temperature)
            if A.needs_ref(self.algo):
                self.log_probs(mbs, temperature, reference=True)
            self.model.train()
            for mb in mbs:
                log_probs, entropy = self._forward(mb, temperature, with_entropy=True)
                loss = (log_probs * mb.loss_mask).sum() + (0 if entropy is None else (entropy * mb.loss_mask).sum())
                (0.0 * loss).backward()
        self.net.zero_grad(set_to_none=True)
        self.free_cache()

    def export_hf(self, out_dir: str, tokenizer_dir: Optional[str]) -> None:
        """Rank 0 writes ``out_dir`` (``model.dtype`` weights; loads with from_pretrained); FSDP2's other
        ranks take part in the gathers. LoRA: the merged weights, only with ``trainer.lora.save_merged``
        (else no ``hf/``: the checkpoint's ``adapter/`` on the base model is the policy)."""
        if (self.lora is not None and not self.lora.save_merged) or (self.rank != 0 and not self.fsdp):
            return
        weights = {name: t.cpu() for name, t in self._named_weights()}
        if self.rank != 0:
            return
        hf = peft_lora.hf_model(self.model) if self.lora is not None else self.model
        hf.save_pretrained(out_dir, state_dict=weights)
        if tokenizer_dir:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)

    def save(self, out_dir: str, trainer_state: Dict[str, Any]) -> None:
        """Rank 0 writes ``trainer.pt`` (optimiser, scheduler, reference, RNG, float32 master weights when
        ``hf/`` holds another dtype, ``trainer_state``) and ``critic.pt``; the weights are ``hf/``'s. FSDP2:
        every rank writes its shards of weights, AdamW state and reference to ``dcp/`` (reshardable), rank 0
        the rest to ``trainer.pt``. LoRA: ``adapter/`` (PEFT's format) holds what trains; the base is
        ``model.path``."""
        if self.lora is not None:
            # FSDP2: every rank gathers
            adapter = peft_lora.adapter_state(self.model, lambda t: fsdp.full(t, self.device) if self.fsdp else t)
            if self.rank == 0:
                self.model.save_pretrained(os.path.join(out_dir, peft_lora.ADAPTER_DIR), state_dict=adapter)
        own: Dict[str, Any] = {"scheduler": self.sched.state_dict(), **trainer_state, "rng": torch.get_rng_state()}
        if self.fsdp:
            fsdp.save(out_dir, self.model, self.opt, self.ref_model, trainable_only=self.lora is not None)
            if self.rank == 0:
                torch.save(own, os.path.join(out_dir, "trainer.pt"))
            return
        if self.rank != 0:
            return
        own["optimizer"] = self.opt.state_dict()
        if self.lora is None:
            master = self.compute_dtype != next(self.model.parameters()).dtype
            own.update(ref=self.ref_state, master=self.model.state_dict() if master else None)
        torch.save(own, os.path.join(out_dir, "trainer.pt"))
        if self.critic is not None:
            torch.save(self.critic.state_dict(), os.path.join(out_dir, "critic.pt"))

    def load(self, ckpt_dir: str) -> Dict[str, Any]:
        if self.fsdp:
            fsdp.load(ckpt_dir, self.model, self.opt, self.ref_model, trainable_only=self.lora is not None)
        elif self.lora is not None:
            self._load_adapter(ckpt_dir)
        else:
            self._load_hf(ckpt_dir)
        state = torch.load(os.path.join(ckpt_dir, "trainer.pt"), map_location="cpu", weights_only=False)
        if "optimizer" in state and not self.fsdp:
            self.opt.load_state_dict(state["optimizer"])
        load_schedule(self.sched, state["scheduler"])  # after the optimiser: this run's schedule sets the rate
        if state.get("master") is not None:  # the float32 weights, not their bfloat16 copy in hf/
            self.model.load_state_dict(state["master"])
        if self.critic is not None:
            path = os.path.join(ckpt_dir, "critic.pt")
            if not os.path.exists(path):
                raise FileNotFoundError(f"{ckpt_dir} has no critic.pt: it was not saved by a run with a critic "
                                        "(advantage_estimator=ppo); start a new run from its hf/ with model.path "
                                        "instead")
            self.critic.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
        if self.ref_state is not None and state.get("ref") is not None:
            for k, v in self.ref_state.items():
                v.copy_(state["ref"][k])
        torch.set_rng_state(state["rng"])
        return {k: v for k, v in state.items() if k not in _OWN_STATE}

    def _load_hf(self, ckpt_dir: str) -> None:
        from safetensors.torch import load_file

        hf = os.path.join(ckpt_dir, "hf")
        if not os.path.isdir(hf):
            what = "with LoRA (it has adapter/)" if os.path.isdir(os.path.join(ckpt_dir, peft_lora.ADAPTER_DIR)) \
                else "by this backend"
            raise FileNotFoundError(f"{ckpt_dir} has no hf/: it was saved {what}; resume it with the settings it was "
                                    "saved with (trainer.lora.*, trainer.strategy)")
        weights = {k: v for f in sorted(os.listdir(hf)) if f.endswith(".safetensors")
                   for k, v in load_file(os.path.join(hf, f)).items()}
        missing, _ = self.model.load_state_dict(weights, strict=False)
        if [k for k in missing if k in dict(self.model.named_parameters())]:
            raise RuntimeError(f"checkpoint {hf} lacks parameters {missing[:5]}")
        self.model.tie_weights()

    def _load_adapter(self, ckpt_dir: str) -> None:
        path = os.path.join(ckpt_dir, peft_lora.ADAPTER_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{ckpt_dir} has no {peft_lora.ADAPTER_DIR}/: it was not saved with LoRA "
                                    "(trainer.lora.rank > 0); resume it with the settings it was saved with")
        adapter = peft_lora.load_adapter_state(ckpt_dir)
        expected = {k for k in self.model.state_dict() if ".lora_" in k}
        if set(adapter) != expected:
            raise RuntimeError(f"{path} does not match this run's adapters (trainer.lora.rank / target_modules): "
                               f"{len(set(adapter) - expected)} unknown, {len(expected - set(adapter))} missing, e.g. "
                               f"{sorted(set(adapter) ^ expected)[:3]}")
        self.model.load_state_dict(adapter, strict=False)
