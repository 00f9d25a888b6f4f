"""Weight sync: the push as the loop makes it (``push``), the trainer's sender (``sender``), the transports."""


class WeightSyncError(RuntimeError):
    """A weight push that did not reach every engine. Defined here, not in ``sender``, so that ``push`` catches
    it without importing torch before Ray starts."""
