"""Weight sync: the trainers' push to the engines (``sender``), the transports, and the error the driver catches."""


class WeightSyncError(RuntimeError):
    """A weight push that did not reach every engine (raised by ``sender``; the driver heals or stops). Defined
    here, not in ``sender``, so that the driver catches it without importing torch before Ray starts."""
