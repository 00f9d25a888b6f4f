"""The trainer-backend interface: what the backend-neutral RL step (:mod:`slime_hydra.train.trainer`) needs
from a training engine, and :data:`BACKENDS`, the registry ``trainer.backend`` names. The contract
(response-aligned tensors, loss shares, who reports and who writes) is in docs/backends.md.
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
    """A backend's micro-batch as the RL step sees it: the rows it holds, in the order of its tensors."""

    indices: List[int]


# (rows, log_probs [b, T], entropy [b, T]) -> (the micro-batch's share of the step loss, metrics);
# metrics are 0-dim tensors, summed over the step's micro-batches by the backend
PolicyLossFn = Callable[[Sequence[int], "Tensor", "Tensor"], Tuple["Tensor", Dict[str, "Tensor"]]]
# (rows, values [b, T]) -> (share of the step loss, metrics)
ValueLossFn = Callable[[Sequence[int], "Tensor"], Tuple["Tensor", Dict[str, "Tensor"]]]


@dataclass
class StepResult:
    """One optimiser step: the gradient norm before clipping, the loss's metrics summed over the micro-batches."""

    grad_norm: float
    metrics: Dict[str, float]


class CriticBackend(ABC):
    """A trained value model (PPO), laid out over ranks like the policy; optional."""

    @property
    @abstractmethod
    def lr(self) -> float:
        """The learning rate the next critic step uses."""

    @abstractmethod
    def values(self, mbs: Sequence[MicroBatch]) -> "Tensor":
        """``[N, T]`` float32 on CPU, response-aligned, rows in the order of ``mbs``; no gradient."""

    @abstractmethod
    def train_step(self, mbs: Sequence[MicroBatch], loss_fn: ValueLossFn) -> StepResult:
        """One optimiser step of ``loss_fn`` over the step's micro-batches."""


@dataclass(frozen=True)
class WarmUpShape:
    """A rank's largest step: ``samples`` rows of ``length`` tokens, the last ``response_len`` of each the response."""

    samples: int
    length: int
    response_len: int


def warm_up_rows(shape: WarmUpShape) -> Dict[str, list]:
    """Dummy rollout rows of ``shape`` for a warm-up pass. The step's own shape, not short rows: inductor
    specialises a compiled graph to the range of sizes it saw, so short rows would compile again in step 1."""
    return {"tokens": [[1] * shape.length] * shape.samples, "response_lengths": [shape.response_len] * shape.samples,
            "loss_masks": [None] * shape.samples}


class TrainerBackend(ABC):
    """One trainer rank's training engine, built on every rank as ``cls(model=, algo=, trainer=,
    parallelism=, model_path=, rank=, world_size=, device=)`` (``model_path``: the initial HF checkpoint).
    Every method is called on every rank (many are collectives) unless said otherwise."""

    #: the PPO critic when the algorithm trains one and the backend supports it, else None
    critic: Optional[CriticBackend] = None

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

    @abstractmethod
    def micro_batches(self, data: Dict[str, list], rows: Sequence[int], response_len: int) -> List[MicroBatch]:
        """``rows`` of ``data`` (:data:`slime_hydra.train.batch.TRAIN_KEYS`), in order, as micro-batches,
        responses padded to ``response_len``; built once per optimiser step."""

    @property
    @abstractmethod
    def lr(self) -> float:
        """The learning rate the next policy step uses."""

    @abstractmethod
    def log_probs(self, mbs: Sequence[MicroBatch], temperature: float, *, reference: bool = False) -> "Tensor":
        """Log-probs of the response tokens under ``softmax(logits / temperature)``, ``[N, T]`` float32
        on CPU, rows in the order of ``mbs``, no gradient; with ``reference``, the reference model's."""

    @abstractmethod
    def train_step(self, mbs: Sequence[MicroBatch], temperature: float, loss_fn: PolicyLossFn) -> StepResult:
        """One optimiser step: each micro-batch's log-probs and entropies (with gradient) go to ``loss_fn``;
        then backward, clipping to ``algo.clip_grad``, the optimiser and LR schedule step."""

    @abstractmethod
    def set_num_rollout(self, num_rollout: int) -> None:
        """Size the LR schedule(s) for a run of ``num_rollout`` rollouts; called before the first step."""

    @abstractmethod
    def hf_weights(self, every_rank: bool = False) -> Iterator[Tuple[str, "torch.Tensor"]]:
        """The full weights in Hugging Face names and ``model.dtype``, one tensor at a time, on the rank that
        pushes them; the other ranks iterate too (gathers) and get nothing, unless ``every_rank`` (CUDA IPC
        to engines spanning several GPUs). Tied weights come once, under the checkpoint's name."""

    @abstractmethod
    def offload(self, keep_weights: bool = False) -> None:
        """Free the accelerator memory (weights, optimiser state) while colocated engines generate.
        ``keep_weights``: only the optimiser state and gradients, so the push reads the weights on the
        accelerator (``parallelism.push_before_offload``); a later ``offload()`` moves the weights."""

    @abstractmethod
    def onload(self) -> None:
        """Undo :meth:`offload`."""

    def warm_up(self, temperature: float, shape: "WarmUpShape") -> None:
        """A training step's passes on dummy rows of the step's shape (:func:`warm_up_rows`), leaving weights,
        gradients and optimizer as they were (``trainer.warm_up``): one-off costs paid while the engines start."""
        return None

    def warm_up_micro_batches(self, shape: "WarmUpShape") -> list:
        """The micro-batches a warm-up needs: the rows are alike, so the first and a smaller last one, if any."""
        mbs = self.micro_batches(warm_up_rows(shape), list(range(shape.samples)), shape.response_len)
        return mbs[:1] + mbs[1:][-1:]

    def free_cache(self) -> None:
        """Give the memory training freed (cached by torch's allocator) back for colocated engines' KV cache."""
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    @abstractmethod
    def export_hf(self, out_dir: str, tokenizer_dir: Optional[str]) -> None:
        """Write the policy as a Hugging Face checkpoint to ``out_dir``, with the tokenizer of ``tokenizer_dir``."""

    @abstractmethod
    def save(self, out_dir: str, trainer_state: Dict[str, Any]) -> None:
        """Write what resuming needs into ``out_dir`` (optimiser, schedules, reference, RNG, ``trainer_state``);
        :meth:`export_hf` has just written ``out_dir/hf``, which a backend may use as its weights."""

    @abstractmethod
    def load(self, ckpt_dir: str) -> Dict[str, Any]:
        """Restore a :meth:`save`d checkpoint; returns the ``trainer_state`` given to :meth:`save`."""
