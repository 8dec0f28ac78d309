"""Exception types the coordinator raises.

`HorovodInternalError` is the type Horovod's frontends raise when a collective
fails; every failure the background thread reports derives from it, so code
written for Horovod catches ours unchanged.

Some failures are the program's own: ranks that disagree on a tensor, input
an operation cannot take, ranks that wait on each other. Re-forming the job
cannot get past them: the restored program makes the same calls again. An
elastic job raises them (`repairable` says which) where Horovod's resets and
meets them again, for ever.
"""


class HorovodInternalError(RuntimeError):
    """A collective operation failed."""


class TensorMismatchError(HorovodInternalError):
    """Ranks submitted the same tensor name with different properties."""


class InvalidOperationError(HorovodInternalError):
    """The ranks agreed on an operation that cannot run: a rank refused its
    input, a root rank outside the process set, an operation a joined rank
    cannot take part in."""


class StallError(HorovodInternalError):
    """Some ranks never submitted a tensor the others are waiting on."""


class DeadlockError(StallError):
    """Ranks wait, each for a tensor only the others could submit."""


class RankFailedError(HorovodInternalError):
    """A peer process died, so collectives involving it can never finish."""


class ShutdownError(HorovodInternalError):
    """The coordinator shut down before the operation could run."""


class NotInitializedError(HorovodInternalError, ValueError):
    """An operation was called before `init()` or after `shutdown()`.

    It is both a `HorovodInternalError` (what Horovod's collectives raise in
    this case) and a `ValueError` (what its rank()/size() raise)."""


# The program's own mistakes: an elastic reset replays them.
PROGRAM_ERRORS = (TensorMismatchError, InvalidOperationError, DeadlockError)


def repairable(exc):
    """Whether re-forming the job (an elastic reset) can get past `exc`, a
    failed collective: a lost or stopped rank, a failed backend, yes; the
    program's own mistakes, no."""
    return not isinstance(exc, PROGRAM_ERRORS)
