"""A RolloutManager without Ray or engines, for tests of its generation, filter and eval code:
the real ``_load_data`` (tokenizer, data source with its buffer filter, eval sets, generate
function, dynamic filter), with ``client``/``urls`` pointing at a test engine or at nothing."""

from __future__ import annotations

from typing import Any, List, Sequence

from conftest import resolved
from slime_hydra.rollout.manager import RolloutManager


def make_manager(overrides: Sequence[str] = (), *, client: Any = None, urls: Sequence[str] = ()) -> RolloutManager:
    m = RolloutManager.__new__(RolloutManager)
    m.cfg = resolved(list(overrides))
    m.model_path = None  # the builtin tokenizers need no checkpoint
    m.urls, m.client = list(urls), client
    m._load_data()
    return m


def texts(groups: List[list]) -> List[List[str]]:
    return [[s.response for s in g] for g in groups]
