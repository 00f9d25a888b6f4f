"""The data position a checkpoint saves: the data source's state when each rollout started (an async run has
started rollout ``s`` when it saves step ``s``, whose checkpoint must hold the position after rollouts ``< s``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional


class DataState:
    def __init__(self, source: Any):
        self.source = source  # a DataSource: state_dict() / load_state_dict()
        self._at: Dict[int, Dict[str, Any]] = {}

    def rollout_starts(self, rollout_id: int) -> None:
        """Record the position before rollout ``rollout_id`` (only the latest one is kept)."""
        self._at = {rollout_id: self.source.state_dict()}

    def state_dict(self, rollout_id: Optional[int] = None) -> Dict[str, Any]:
        """The data position after rollouts ``< rollout_id`` (recorded when it started), else the current one."""
        state = self._at.get(rollout_id) if rollout_id is not None else None
        return state if state is not None else self.source.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.source.load_state_dict(state)
