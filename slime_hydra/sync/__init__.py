"""Weight sync: the push as the loop makes it (``push``), the trainer's sender (``sender``), the transports."""


class WeightSyncError(RuntimeError):
    """A weight push that did not reach every engine (here, not in ``sender``: ``push`` imports no torch)."""
