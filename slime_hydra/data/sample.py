"""``Sample``: one prompt and one response, everything the rollout side knows about it.

It lives in ``data`` because the data source makes samples, the rewards score them and the rollout
fills them in: all three import it from here, and none of them imports another for it. Rollout hooks
may import it as ``slime_hydra.rollout.sample`` too.

Field names follow slime's ``Sample`` where they mean the same thing. ``tokens`` is prompt + response;
``loss_mask``, ``rollout_log_probs`` are aligned to the response tokens only. A group is a list of the
``n_samples_per_prompt`` samples of one prompt.
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


FINISH_TO_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


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
        """Append tokens to the response: model tokens (trainable, with log-probs) or tool / environment
        tokens (masked out of the loss, log-prob 0)."""
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

    def reward_value(self, key: Optional[str] = None) -> float:
        r = self.reward
        if isinstance(r, dict):
            if key is None:
                raise ValueError(f"the reward is a dict {sorted(r)}; set reward.key to pick one")
            r = r[key]
        return float(r if r is not None else 0.0)

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
