"""Exception types the coordinator raises.

`HorovodInternalError` is the type Horovod's frontends raise when a collective
fails; every failure the background thread reports derives from it, so code
written for Horovod catches ours unchanged.
"""


class HorovodInternalError(RuntimeError):
    """A collective operation failed."""


class TensorMismatchError(HorovodInternalError):
    """Ranks submitted the same tensor name with different properties."""


class StallError(HorovodInternalError):
    """Some ranks never submitted a tensor the others are waiting on."""


class RankFailedError(HorovodInternalError):
    """A peer process died, so collectives involving it can never finish."""


class ShutdownError(HorovodInternalError):
    """The coordinator shut down before the operation could run."""


class NotInitializedError(HorovodInternalError, ValueError):
    """An operation was called before `init()` or after `shutdown()`.

    It is both a `HorovodInternalError` (what Horovod's collectives raise in
    this case) and a `ValueError` (what its rank()/size() raise)."""
