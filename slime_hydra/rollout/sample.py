"""The rollout's import path of ``Sample`` (rollout hooks and ``examples/`` use it); the class is defined
in :mod:`slime_hydra.data.sample`, below the data source, the rewards and the rollout."""

from slime_hydra.data.sample import FINISH_TO_STATUS, FinishReasonError, Sample, Status, finish_type, status_from_finish

__all__ = ["FINISH_TO_STATUS", "FinishReasonError", "Sample", "Status", "finish_type", "status_from_finish"]
