"""The trainer backend: what the backend-neutral RL step (:mod:`slime_hydra.train.trainer`) needs from
a training engine, and the registry that ``trainer.backend`` names.

A backend owns one trainer rank's share of the model and everything that depends on how the model
is laid out over ranks: the forward/backward passes, the optimiser, the reference weights, memory
offload, checkpoints and gathering the weights for the engines. It knows nothing of advantages or
losses: the RL step hands it a loss function (verl's ``forward_backward_batch(data, loss_function)``)
and reads back log-probs, values and metrics. The torch backend is data parallel only; a tensor- or
pipeline-parallel backend (Megatron-core) implements the same methods:

- Data: every rank of one data-parallel rank's model-parallel group gets the same rows (the trainer
  group routes them by :attr:`TrainerBackend.dp_rank`); :meth:`~TrainerBackend.micro_batches` packs
  them however the backend likes (padded here, packed sequences in Megatron).
- Per-token tensors crossing the interface are *response-aligned*: ``[rows, T]`` float32, row ``i``
  holding response token ``t`` of sample ``i`` at column ``t``, zero-padded to ``T``, the longest
  response of the rollout. A vocabulary-parallel backend computes the log-probs of its vocabulary
  shard and reduces them over the tensor-parallel group; a pipeline-parallel backend broadcasts them
  from its last stage, so that every rank returns the same tensors.
- Loss functions return the micro-batch's *share of the step loss*: the shares of all micro-batches
  of all data-parallel ranks add up to the step loss (the RL step's reducer divides by step-wide
  totals). The backend makes its gradient the gradient of that sum (DDP averages over ranks, so the
  torch backend multiplies each share by the data-parallel size before ``backward``).
- A pipeline-parallel backend calls the loss function on its last stage only; the metrics of
  :meth:`~TrainerBackend.train_step` are then those of the ranks whose :attr:`~TrainerBackend.reports_metrics`
  is true, which is where the driver reads them.
- The reference model lives in the backend (``log_probs(..., reference=True)``): how its weights are
  kept and swapped in depends on how they are sharded. The PPO critic is an optional capability
  (:class:`CriticBackend`, ``backend.critic``) with the same shape as the policy: values out, one
  optimiser step per value-loss function in.
- The backend decides which rank sends weights to the engines and what each rank writes in a
  checkpoint; the Ray actor asks (:attr:`~TrainerBackend.pushes_weights`) instead of assuming rank 0.

Adding a backend: a folder ``slime_hydra/train/backends/<name>/`` with a :class:`TrainerBackend`
subclass, one line in :data:`BACKENDS`, and ``conf/trainer/<name>.yaml``. The registry holds import
strings so that config validation and ``dry_run=true`` can list the names without importing torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

from slime_hydra.utils.registry import LazyRegistry

if TYPE_CHECKING:
    import torch
    from torch import Tensor

# trainer.backend -> its TrainerBackend class, imported only when a trainer rank starts
BACKENDS = LazyRegistry("trainer backend", {
    "torch": "slime_hydra.train.backends.torch.backend:TorchBackend",
    "megatron": "slime_hydra.train.backends.megatron.backend:MegatronBackend",
})


class MicroBatch(Protocol):
    """What the RL step sees of a backend's micro-batch: which rows of the rank's rollout data it holds,
    in the order of the rows of the tensors the backend returns for it."""

    indices: List[int]


# (rows, log_probs [b, T], entropy [b, T]) -> (the micro-batch's share of the step loss, metrics);
# metrics are 0-dim tensors, summed over the step's micro-batches by the backend
PolicyLossFn = Callable[[Sequence[int], "Tensor", "Tensor"], Tuple["Tensor", Dict[str, "Tensor"]]]
# (rows, values [b, T]) -> (share of the step loss, metrics)
ValueLossFn = Callable[[Sequence[int], "Tensor"], Tuple["Tensor", Dict[str, "Tensor"]]]


@dataclass
class StepResult:
    """One optimiser step: the gradient norm before clipping (the same on every rank) and the loss
    function's metrics summed over this rank's micro-batches (empty where no loss was computed)."""

    grad_norm: float
    metrics: Dict[str, float]


class CriticBackend(ABC):
    """A trained value model (PPO), laid out over ranks like the policy. Optional: a backend without
    one sets :attr:`TrainerBackend.critic` to None and the RL step refuses ``advantage_estimator=ppo``."""

    @property
    @abstractmethod
    def lr(self) -> float:
        """The learning rate the next critic step uses."""

    @abstractmethod
    def values(self, mbs: Sequence[MicroBatch]) -> "Tensor":
        """``[N, T]`` float32 on CPU, response-aligned, rows in the order of ``mbs``; zero after each
        response. No gradient."""

    @abstractmethod
    def train_step(self, mbs: Sequence[MicroBatch], loss_fn: ValueLossFn) -> StepResult:
        """One optimiser step of ``loss_fn`` over the step's micro-batches (forward, backward, clip, step)."""


@dataclass(frozen=True)
class WarmUpShape:
    """What a rank's training step holds at most (``trainer.warm_up``): ``samples`` rows of ``length`` tokens, the
    last ``response_len`` of each the response. The driver takes it from the config (the rank's share of a step;
    ``rollout.max_prompt_len + max_response_len`` tokens, as the memory plan counts them)."""

    samples: int
    length: int
    response_len: int


def warm_up_rows(shape: WarmUpShape) -> Dict[str, list]:
    """Dummy rollout rows of ``shape`` for a warm-up pass. The step's own shape, not two short rows: with
    ``trainer.compile``, inductor specialises a graph to the range of sizes it was compiled for (32-bit indexing
    and fusion decisions, guarded), so a graph compiled on short rows compiled again in step 1 on an H200 (14.2 s,
    and 40.7 s for megatron); its memory is the step's, which the plan counts beside the engines."""
    return {"tokens": [[1] * shape.length] * shape.samples, "response_lengths": [shape.response_len] * shape.samples,
            "loss_masks": [None] * shape.samples}


class TrainerBackend(ABC):
    """One trainer rank's training engine.

    Constructed on every rank, after ``torch.distributed`` is initialised over all trainer ranks, as
    ``cls(model=ModelConfig, algo=AlgoConfig, trainer=TrainerConfig, parallelism=ParallelismConfig,
    model_path=str, rank=int, world_size=int, device=torch.device)``; ``model_path`` is the initial
    Hugging Face checkpoint. Every method is called on every rank (many are collectives), unless
    said otherwise.
    """

    #: the PPO critic when the algorithm trains one and the backend supports it, else None
    critic: Optional[CriticBackend] = None

    # ---------------------------------------------------------------------------- layout
    @property
    @abstractmethod
    def dp_rank(self) -> int:
        """This rank's data-parallel rank: which share of the rollout it trains on."""

    @property
    @abstractmethod
    def dp_size(self) -> int:
        """The number of data-parallel ranks (trainer ranks / model-parallel size)."""

    @property
    @abstractmethod
    def pushes_weights(self) -> bool:
        """Whether this rank sends the weights to the engines (exactly one rank does)."""

    @property
    @abstractmethod
    def reports_metrics(self) -> bool:
        """Whether this rank's training metrics are complete (e.g. a last pipeline stage's)."""

    @abstractmethod
    def dp_all_reduce(self, t: "Tensor") -> "Tensor":
        """The sum of ``t`` (a CPU tensor) over the data-parallel group, on CPU."""

    # ------------------------------------------------------------------------------- data
    @abstractmethod
    def micro_batches(self, data: Dict[str, list], rows: Sequence[int], response_len: int) -> List[MicroBatch]:
        """``rows`` of ``data`` (the rank's rollout data, :data:`slime_hydra.train.batch.TRAIN_KEYS`),
        in order, as micro-batches of ``trainer.micro_batch_size`` samples, responses padded to
        ``response_len``. Built once per optimiser step and passed back to the methods below."""

    # ----------------------------------------------------------------------------- policy
    @property
    @abstractmethod
    def lr(self) -> float:
        """The learning rate the next policy step uses."""

    @abstractmethod
    def log_probs(self, mbs: Sequence[MicroBatch], temperature: float, *, reference: bool = False) -> "Tensor":
        """Log-probs of the response tokens under ``softmax(logits / temperature)``, ``[N, T]`` float32
        on CPU, rows in the order of ``mbs``, no gradient; with ``reference``, the reference model's
        (the initial weights, kept when ``algo`` needs them)."""

    @abstractmethod
    def train_step(self, mbs: Sequence[MicroBatch], temperature: float, loss_fn: PolicyLossFn) -> StepResult:
        """One optimiser step: for each micro-batch, the log-probs and entropies (with gradient) go to
        ``loss_fn``; then backward, gradient clipping to ``algo.clip_grad``, the optimiser and LR
        schedule step."""

    @abstractmethod
    def set_num_rollout(self, num_rollout: int) -> None:
        """Size the LR schedule(s) for a run of ``num_rollout`` rollouts; called before the first step."""

    # ---------------------------------------------------------------------------- weights
    @abstractmethod
    def hf_weights(self, every_rank: bool = False) -> Iterator[Tuple[str, "torch.Tensor"]]:
        """The full, unsharded weights in Hugging Face names and ``model.dtype``, one tensor at a
        time, on the rank that pushes them; ranks that do not push iterate it too (a sharded backend
        gathers as it goes) and get nothing, unless ``every_rank`` (CUDA IPC to colocated engines that
        span several GPUs: each rank hands over a copy on its own GPU). Tied weights come once, under
        the name a checkpoint stores (``model.embed_tokens.weight``, not ``lm_head.weight``)."""

    @abstractmethod
    def offload(self, keep_weights: bool = False) -> None:
        """Free the accelerator memory (weights, optimiser state) while colocated engines generate.
        ``keep_weights``: only the optimiser state (and the gradients, freed), so that the weight push
        reads the weights on the accelerator (``parallelism.push_before_offload``); a later ``offload()``
        moves the weights too."""

    @abstractmethod
    def onload(self) -> None:
        """Undo :meth:`offload`."""

    def warm_up(self, temperature: float, shape: "WarmUpShape") -> None:
        """A training step's passes on dummy rows of the step's own shape (:func:`warm_up_rows`), leaving
        weights, gradients and optimizer as they were (``trainer.warm_up``): the first step's one-off costs,
        paid while the engines start. A backend without one-off costs worth moving keeps this default, which
        does nothing."""
        return None

    def warm_up_micro_batches(self, shape: "WarmUpShape") -> list:
        """The micro-batches of a step of ``shape`` that a warm-up needs: the rows are alike, so the first one
        and a smaller last one, if any."""
        mbs = self.micro_batches(warm_up_rows(shape), list(range(shape.samples)), shape.response_len)
        return mbs[:1] + mbs[1:][-1:]

    def free_cache(self) -> None:
        """Give the GPU memory that training freed (activations, kept by torch's caching allocator)
        back to the driver: colocated engines take it for their KV cache while this trainer stays."""
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------ checkpoints
    @abstractmethod
    def export_hf(self, out_dir: str, tokenizer_dir: Optional[str]) -> None:
        """Write a Hugging Face checkpoint (``from_pretrained`` loads it) of the policy to ``out_dir``,
        with the tokenizer of ``tokenizer_dir``."""

    @abstractmethod
    def save(self, out_dir: str, trainer_state: Dict[str, Any]) -> None:
        """Write what resuming needs into ``out_dir`` (optimiser, schedules, reference weights, RNG, and
        ``trainer_state``, the RL step's counters). :meth:`export_hf` has written ``out_dir/hf``
        just before, which a backend may use as its weights."""

    @abstractmethod
    def load(self, ckpt_dir: str) -> Dict[str, Any]:
        """Restore a :meth:`save`d checkpoint; returns the ``trainer_state`` given to :meth:`save`."""
