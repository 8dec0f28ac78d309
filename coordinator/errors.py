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

    # True when another rank shut it down because its program was done (it
    # called shutdown() or reached its end), not failing nor re-forming. Its
    # text then says FINISHED_MARK (read where only the text travels: a
    # TensorFlow error raised inside a tf.function).
    peer_finished = False


FINISHED_MARK = "its program is done"
# How that text ends a ShutdownError's reason, "(rank 1 called shutdown(); its
# program is done)": what is matched, so that an exception of the program's
# own that happens to use the words is not taken for one.
FINISHED_TEXT = f"; {FINISHED_MARK})"


class NotInitializedError(HorovodInternalError, ValueError):
    """An operation was called before `init()` or after `shutdown()`.

    It is both a `HorovodInternalError` (what Horovod's collectives raise in
    this case) and a `ValueError` (what its rank()/size() raise)."""


# The program's own mistakes: an elastic reset replays them.
PROGRAM_ERRORS = (TensorMismatchError, InvalidOperationError, DeadlockError)


def finished_peer(exc):
    """Whether `exc` (or an exception it was raised from) is a ShutdownError
    of a rank whose program finished (ShutdownError.peer_finished)."""
    while exc is not None:
        if getattr(exc, "peer_finished", False) or FINISHED_TEXT in _text(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _text(exc):
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ says nothing
        return ""


def repairable(exc):
    """Whether re-forming the job (an elastic reset) can get past `exc`, a
    failed collective: a lost or stopped rank, a failed backend, yes; the
    program's own mistakes, and a rank whose program finished while the
    others were still in theirs (no reset brings it back), no."""
    return not (isinstance(exc, PROGRAM_ERRORS) or finished_peer(exc))
