"""The `run` decorator: the elastic training loop (Horovod's run_fn).

    @elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)

It syncs the state from rank 0 and calls the function. When a worker is
lost (a HorovodInternalError: a collective failed), it restores the last
commit; when the hosts changed (HostsUpdatedInterrupt), it keeps the state
as it is. Either way it then re-forms the job (`reset`: shut the coordinator
down, re-form the membership, initialise again), syncs the state from the
new rank 0 (unless only hosts were removed and no worker joined), calls the
reset callbacks and calls the function again.

A failure that comes back the same (its text, numbers aside) on
SAME_FAILURE_LIMIT attempts in a row, with no commit between them, is not
being repaired by the resets either (a rank whose backend fails the same
operation every time): it propagates, unless it is a lost rank, which every
reset does repair. Horovod resets for ever, unless --reset-limit says.

Outside an elastic job (no coordrun --min-np/--host-discovery-script) a
failure cannot be repaired: the error propagates. Nor can the program's own
mistakes (`errors.repairable`: mismatched tensors, input an operation cannot
take, ranks waiting on each other): the restored program would make the
same calls again, so they propagate too, on every rank that met them.
Horovod resets on them, and met a mismatch again some 70 times a second,
for ever.
"""

import functools
import re

from coordinator import runtime
from coordinator.elastic import membership, worker
from coordinator.elastic.state import HostsUpdatedInterrupt
from coordinator.errors import (HorovodInternalError, RankFailedError, ShutdownError,
                                finished_peer, repairable)

notification_manager = worker.notification_manager

NOT_RETRIED = ("elastic.run did not reset the job for this error: it is the program's "
               "own, and the restored program would meet it again")

PEER_FINISHED = ("elastic.run did not reset the job for this error: another rank's program "
                 "finished (it called shutdown() or reached its end) while this one was still "
                 "in its elastic function, and no reset brings it back; as in Horovod, a "
                 "worker that finishes ends the job")


def not_retried(exc):
    """The note on an error run() raises without a reset (not repairable)."""
    return PEER_FINISHED if finished_peer(exc) else NOT_RETRIED


# Attempts that meet the same failure, with no commit between, before run()
# lets it propagate.
SAME_FAILURE_LIMIT = 3


class _Repeats:
    """The run of attempts that met the same failure at the same commit."""

    def __init__(self):
        self.key, self.count = None, 0

    def hopeless(self, error, state):
        """Counts `error`; True once SAME_FAILURE_LIMIT attempts in a row met
        it at the same commit. A lost rank (or one that left) never is: the
        reset takes it out of the job."""
        if isinstance(error, (RankFailedError, ShutdownError)):
            self.key, self.count = None, 0
            return False
        key = (type(error), re.sub(r"\d+(?:\.\d+)?", "#", str(error)),
               getattr(state, "_commits_made", 0))
        self.count = self.count + 1 if key == self.key else 1
        self.key = key
        return self.count >= SAME_FAILURE_LIMIT


def make_reset(shutdown, init):
    """A reset for a frontend: its shutdown, the membership's re-forming,
    its init (which picks up the new communicator).

    Process sets do not outlive the shutdown: the ranks they named may be
    gone or renumbered. A job that used them (dynamic sets on, or any set
    registered) may add them again after the reset, so dynamic process sets
    stay on: a `ProcessSet` kept from before can be passed to
    add_process_set() again, for example in a reset callback. (Horovod's
    reset calls init() with no process sets, which turned dynamic sets off
    unless HOROVOD_DYNAMIC_PROCESS_SETS was set, and left such a set's old
    id in place, so it could not be added again.)"""

    def reset():
        rt = runtime.current()
        sets_used = rt is not None and (getattr(rt, "dynamic_process_sets", False)
                                        or len(rt.process_sets.all()) > 1)
        with runtime.resetting():
            shutdown()
        membership.current().reform()
        init()
        if sets_used:
            runtime.current().dynamic_process_sets = True

    return reset


def run_fn(func, reset):
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        notification_manager.init()
        notification_manager.register_listener(state)
        elastic = membership.current() is not None
        skip_sync = False
        repeats = _Repeats()
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    result = func(state, *args, **kwargs)
                    finish = getattr(state, "finish_pending", None)
                    if finish is not None:
                        finish()
                    return result
                except HorovodInternalError as e:
                    if not elastic:
                        raise
                    if not repairable(e):
                        e.add_note(not_retried(e))
                        raise
                    if repeats.hopeless(e, state):
                        e.add_note(f"elastic.run stopped resetting the job: this failure came "
                                   f"back on {repeats.count} attempts in a row, with no commit "
                                   "between them")
                        raise
                    state.restore()
                    skip_sync = False
                except HostsUpdatedInterrupt as e:
                    skip_sync = e.skip_sync
                reset()
                if skip_sync and membership.current().added_last:
                    # The interrupt saw hosts removed only, but by the time
                    # the driver planned, hosts had come (back): the new
                    # workers sync from rank 0, so every rank must. (Skipping
                    # it left the old ranks training while the new ones
                    # waited in the sync: the job hung.)
                    skip_sync = False
                state.on_reset()
        finally:
            notification_manager.remove_listener(state)

    return wrapper


def run(func):
    """The elastic training loop for the core API (NumPy); see the module
    docstring. `func(state, ...)` must not start with a collective."""
    from coordinator import basics

    return run_fn(func, make_reset(basics.shutdown, basics.init))
