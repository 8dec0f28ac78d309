"""Operations in flight: started by the background thread, completed later.

A backend runs a response as a generator: it starts non-blocking calls and
yields what they must wait for (anything with a `ready()` method: MPI
requests, a device event), and returns one result per entry.
The executor drives these generators without ever blocking: `progress()`
tests what each operation waits for and resumes those that can go on. So
the background thread stays free to negotiate, inspect stalls and answer its
peers while a collective is in flight, and a stopped peer shows up as a
stall instead of a hang.

Operations are kept in lanes, one per communicator (process set): MPI needs
the collectives of one communicator started in the same order on every
member, so a lane runs its operations one after the other; lanes run side
by side. One exception: once a GPU operation has queued all its work on
its lane's stream and says the next may follow (`DeviceWait.lets_next_start`),
the lane's next operation starts at once and queues its work behind it, so
the device goes from one NCCL call to the next without waiting for the host
to see the first end. At most two operations of a lane are started: the
backend may reuse an operation's host-side resources for the one after next
(nccl_ops.py's kernel tables).

On a GPU the lanes of one device do not run side by side as they start:
an operation there starts only once every operation started before it on
that device (in any lane) has queued all its work or finished. So a rank
queues its NCCL calls in the order its operations were started, which is
the order the negotiation gave them on every rank
(negotiation.answered_in_rounds): NCCL calls queued in different orders on
two ranks can wait on each other forever, on the device or in a call that
blocks until its peers make it.
"""

import collections
import math
import time

from coordinator import leftovers


def _ready(waitable):
    return waitable is None or waitable.ready()


class Operation:
    """One response being run: its entries, names and backend generator."""

    __slots__ = ("response", "entries", "names", "lane", "device", "started", "steps", "_gen",
                 "_waiting", "results", "error", "traced", "handed_out", "completed_early",
                 "finished", "seq")

    def __init__(self, response, entries, names, lane, gen, traced=False, device=None):
        self.response = response
        self.entries = entries
        self.names = names
        # lane: (process set, the response's device), the same on every
        # member; device: the one it runs on here (ranks use their own GPUs).
        self.lane = lane
        self.device = lane[1] if device is None else device
        self._gen = gen
        self._waiting = None
        self.started = None
        self.steps = 0
        self.results = None
        self.error = None
        self.traced = traced
        self.handed_out = False  # by take_queued()
        self.completed_early = False  # some of its handles completed once it was queued
        self.finished = False
        self.seq = 0  # its place among its lane's operations on every member (0: none)

    @property
    def queued_results(self):
        """Its results, once all its work is queued on a device and only its
        completion is awaited (None before, and for host operations)."""
        return getattr(self._waiting, "results", None) if self.started is not None else None

    @property
    def lets_next_start(self):
        """All its work is queued on a device stream, and the backend lets the
        lane's next operation queue its own behind it."""
        return (self.started is not None and not self.finished
                and getattr(self._waiting, "lets_next_start", False))

    def advance(self):
        """Runs the operation as far as it can go without waiting; True once
        it has finished (with `results` or `error`)."""
        if self.finished:
            return True
        self.finished = self._advance()
        return self.finished

    def _advance(self):
        try:
            if self.started is None:
                self.started = time.monotonic()
                self._waiting = next(self._gen)
            while _ready(self._waiting):
                self.steps += 1
                self._waiting = self._gen.send(None)
        except StopIteration as stop:
            self.results = stop.value
            return True
        except Exception as exc:  # a failed call fails this operation only
            self.error = exc
            return True
        return False


class Executor:
    # How long one progress() call keeps testing while nothing finishes: a
    # collective's rounds and pieces move on without a full loop turn
    # between them, and the loop still looks at its control messages every
    # BURST seconds.
    BURST = 100e-6

    def __init__(self):
        self._lanes = collections.OrderedDict()  # lane -> deque of Operation
        # device -> its operations in the order they were started, those
        # at the front that let the next start dropped (_may_start)
        self._device_order = {}
        # Operations whose work is all queued on a device, handed out by
        # take_queued() before they finish.
        self._queued = []
        # Steps taken (a call finished and the next started) since the caller
        # last looked: a long collective makes progress long before it is done.
        self.steps = 0

    def __bool__(self):
        return bool(self._lanes)

    def __len__(self):
        return sum(len(q) for q in self._lanes.values())

    def start(self, op):
        """Queues `op` behind its lane and runs it as far as it goes; returns
        the operations that finished now (possibly `op` itself)."""
        lane = self._lanes.get(op.lane)
        if lane is None:
            lane = self._lanes[op.lane] = collections.deque()
        lane.append(op)
        device = op.device
        if device >= 0:
            self._device_order.setdefault(device, collections.deque()).append(op)
        if len(lane) == 1 or (len(lane) == 2 and lane[0].lets_next_start):
            return self._drive(op.lane, lane)
        return []

    def progress(self):
        """Operations that finished since the last call, in the order they did."""
        done = []
        deadline = time.perf_counter() + self.BURST
        while True:
            for key in list(self._lanes):
                done.extend(self._drive(key, self._lanes[key]))
            if done or self._queued or not self._lanes or time.perf_counter() > deadline:
                return done

    def _drive(self, key, lane):
        """Advances the lane's head, and the operation behind it where the head
        lets it start; returns the operations finished, in lane order (the
        one behind is handed out after the head even if it ended first)."""
        done = []
        while lane:
            head = lane[0]
            if not self._advance(head):
                if len(lane) > 1 and head.lets_next_start:
                    self._advance(lane[1])
                break
            done.append(lane.popleft())
        if not lane:
            del self._lanes[key]
        if done and done[0].device >= 0:
            self._first_on(done[0].device)  # (drops those done: they hold their results)
        return done

    def _may_start(self, op):
        """Whether every operation started before `op` on its device has
        queued all its work or finished (the module's docstring)."""
        first = self._first_on(op.device)
        return first is None or first is op

    def _first_on(self, device):
        """The first operation on `device` that has not yet queued all its
        work, or None."""
        order = self._device_order.get(device)
        if order is None:
            return None
        while order and (order[0].finished or order[0].lets_next_start):
            order.popleft()
        if not order:
            del self._device_order[device]
            return None
        return order[0]

    def _advance(self, op):
        if op.started is None and not self._may_start(op):
            return False
        before = op.steps
        finished = op.advance()
        self.steps += op.steps - before
        if not finished and not op.handed_out and op.queued_results is not None:
            op.handed_out = True
            self._queued.append(op)
        return finished

    def take_queued(self):
        """Operations whose work has all been queued on a device since the
        last call: their results are valid in stream order."""
        queued, self._queued = self._queued, []
        return queued

    def _local(self, lane):
        """The operations in flight of process set `lane[0]` on this rank's
        device `lane[1]` (-1: the host). It loops over copies of the lanes,
        which list() makes in one step of C: busy() is also asked from the
        threads that submit (Background.lane_idle) while this one changes
        them, and a loop over the lanes themselves raised RuntimeError
        ("mutated during iteration") there, out of allreduce_async."""
        pset, device = lane
        return [op for key, ops in list(self._lanes.items()) if key[0] == pset
                for op in list(ops) if op.device == device]

    def busy(self, lane):
        """Whether (process set, this rank's device) has an operation in
        flight (a hint when asked from another thread)."""
        return bool(self._local(lane))

    def runs_set(self, process_set_id):
        """Whether an operation of the process set is in flight (on any
        device)."""
        return any(key[0] == process_set_id for key in self._lanes)

    def on_device(self):
        """Whether any operation in flight runs on a GPU (a lane whose device
        is one)."""
        return any(device >= 0 for _, device in self._lanes)

    def busy_for(self, lane, now):
        """Seconds (from `now`, time.monotonic()) until the operations of
        (process set, this rank's device) should be done on the device: 0
        with none in flight; inf where that cannot be told (one not on a
        device, not yet started, waiting for its inputs with nothing before
        it, or of a kind whose duration nothing has taught yet:
        DeviceWait.expected_end)."""
        ops = self._local(lane)
        if not ops:
            return 0.0
        end = None
        for op in ops:
            waiting = op._waiting if op.started is not None else None
            expected = getattr(waiting, "expected_end", None)
            end = expected(now, end) if expected is not None else None
            if end is None:
                return math.inf
        return max(0.0, end - now)

    def in_flight(self):
        """Every operation not yet finished (the head of each lane first)."""
        return [op for lane in self._lanes.values() for op in lane]

    def oldest(self):
        """The first started operation still in flight, or None."""
        heads = [lane[0] for lane in self._lanes.values() if lane[0].started is not None]
        return min(heads, key=lambda op: op.started) if heads else None

    def abandon(self):
        """Stops driving every operation and returns them. Their requests are
        never completed, and MPI may still write into their buffers, even
        as the process exits: the started ones are kept until it has
        (leftovers.py)."""
        ops = self.in_flight()
        self._lanes.clear()
        self._device_order.clear()
        started = [op for op in ops if op.started is not None]
        if started:
            leftovers.keep(started)
        return ops
