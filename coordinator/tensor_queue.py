"""Submitted tensors: the entry each one becomes, and the queue that hands
them from the frontends' threads to the background thread.

Names are per process set (as in Horovod): the same name in two sets is two
tensors. A name may be in flight only once per rank and set: submitting it
again before it completes is a `ValueError` at once, on the submitting rank.
"""

import _thread
import collections
import threading
import time

from coordinator.ops_names import describe
from coordinator.response_cache import NAN_KEY
from coordinator.wire import pb

# Guards the single completion of an entry: the background thread completes
# entries while a frontend thread may fail them all (a dead peer).
_completion = threading.Lock()

# Negotiated among all ranks whatever process set they name (controller.py).
_GLOBAL_OPS = frozenset({pb.ADD_PROCESS_SET, pb.REMOVE_PROCESS_SET, pb.JOIN})


class _Quiet(threading.local):
    on = False


_quiet = _Quiet()


class quiet_pushes:
    """Pushes from this thread do not wake the background thread: the caller
    runs the loop itself next (Background.drive), and wakes it if it cannot.
    (A class: it wraps every blocking call, where contextlib's generators
    cost three times as much.)"""

    __slots__ = ()

    def __enter__(self):
        _quiet.on = True

    def __exit__(self, *exc_info):
        _quiet.on = False


class Entry:
    """One submitted tensor (or control operation) and its outcome."""

    __slots__ = ("name", "op", "tensor", "output", "dtype_info", "shape", "reduce_op",
                 "root_rank", "prescale", "postscale", "process_set_id", "device", "splits",
                 "group", "group_size", "ranks", "submit_time", "cache_id", "_pending",
                 "result", "error", "callback", "done", "key", "rejected", "since",
                 "reported", "ready_point", "done_event", "seq", "in_stream_order",
                 "among_members")

    def __init__(self, name, op, tensor=None, output=None, dtype_info=None, shape=(),
                 reduce_op=0, root_rank=0, prescale=1.0, postscale=1.0, process_set_id=0,
                 device=-1, splits=(), group="", group_size=0, ranks=(), callback=None,
                 rejected="", among_members=False):
        # (collectives._allreduce_entry passes the first fifteen by position.)
        self.name = name
        self.op = op
        self.tensor = tensor
        self.output = output
        self.dtype_info = dtype_info
        self.shape = shape
        self.reduce_op = reduce_op
        self.root_rank = root_rank
        self.prescale = prescale
        self.postscale = postscale
        self.process_set_id = process_set_id
        self.device = device
        self.splits = splits
        self.group = group
        self.group_size = group_size
        self.ranks = ranks
        self.among_members = among_members  # add_process_set by its own ranks only
        # Where the name lives: (negotiating process set, name).
        self.key = (0 if op in _GLOBAL_OPS else process_set_id, name)
        # Non-empty: this rank refused the operation; the entry only tells the
        # coordinator why, so the other ranks' copies fail too.
        self.rejected = rejected
        self.since = 0.0  # when it started waiting for a negotiation cycle
        self.reported = False  # described to rank 0 in full while waiting for cycles
        self.submit_time = 0.0
        self.seq = -1  # its place in the order of pushes (TensorQueue.pushed before it)
        self.cache_id = 0
        # Device tensors: the point of the submitting stream after which the
        # tensor may be read (gpu.ReadyPoint, its event recorded at launch),
        # and the backend's DeviceWait for the work that wrote the result.
        self.ready_point = None
        self.done_event = None
        # Its handle completes once its operation is queued on the device
        # (collectives.in_stream_order).
        self.in_stream_order = False
        # Held until the entry completes: waiting is acquiring it. A bare lock
        # costs a fraction of a threading.Event on this hot path.
        self._pending = _thread.allocate_lock()
        self._pending.acquire()
        self.result = None
        self.error = None
        self.callback = callback
        self.done = False

    @property
    def in_rounds(self):
        """Negotiated in the global set's cycles and rounds (negotiation.py)."""
        return self.key[0] == 0 and self.op != pb.P2P

    @property
    def wire_dtype(self):
        return self.dtype_info.wire if self.dtype_info is not None else 0

    def signature(self):
        """request_signature of its description, built in place (it runs for
        every tensor taken; x == x is False for NaN alone, as float_key
        tells)."""
        pre, post, info = self.prescale, self.postscale, self.dtype_info
        return (self.op, info.wire if info is not None else 0, tuple(self.shape),
                self.reduce_op, self.root_rank, pre if pre == pre else NAN_KEY,
                post if post == post else NAN_KEY, self.process_set_id, self.device >= 0,
                self.group, self.group_size)

    def request(self):
        """Its description in full, for rank 0 (the fields its op uses)."""
        req = pb.Request(name=self.name, op=self.op, shape=self.shape,
                         process_set_id=self.process_set_id, device=self.device,
                         submit_time=self.submit_time, dtype=self.wire_dtype,
                         rejected=self.rejected)
        if self.op in (pb.ALLREDUCE, pb.REDUCESCATTER):
            req.reduce_op = self.reduce_op
            req.prescale = self.prescale
            req.postscale = self.postscale
        elif self.op == pb.BROADCAST:
            req.root_rank = self.root_rank
        elif self.op == pb.ALLTOALL:
            req.splits.extend(self.splits)
        elif self.op in (pb.ADD_PROCESS_SET, pb.P2P):
            req.ranks.extend(self.ranks)
            req.among_members = self.among_members
        if self.group:
            req.group = self.group
            req.group_size = self.group_size
        return req

    def describe(self):
        where = f" in process set {self.key[0]}" if self.key[0] else ""
        return f"{describe(self.op, self.name)}{where}"

    def finish(self, result):
        """Completes the entry with `result`; False if it had completed already."""
        return bool(_finish_all(((self, result),)))

    def fail(self, error):
        """Completes the entry with `error`; False if it had completed already
        (the first outcome stands: a late failure never hides a result)."""
        with _completion:
            if self.done:
                return False
            self.error = error
            self.done = True
        self._released()
        return True

    def _released(self):
        self.tensor = None  # the frontend's buffer is no longer needed
        self._pending.release()
        if self.callback is not None:
            self.callback(self)

    def wait(self, timeout):
        """True once the entry has completed (waits up to `timeout` seconds)."""
        if self.done:
            return True
        if self._pending.acquire(timeout=timeout):
            self._pending.release()  # let any later waiter through at once
            return True
        return False


def _finish_all(done):
    """Completes each (entry, result) of `done` that has not completed yet;
    returns those it completed."""
    finished = []
    with _completion:
        for entry, result in done:
            if not entry.done:
                entry.result = result
                entry.done = True
                finished.append(entry)
    for entry in finished:
        entry._released()
    return finished


class Signal:
    """Wakes the background thread: set() from any thread, wait() with a
    timeout from the background thread. Setting while nobody waits makes the
    next wait return at once, so no wake-up is lost."""

    __slots__ = ("_lock",)

    def __init__(self):
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def set(self):
        if self._lock.locked():
            try:
                self._lock.release()
            except RuntimeError:  # another thread set it first
                pass

    def clear(self):
        self._lock.acquire(False)

    def wait(self, timeout):
        if timeout <= 0:
            return not self._lock.locked()
        got = self._lock.acquire(timeout=timeout)
        if got:
            try:
                self._lock.release()  # stays set until clear(), like an Event
            except RuntimeError:
                # A set() came between the acquire and this release (it saw
                # the lock held) and released it already: it is set either way.
                pass
        return got


def _in_flight(entry):
    return ValueError(f"{entry.describe()}: a tensor with this name is already in flight on "
                      "this rank; wait for it (synchronize) or use a different name")


class TensorQueue:
    """Frontend threads push; the background thread drains and completes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queue = collections.deque()
        self._inflight = {}  # name -> Entry, from push until completion
        self.wakeup = Signal()
        self._closed = None  # exception raised by push once closed
        # Entries pushed so far; how many had been pushed at the last flush().
        self.pushed = 0
        self.flushed = 0

    def push(self, entry):
        self.push_all((entry,))

    def push_all(self, entries):
        """Queues entries together (a grouped operation's members reach the
        coordinator in one message), or none of them."""
        inflight = self._inflight
        self._lock.acquire()  # (a with statement costs twice as much, per tensor)
        try:
            if self._closed is not None:
                raise self._closed(entries[0])
            if len(entries) == 1:
                if entries[0].key in inflight:
                    raise _in_flight(entries[0])
            else:
                keys = set()
                for entry in entries:
                    if entry.key in inflight or entry.key in keys:
                        raise _in_flight(entry)
                    keys.add(entry.key)
            now = time.time()
            for entry in entries:
                entry.submit_time = now
                entry.seq = self.pushed
                self.pushed += 1
                inflight[entry.key] = entry
                self._queue.append(entry)
        finally:
            self._lock.release()
        if not _quiet.on:
            self.wakeup.set()

    def flush(self, wake=True):
        """Says that no more entries are coming soon: the background thread
        should not hold the ones pushed so far (`seq` below `flushed`) back
        for a fuller fusion (pacing.DeviceHold). Wakes it
        (unless `wake` is False) only when entries were pushed since the
        last flush: otherwise there is nothing new for it to let go."""
        with self._lock:
            if self.flushed == self.pushed:
                return
            self.flushed = self.pushed
        if wake:
            self.wakeup.set()

    def tell(self, entry):
        """Queues a refusal (`entry.rejected`) for the coordinator; nothing
        waits on it. Dropped once the queue is closed."""
        with self._lock:
            if self._closed is not None:
                return
            entry.submit_time = time.time()
            self._queue.append(entry)
        self.wakeup.set()

    def drain(self):
        """Entries pushed since the last drain, in push order."""
        if not self._queue:
            return ()
        with self._lock:
            items = list(self._queue)
            self._queue.clear()
        return items

    def get(self, key):
        """The entry in flight under (process set, name), or None."""
        return self._inflight.get(key)

    def group(self, process_set_id, group):
        """The entries in flight of grouped operation `group`, negotiated in
        that process set (one instance: names are unique in flight)."""
        with self._lock:
            return [e for e in self._inflight.values()
                    if e.group == group and e.key[0] == process_set_id]

    def complete(self, entry, result=None, error=None):
        with self._lock:
            if self._inflight.get(entry.key) is entry:
                del self._inflight[entry.key]
        if error is not None:
            entry.fail(error)
        else:
            entry.finish(result)

    def complete_all(self, done):
        """complete() with a result for each (entry, result) of `done`, taking
        each lock once."""
        inflight = self._inflight
        with self._lock:
            for entry, _ in done:
                if inflight.get(entry.key) is entry:
                    del inflight[entry.key]
        _finish_all(done)

    def inflight_count(self):
        return len(self._inflight)

    def close(self, make_error, keep=()):
        """Refuse new entries (`make_error(entry)` is raised) and return every
        entry still in flight, which the caller fails. Entries whose id() is in
        `keep` stay in flight: collectives every rank started, which complete
        as usual."""
        with self._lock:
            self._closed = make_error
            entries = [e for e in self._inflight.values() if id(e) not in keep]
            for entry in entries:
                del self._inflight[entry.key]
            self._queue.clear()
        self.wakeup.set()
        return entries

    def fail_remaining(self, make_error):
        """Fails whatever is still in flight; closes the queue with
        `make_error` unless it was closed already (the first reason stands)."""
        with self._lock:
            if self._closed is None:
                self._closed = make_error
            entries = list(self._inflight.values())
            self._inflight.clear()
            self._queue.clear()
        for entry in entries:
            entry.fail(make_error(entry))

    def close_and_fail(self, make_error, error=None, keep=()):
        """close(), then fail every entry in flight with `error` (or
        `make_error(entry)`), except those whose id() is in `keep`."""
        for entry in self.close(make_error, keep):
            entry.fail(error if error is not None else make_error(entry))
