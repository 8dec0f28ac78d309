"""Training state that survives a change of workers (Horovod's
horovod.common.elastic.State and ObjectState).

`commit()` copies the state to host memory and checks for changes of hosts;
`restore()` goes back to the last commit (after a lost worker); `sync()`
makes every rank's state rank 0's (after any change). `check_host_updates()`
agrees, through a broadcast from rank 0, on whether the hosts changed, so
every rank raises HostsUpdatedInterrupt at the same commit.
"""

import copy
import queue

import numpy as np

from coordinator.elastic.hosts import NO_UPDATE, REMOVED


class HostsUpdatedInterrupt(RuntimeError):
    """The hosts of the job changed: it re-forms and goes on from the
    current state (no restore). `skip_sync`: only hosts were removed, so the
    remaining ranks already agree and need no sync."""

    def __init__(self, skip_sync=False):
        super().__init__("the hosts of the elastic job changed")
        self.skip_sync = skip_sync


class HostUpdateResult:
    """Horovod's bits describing a change of hosts."""

    no_update = NO_UPDATE
    removed = REMOVED
    added = 2
    mixed = 3


def broadcast_object(obj, root_rank=0, name=None):
    """Framework-free broadcast of a picklable object from `root_rank`: one
    exchange on the core (coordinator/objects.py)."""
    from coordinator import objects

    return objects.broadcast_object(obj, root_rank, name or "elastic")


def _core_rank():
    import coordinator as hvd

    return hvd.rank()


class State:
    """State tracked in memory across workers.

    bcast_object: broadcasts an object from rank 0 to the others;
    get_rank: returns this worker's rank."""

    def __init__(self, bcast_object=None, get_rank=None):
        self._bcast_object = bcast_object or broadcast_object
        self._rank = get_rank or _core_rank
        self._host_messages = queue.Queue()
        self._last_updated_timestamp = 0
        self._pending_check = None  # commit()'s broadcast, read at the next commit
        self._reset_callbacks = []
        self._commits_made = 0  # the run loop's measure of progress

    def register_reset_callbacks(self, callbacks):
        """Functions to call after every reset (a worker added or removed),
        e.g. to scale the learning rate with the new number of workers."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self._pending_check = None  # sent in the old membership
        self._host_messages = _unhandled(self._host_messages)
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res):
        self._host_messages.put((timestamp, update_res))

    def commit(self):
        """Saves the state to host memory, then checks for changes of hosts
        (raising HostsUpdatedInterrupt when there were some). Commits copy
        the whole state: commit every few batches rather than every one to
        trade lost steps against time.

        The check does not wait for the other ranks: a commit sends rank 0's
        view and reads the view the previous commit sent, so a change of
        hosts interrupts the job one commit later than check_host_updates()
        would (at the same commit on every rank)."""
        self.save()
        self._commits_made = getattr(self, "_commits_made", 0) + 1
        self._check_host_updates(wait=False)

    def check_host_updates(self):
        """Raises HostsUpdatedInterrupt, on every rank at the same point, when
        the driver reported a change of hosts."""
        self._check_host_updates(wait=True)

    def _check_host_updates(self, wait):
        import coordinator as hvd

        if not hvd.is_initialized():  # a state used outside a job
            prev, last, update = self._bcast_object(self._rank0_view())
            self._conclude(prev, last, update)
            return
        pending, self._pending_check = self._pending_check, None
        if pending is not None:
            self._conclude(*(int(v) for v in hvd.synchronize(pending)))
        # One broadcast of three integers through the coordinator (Horovod
        # broadcasts a pickled tuple: its length, then its bytes).
        handle = hvd.broadcast_async(np.array(self._rank0_view(), np.int64), 0,
                                     name="elastic.host_updates")
        if wait:
            self._conclude(*(int(v) for v in hvd.synchronize(handle)))
        else:
            self._pending_check = handle

    def finish_pending(self):
        """Waits for the check the last commit sent (the run loop calls it
        when the function returns: no collective stays in flight). Training
        is over, so a failure here is not a reason to re-form the job: the
        other ranks may have left already."""
        pending, self._pending_check = self._pending_check, None
        if pending is not None:
            import coordinator as hvd

            try:
                hvd.synchronize(pending)
            except Exception as exc:  # noqa: BLE001 - see the docstring
                import logging

                logging.getLogger("coordinator.elastic").debug(
                    "the last host check failed after training ended: %s", exc)

    def _rank0_view(self):
        """(last agreed update, newest update seen, their kinds); only rank
        0's counts, as in Horovod."""
        last = prev = self._last_updated_timestamp
        all_update = NO_UPDATE
        while not self._host_messages.empty():
            timestamp, update = self._host_messages.get()
            if timestamp > last:
                last = timestamp
                all_update |= update
        return prev, last, all_update

    def _conclude(self, prev, last, update):
        self._last_updated_timestamp = max(self._last_updated_timestamp, last)
        if last > prev:
            raise HostsUpdatedInterrupt(update == REMOVED)

    def save(self):
        """Saves the state to host memory."""
        raise NotImplementedError()

    def restore(self):
        """Goes back to the last committed state."""
        raise NotImplementedError()

    def sync(self):
        """Makes every worker's state rank 0's."""
        raise NotImplementedError()

    def reset(self):
        """Resets objects after a reset event, before the sync."""


def _unhandled(messages):
    """The notices the new membership has not accounted for: those newer
    than the change of hosts its driver plan took in (a notice can arrive
    while the job re-forms)."""
    from coordinator.elastic import membership

    m = membership.current()
    fresh = queue.Queue()
    if m is None:
        return fresh
    while not messages.empty():
        timestamp, update = messages.get()
        if timestamp > m.hosts_version:
            fresh.put((timestamp, update))
    return fresh


class ObjectState(State):
    """State made of plain Python objects, given as keyword arguments and
    exposed as attributes."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        self._bcast_object = bcast_object or broadcast_object
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr))
                             for attr in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))
