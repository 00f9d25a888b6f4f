"""``Sample``: one prompt and one response, everything the rollout side knows about it (the data source
makes samples, the rewards score them, the rollout fills them in). Field names follow slime's ``Sample``;
``tokens`` is prompt + response, ``loss_mask`` and ``rollout_log_probs`` cover the response only.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional, Union


class Status(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # stopped on EOS or a stop string
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # cut off (abort_request); may be resumed with partial rollout
    FAILED = "failed"


# the finish reasons SGLang's /generate (and the embedded engine) answers with
FINISH_TO_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


class FinishReasonError(ValueError):
    """An engine answer without one of SGLang's finish reasons: a protocol change, raised, not counted."""


@dataclass
class Sample:
    prompt: Union[str, List[Dict[str, Any]]] = ""
    label: Any = None
    group_index: int = 0
    index: int = 0
    tokens: List[int] = field(default_factory=list)  # prompt + response
    response: str = ""
    response_length: int = 0
    loss_mask: Optional[List[int]] = None  # per response token; None: all ones
    rollout_log_probs: Optional[List[float]] = None  # per response token
    reward: Optional[Union[float, Dict[str, Any]]] = None
    status: Status = Status.PENDING
    metadata: Dict[str, Any] = field(default_factory=dict)  # rm_type, tools, source, ...
    weight_versions: List[str] = field(default_factory=list)
    remove_sample: bool = False  # keep for group statistics but exclude from the loss

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def append_response(self, tokens: List[int], log_probs: Optional[List[float]] = None, trainable: bool = True,
                        text: str = "") -> None:
        """Append model tokens (trainable, with log-probs) or tool / environment tokens (masked, log-prob 0)."""
        if trainable and log_probs is None:
            raise ValueError("model tokens need their log-probs")
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(log_probs)} log-probs")
        self.tokens.extend(tokens)
        self.response += text
        self.response_length += len(tokens)
        if self.loss_mask is None:
            self.loss_mask = [1] * (self.response_length - len(tokens))
        self.loss_mask.extend([1 if trainable else 0] * len(tokens))
        if self.rollout_log_probs is None:
            self.rollout_log_probs = []
        self.rollout_log_probs.extend(log_probs if trainable else [0.0] * len(tokens))

    def identity(self) -> str:
        """Which sample this is, for error messages: its group and index and the prompt's start."""
        p: Any = self.prompt
        if isinstance(p, list) and p and isinstance(p[-1], dict):  # chat messages: the last one
            p = p[-1].get("content", "")
        text = " ".join(str(p).split())
        return f"group {self.group_index}, sample {self.index}, prompt {text[:60] + '...' * (len(text) > 60)!r}"

    def reward_value(self, key: Optional[str] = None) -> float:
        """The scalar reward (``key`` picks it from a dict reward); a sample without one raises."""
        r = self.reward
        if isinstance(r, dict):
            if key is None:
                raise ValueError(f"{self.identity()}: the reward is a dict {sorted(r)}; set reward.key to pick one")
            if key not in r:
                raise ValueError(f"{self.identity()}: reward.key={key!r} is not in its reward {sorted(r)}")
            r = r[key]
        if r is None:
            raise ValueError(f"{self.identity()}: has no reward (status {self.status.value}); a generate function "
                             "that sets sample.reward must set a number")
        try:
            return float(r)
        except (TypeError, ValueError):
            raise ValueError(f"{self.identity()}: its reward {r!r} is not a number") from None

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Sample":
        names = {f.name for f in fields(cls)}
        s = cls(**{k: v for k, v in d.items() if k in names})
        s.status = Status(s.status)
        return s


def finish_type(meta: Dict[str, Any], sample: Sample) -> str:
    """The ``meta_info.finish_reason.type`` of an engine's answer for ``sample``: stop, length or abort;
    else FinishReasonError."""
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else None
    if kind not in FINISH_TO_STATUS:
        raise FinishReasonError(f"{sample.identity()}: the engine answered finish_reason={reason!r}; expected a type "
                                f"in {', '.join(FINISH_TO_STATUS)} (SGLang's /generate protocol)")
    return kind


def status_from_finish(meta: Dict[str, Any], sample: Sample) -> Status:
    """``sample``'s status after an engine answer (see :func:`finish_type`)."""
    return FINISH_TO_STATUS[finish_type(meta, sample)]
