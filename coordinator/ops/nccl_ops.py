"""The NCCL backend: collectives on CUDA device memory through CuPy's NCCL
bindings (`cupy.cuda.nccl`); tensor bytes never touch the host.

Lanes. Each (process set, device) of this rank has a lane: one NCCL
communicator, one CUDA stream of its own (non-blocking, so it never waits
for the legacy default stream frameworks compute on), device fusion
buffers and the kernels' tables. A lane is opened on the set's first GPU
operation: the set's first member asks NCCL for a unique id and sends it to
the others over the set's MPI communicator of the device lanes (a
non-blocking broadcast, with a non-blocking barrier); once every member
has reached that point, each joins the NCCL communicator
(ncclCommInitRank, which blocks until all have) in a helper thread, which
the operation waits for as for a request. So the background thread keeps
running while a member is late or stopped, before or inside the join, and
the stall checks can name it. (CuPy 13 releases the GIL in the join; an
older one that holds it stops every thread there, which the barrier keeps
to members already on their way.) Lanes join in the order their first
operations were planned, which is the same on every rank, so two sets
opening at once cannot wait on each other.

A stream per lane, not per device: the lanes of two sets start their
operations independently (each when its previous one is done), so the
order in which two sets' NCCL calls are queued can differ between ranks,
and on one stream that order would make them wait on each other forever.

Each operation makes the lane's stream wait for every tensor's ready event
(recorded now on the stream the tensors were submitted on: gpu.ReadyPoint),
queues its kernels and NCCL calls, records a completion event and yields
until the event has fired (executor.py polls it; the background thread
never blocks on the device). The timeline shows WAIT_FOR_DATA (until the ready events fired)
and NCCL_<OP> (until the completion event fired); inside an allreduce's,
the device's own phases, timed by CUDA events: MEMCPY_IN_FUSION_BUFFER (the
pack kernel, prescaling included), NCCL_ALLREDUCE (or NCCL_REDUCESCATTER,
NCCL_ALLREDUCE and NCCL_ALLGATHER for the host-aware allreduce) and
MEMCPY_OUT_FUSION_BUFFER (the unpack kernel: scaling, averaging, narrowing);
an unfused tensor's are PRESCALE (only with a prescale factor),
NCCL_ALLREDUCE and POSTSCALE. Once an operation has queued all its work,
the lane's next operation may queue its own behind it (executor.py), so
the device goes from one NCCL call to the next without a trip through the
host; the second's NCCL_<OP> on the timeline then includes the time it
queued behind the first (its device phases, timed by CUDA events, do not).

Dtypes: NCCL reduces int8, uint8, int32, int64, float16, bfloat16, float32
and float64 natively. int16 and uint16 have no NCCL type: they are widened
to int32 in the fusion buffer and narrowed on the way out (exact for Min and
Max; Sum and Product wrap on narrowing as 16-bit arithmetic does, unless an Average's
division brings the sum back in range). bool cannot be reduced (the core
refuses it). Allgather, broadcast, alltoall and send/recv move bytes, so
every dtype. Average is a Sum followed by the division in the unpack
kernel, as on the host. Min and Max of NaN follow NCCL, not the host
path's NaN-propagating kernels. Adasum is not run here: the staging backend
runs it on the host (staging.py).

Host-aware allreduce (HOROVOD_HIERARCHICAL_ALLREDUCE=1 or
HOROVOD_TORUS_ALLREDUCE=1, global set, several hosts of several ranks): the
fusion buffer, padded to a multiple of the ranks per host times 64 bytes
(the same on every host, so each rank's share starts aligned), is
reduce-scattered among the ranks of the host, each rank's share is
allreduced among the ranks with its local rank on every host, and the
shares are allgathered in the host (the 2D torus, as Horovod's NCCL
hierarchical allreduce does it), all on the lane's stream. The host and
cross-host NCCL communicators are made on first use like a lane's, their
ids sent over MPI communicators of the same groups.

One GPU per process and set: a rank's tensors of one set live on one device.
Results the backend allocates come from CuPy's pool on the lane's stream,
which writes them only after gpu.fence_events (gpu.Fence).
"""

import collections
import contextlib
import logging
import platform
import struct
import threading
import time

import numpy as np

from coordinator import dtypes, gpu
from coordinator.ops.device_fusion import Kernels, Tables
from coordinator.ops import torus
from coordinator.ops.mpi_ops import Making, reducescatter_rows
from coordinator.wire import pb

UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)
# Whether C's char is unsigned here (CuPy 13 passes the id as chars).
UNSIGNED_CHAR = platform.machine().lower() in {"aarch64", "arm64", "armv7l", "ppc64le",
                                                "ppc64", "s390x"}

log = logging.getLogger("coordinator")

# Seconds shutdown() and a revoke wait for NCCL's aborts to return.
ABORT_WAIT = 10.0


def abort_all(comms, wait):
    """Aborts NCCL communicators (ncclCommAbort) in a helper thread and waits
    for it `wait` seconds at most; True when every abort returned. Recent
    NCCL releases make the abort wait for the communicator's other ranks on
    this machine, and a failed job's peer may never come to it (stuck in
    its own synchronize): the caller goes on without, rather than hang the
    rank's exit. CuPy releases the interpreter lock in the call."""
    if not comms:
        return True
    done = threading.Event()

    def run():
        for comm in comms:
            try:
                comm.abort()
            except Exception as exc:  # an old CuPy or NCCL: nothing better to do
                log.warning("could not abort an NCCL communicator: %s", exc)
        done.set()

    threading.Thread(target=run, name="coordinator-nccl-abort", daemon=True).start()
    if done.wait(wait):
        return True
    log.warning("aborting %d NCCL communicator(s) did not return within %.0f s (NCCL's abort "
                "waits for the communicator's other ranks on this machine, and one has not "
                "come to it); going on without it", len(comms), wait)
    return False


class _Destroyer:
    """Destroys removed sets' NCCL communicators (ncclCommDestroy) in a
    helper thread, one at a time, in the order the sets were removed, which
    is the same on every rank. The destroy waits for the communicator's
    queued work, and recent NCCL releases make it wait for its other ranks on
    this machine too: on the background thread, one member stopped there
    would stop every lane of this rank, watchdog included. Each communicator
    goes with its lane, whose buffers the queued work may still use."""

    def __init__(self):
        self._lock = threading.Lock()
        self._waiting = collections.deque()  # lanes not destroyed yet
        self._busy = False  # a thread is running
        self._idle = threading.Event()
        self._idle.set()

    def destroy(self, lanes):
        with self._lock:
            self._waiting.extend(lanes)
            if self._busy or not self._waiting:
                return
            self._busy = True
            self._idle.clear()
        threading.Thread(target=self._run, name="coordinator-nccl-destroy", daemon=True).start()

    def _run(self):
        while True:
            with self._lock:
                if not self._waiting:
                    self._busy = False
                    self._idle.set()
                    return
                lane = self._waiting.popleft()
            try:
                lane.comm.destroy()
            except Exception as exc:  # a peer's failure shows on a live lane, not here
                log.warning("could not destroy a removed process set's NCCL communicator: %s",
                            exc)

    def take_waiting(self):
        """The communicators not being destroyed yet (to abort them instead)."""
        with self._lock:
            lanes = list(self._waiting)
            self._waiting.clear()
        return [lane.comm for lane in lanes]

    def wait(self, seconds):
        """Waits up to `seconds` for the destroys under way; True once none is."""
        return self._idle.wait(seconds)


class _Lane:
    """What this rank holds for one (process set, device)."""

    __slots__ = ("device", "comm", "rank", "size", "stream", "tables", "_spare", "buffers",
                 "times", "waiting", "removed")

    def __init__(self, cp, device, comm, rank, size, stream):
        self.device = device
        self.comm = comm  # NcclCommunicator
        self.rank = rank
        self.size = size
        self.stream = stream
        # The kernels' tables, two sets used in turn: an operation's are
        # rewritten two operations later, when the executor has seen it end
        # (it starts at most two of a lane's operations at once).
        self.tables, self._spare = Tables(cp), Tables(cp)
        self.buffers = {}  # slot -> uint8 device array
        # How long its allreduces take on the device (the background thread
        # holds gradients back while the lane is busy for long enough).
        self.times = gpu.CallTimes()
        # Operations polling its communicator for errors (NCCLOps._wait), and
        # whether its set was removed meanwhile (destroyed once none is).
        self.waiting = 0
        self.removed = False

    def turn(self):
        """An operation starts queuing work: it takes the other set of tables."""
        self.tables, self._spare = self._spare, self.tables

    def buffer(self, cp, slot, count, dtype):
        """`count` elements of `dtype` in fusion buffer `slot` (grown on demand;
        call with the lane's device and stream current)."""
        nbytes = count * np.dtype(dtype).itemsize
        buf = self.buffers.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = self.buffers[slot] = cp.empty(max(nbytes, 256), np.uint8)
        return buf[:nbytes].view(dtype)


class _Turn:
    """Ready once `ticket` is first in line."""

    __slots__ = ("line", "ticket")

    def __init__(self, line, ticket):
        self.line = line
        self.ticket = ticket

    def ready(self):
        return self.line[0] is self.ticket


class _Phases:
    """CUDA events between the device phases of one operation (only while
    the timeline records): once the operation's completion event has fired,
    `spans()` gives each phase's start and end on the timeline's clock,
    counted back from the moment the host saw it done."""

    def __init__(self, cp, stream, enabled):
        self.cp = cp
        self.stream = stream
        self.events = []
        self.labels = []
        if enabled:
            self.events.append(self._record())

    def _record(self):
        event = self.cp.cuda.Event()  # timing enabled
        event.record(self.stream)
        return event

    def mark(self, label):
        """The phase `label` ends here (call after queueing its work)."""
        if self.events:
            self.events.append(self._record())
            self.labels.append(label)

    def spans(self, end, floor):
        """[(label, start, end)] in microseconds, the last ending at `end`,
        none starting before `floor` (when the host started waiting)."""
        if not self.labels:
            return []
        get = self.cp.cuda.get_elapsed_time  # milliseconds between two events
        out = []
        for i in range(len(self.labels) - 1, -1, -1):
            start = max(floor, end - get(self.events[i], self.events[i + 1]) * 1e3)
            out.append((self.labels[i], start, end))
            end = start
        return out[::-1]


def _row_elems(shape):
    n = 1
    for d in shape[1:]:
        n *= d
    return n


# Each rank's share of the host-aware allreduce starts on this many bytes,
# as Horovod's hierarchical NCCL allreduce aligns it: NCCL's kernels move
# aligned buffers in wider loads.
SHARE_ALIGN = 64


def _aligned_share(total, ranks, itemsize):
    """Elements per rank when `total` elements are split among `ranks`:
    at least an even split, rounded up to whole SHARE_ALIGN bytes (the
    padding at the end is reduced with the rest and never read back)."""
    step = max(1, SHARE_ALIGN // itemsize)
    share = -(-total // ranks)
    return -(-share // step) * step


def _starts(counts):
    """Running offsets of consecutive counts."""
    out, pos = [], 0
    for c in counts:
        out.append(pos)
        pos += int(c)
    return out


# Create_group tags of the host-aware groups' MPI communicators (see
# mpi_ops.SET_TAG; the MPI strategies use 1 to 4 on the host lanes, whose
# groups can be made while these are, in another order on another rank).
LOCAL_TAG, CROSS_TAG = 5, 6


class NCCLOps:
    name = "nccl"

    def __init__(self, comms, timeline, nccl, topology=None):
        self.cp = gpu.cupy()
        self.nccl = nccl  # cupy.cuda.nccl
        self.comms = comms  # the device lanes' mpi_ops.Communicators
        self.timeline = timeline
        self.kernels = Kernels(self.cp)
        self._lanes = {}  # (process set id, device) -> _Lane
        self._pairs = {}  # (process set id, device, global rank, global rank) -> _Lane
        self._line = collections.deque()  # lanes waiting to join, in plan order
        self._device = None  # this rank's GPU, once seen
        self._side = {}  # device -> stream for joined ranks' zeros
        # The host layout where host-aware allreduce is asked for, else None.
        self.topology = topology
        self._groups = {}  # ("local" or "cross", device) -> _Lane
        self._fence = None  # gpu.Fence of the operation in _on
        self._destroyer = _Destroyer()  # removed sets' communicators
        self._removed = []  # removed sets' lanes not handed to it yet
        self.two_level_calls = 0
        self._types = {pb.INT8: nccl.NCCL_INT8, pb.UINT8: nccl.NCCL_UINT8,
                       pb.INT32: nccl.NCCL_INT32, pb.INT64: nccl.NCCL_INT64,
                       pb.FLOAT16: nccl.NCCL_FLOAT16, pb.FLOAT32: nccl.NCCL_FLOAT32,
                       pb.FLOAT64: nccl.NCCL_FLOAT64,
                       pb.BFLOAT16: getattr(nccl, "NCCL_BFLOAT16", 9)}
        self._ops = {pb.SUM: nccl.NCCL_SUM, pb.AVERAGE: nccl.NCCL_SUM,
                     pb.PRODUCT: nccl.NCCL_PROD, pb.MIN: nccl.NCCL_MIN,
                     pb.MAX: nccl.NCCL_MAX}

    def enabled(self, response):
        return response.device != -1 and not (response.op == pb.ALLREDUCE
                                              and response.reduce_op == pb.ADASUM)

    def zeros(self, shape, dtype, device):
        """A joined rank's stand-in, on this rank's GPU."""
        device = self._device if self._device is not None else device
        stream = self._side.get(device)
        if stream is None:
            with self.cp.cuda.Device(device):
                stream = self._side[device] = self.cp.cuda.Stream(non_blocking=True)
        return gpu.zeros(shape, dtype, device, stream)

    def remove_process_set(self, process_set_id):
        """Forgets the set's lanes and has their NCCL communicators destroyed
        (NCCL finishes their queued work first) without waiting (_Destroyer),
        each once no operation of it polls it any more (an operation of the
        set may still be in flight: its handle not waited for). Its MPI
        communicators belong to the staging backend's host backends, which
        release them."""
        for lanes in (self._lanes, self._pairs):
            for key in [k for k in lanes if k[0] == process_set_id]:
                lane = lanes.pop(key)
                lane.removed = True
                self._removed.append(lane)
                if not lane.waiting:
                    self._release(lane)

    def _release(self, lane):
        lane.removed = False
        self._removed.remove(lane)
        self._destroyer.destroy([lane])

    def revoke(self):
        """A peer died: aborts every NCCL communicator (ncclCommAbort: queued
        and running work is dropped, nothing waits for the dead rank) and
        forgets it. A re-formed job makes new ones from new unique ids."""
        self.abort_communicators()

    def add_process_set(self, process_set_id):
        """Starts making the MPI communicator that carries the set's NCCL
        ids, as the host backend does its own (mpi_ops' module doc)."""
        self.comms.start(process_set_id)

    def abort_communicators(self, wait=None):
        """Aborts and forgets every NCCL communicator, in the order they were
        made (the same on every rank), waiting `wait` seconds at most
        (ABORT_WAIT by default): see abort_all. Removed sets' communicators
        not destroyed yet are aborted instead; for one being destroyed, it
        waits within the same time."""
        wait = ABORT_WAIT if wait is None else wait
        comms = self._destroyer.take_waiting()
        for lane in self._removed:  # (not destroyed after all)
            lane.removed = False
            comms.append(lane.comm)
        self._removed.clear()
        comms += [lane.comm for lane in self._lanes.values()]
        comms += [pair.comm for pair in self._pairs.values()]
        comms += [group.comm for group in self._groups.values()]
        self._lanes.clear()
        self._pairs.clear()
        self._groups.clear()
        started = time.monotonic()
        aborted = abort_all(comms, wait)
        return self._destroyer.wait(max(0.0, wait - (time.monotonic() - started))) and aborted

    # -------------------------------------------------------------- lanes
    def _lane(self, response, entries):
        device = self._device = gpu.home_device(response, entries, self._device)
        lane = self._lanes.get((response.process_set_id, device))
        if lane is None:
            lane = yield from self._open(response.process_set_id, device)
        return lane

    def _open(self, process_set_id, device):
        comm = yield from self.comms.when_ready(process_set_id)
        nccl_comm = yield from self._join(comm, device)
        with self.cp.cuda.Device(device):
            stream = self.cp.cuda.Stream(non_blocking=True)
        lane = self._lanes[(process_set_id, device)] = _Lane(self.cp, device, nccl_comm,
                                                             comm.rank, comm.size, stream)
        return lane

    def _open_group(self, kind, ranks, tag, lane):
        """The NCCL communicator among `ranks` (global) for host-aware
        allreduce, as a _Lane on `lane`'s device and stream; every rank opens
        its groups in the same order, at the same operation."""
        group = self._groups.get((kind, lane.device))
        if group is None:
            comm = yield from self.comms.group_when_ready(ranks, tag)
            try:
                nccl_comm = yield from self._join(comm, lane.device)
                group = _Lane(self.cp, lane.device, nccl_comm, comm.rank, comm.size,
                              lane.stream)
            finally:
                comm.Free()  # it only carried the id
            self._groups[(kind, lane.device)] = group
        return group

    def _pair_lane(self, response, entries, pair):
        """A send/recv's lane: an NCCL communicator of its two ranks alone,
        with a stream of its own (PyTorch's NCCL process group does the
        same). A set's communicator would need every member to join it, and
        the others may never run an operation of that set. Its id goes from
        the lower rank to the other over the set's MPI communicator."""
        device = self._device = gpu.home_device(response, entries, self._device)
        ranks = sorted(response.ranks)
        key = (response.process_set_id, device, *ranks)
        lane = self._pairs.get(key)
        if lane is None:
            comm = yield from self.comms.when_ready(response.process_set_id)
            me, peer = (pair if comm.rank == pair[0] else pair[::-1])
            rank = 0 if me < peer else 1
            uid = _id_bytes(self.nccl.get_unique_id()) if rank == 0 else None
            received, sent = self.comms.share_with(comm, uid, peer, UNIQUE_ID_BYTES)
            nccl_comm = yield from self._join_after(sent, received, device, 2, rank)
            with self.cp.cuda.Device(device):
                stream = self.cp.cuda.Stream(non_blocking=True)
            lane = self._pairs[key] = _Lane(self.cp, device, nccl_comm, rank, 2, stream)
        return lane

    def _join(self, comm, device):
        """An NCCL communicator over the ranks of MPI communicator `comm`: its
        rank 0 asks NCCL for an id and sends it to the others; once all have
        reached this point, every rank joins, in plan order and in a helper
        thread (see the module doc)."""
        uid = _id_bytes(self.nccl.get_unique_id()) if comm.rank == 0 else None
        received, sent = self.comms.share_on(comm, uid, UNIQUE_ID_BYTES)
        return (yield from self._join_after(sent, received, device, comm.size, comm.rank))

    def _join_after(self, sent, received, device, size, rank):
        """Joins the NCCL communicator whose id `received` holds once `sent`
        is done, in plan order (the module doc)."""
        ticket = object()
        self._line.append(ticket)
        try:
            yield sent
            yield _Turn(self._line, ticket)
            uid = self._id_for_cupy(received)
            joining = Making(lambda: self._new_communicator(device, size, uid, rank))
            yield from joining.wait()
            return joining.outcome()
        finally:
            self._line.remove(ticket)

    def _new_communicator(self, device, size, uid, rank):
        """(In a helper thread.) Blocks until every member has joined; they
        all reach it next."""
        with self.cp.cuda.Device(device):
            return self.nccl.NcclCommunicator(size, uid, rank)

    def _two_level(self, response):
        return self.topology is not None and torus.fits(response, self.topology)

    def _id_for_cupy(self, data):
        """CuPy 14 takes the id as bytes, older versions as a tuple of C
        chars, which are unsigned on ARM, POWER and s390x (a signed value
        there, or one above 127 on x86, raises OverflowError)."""
        if int(self.cp.__version__.split(".")[0]) >= 14:
            return bytes(data)
        return struct.unpack(f"{len(data)}{'B' if UNSIGNED_CHAR else 'b'}", bytes(data))

    @contextlib.contextmanager
    def _on(self, lane, entries):
        """The lane's device and stream current, its stream waiting for the
        entries' ready events; new results come from `_result` (gpu.Fence)."""
        lane.turn()
        with self.cp.cuda.Device(lane.device), lane.stream:
            for event in gpu.ready_events(entries):
                lane.stream.wait_event(event)
            self._fence = gpu.Fence(lane.stream, entries)
            try:
                yield
            except KeyError as exc:  # CuPy 13's way of failing on NCCL's codes 6 and 7
                error = gpu.nccl_status_error(exc)
                if error is None:
                    raise
                raise error from None
            finally:
                self._fence = None

    def _result(self, shape, dtype):
        """A new device array for a result (inside `_on`)."""
        return self._fence.empty(shape, dtype)

    def _finish(self, lane, entries, names, activity, results, keep=None, phases=None,
                timing=None):
        """Records the completion event (inside `_on`) and gives the entries
        their DeviceWait, which carries the operation's `results` (valid in
        stream order once everything is queued) and its `timing` (start event,
        bytes: DeviceWait); returns the generator that waits for it."""
        if timing is not None:
            timing = (*timing, lane.times)
        done = gpu.DeviceWait(lane.device, [gpu.record(lane.stream, timed=timing is not None)],
                              keep, lane.comm.check_async_error, results,
                              lets_next_start=True, timing=timing)
        for e in entries:
            if e is not None:
                e.done_event = done
        return self._wait(lane, entries, names, activity, done, phases)

    def _wait(self, lane, entries, names, activity, done, phases=None):
        """Waits for `done`, polling the lane's communicator for errors
        meanwhile: a removed set's lane is destroyed only once no operation
        does (_release)."""
        lane.waiting += 1
        try:
            yield from self._wait_for(lane, entries, names, activity, done, phases)
        finally:
            lane.waiting -= 1
            if lane.removed and not lane.waiting:
                self._release(lane)

    def _wait_for(self, lane, entries, names, activity, done, phases):
        timeline = self.timeline
        if not timeline.enabled:
            yield done
            return
        ready = gpu.ready_events(entries)
        if ready:
            timeline.activity_start(names, "WAIT_FOR_DATA")
            yield gpu.DeviceWait(lane.device, ready, check=lane.comm.check_async_error)
            timeline.activity_end(names)
        started = timeline.activity_start(names, activity)
        yield done
        if phases is not None:
            for label, start, end in phases.spans(timeline.now(), started):
                timeline.span(names, label, start, end)
        timeline.activity_end(names)

    def _phases(self, stream):
        return _Phases(self.cp, stream, self.timeline.enabled)

    def _outputs(self, response, entries):
        """Each entry's output: its own, or a new device array (inside `_on`)."""
        storage = self._storage(response.dtype)
        return [e.output if e.output is not None
                else self._result(e.shape, gpu.result_dtype(e, storage)) for e in entries]

    @staticmethod
    def _storage(wire):
        return gpu.storage_dtype(dtypes.BY_WIRE[wire].dtype)

    def _reduction(self, response, lane):
        """(tensor kind, buffer kind, buffer dtype, NCCL type, NCCL op, divisor)."""
        kind = dtypes.BY_WIRE[response.dtype].name
        if response.dtype in (pb.INT16, pb.UINT16):  # no NCCL type: widened
            buf_kind, buf_dtype, ntype = "int32", np.dtype(np.int32), self.nccl.NCCL_INT32
        else:
            buf_kind, buf_dtype = kind, self._storage(response.dtype)
            ntype = self._types[response.dtype]
        divisor = lane.size if response.reduce_op == pb.AVERAGE else 1
        return kind, buf_kind, buf_dtype, ntype, self._ops[response.reduce_op], divisor

    # ----------------------------------------------------------- allreduce
    def allreduce(self, response, entries, names):
        """One tensor: reduced from the input straight into the output. Several
        (a fused response): one pack kernel into the fusion buffer, one NCCL
        call, one unpack kernel into the outputs."""
        lane = yield from self._lane(response, entries)
        if self._two_level(response):
            outputs = yield from self._allreduce_two_level(response, entries, names, lane)
            return outputs
        kind, buf_kind, buf_dtype, ntype, op, divisor = self._reduction(response, lane)
        pre, post = response.prescale, response.postscale
        cp, stream = self.cp, lane.stream
        total = sum(e.tensor.size for e in entries)
        with self._on(lane, entries):
            outputs = self._outputs(response, entries)  # (behind their fence, if any)
            # Timed from here, where its inputs are ready and its outputs free
            # (no call: nothing to time).
            timing = ((gpu.record(stream, timed=True), total * buf_dtype.itemsize)
                      if total else None)
            phases = self._phases(stream)
            if len(entries) == 1 and buf_kind == kind:
                src, out = entries[0].tensor, outputs[0]
                if out.size:
                    if pre != 1.0:
                        self.kernels.pack(lane.tables, stream, [(src.data.ptr, src.size)], out,
                                          kind, kind, pre)
                        phases.mark("PRESCALE")
                        src = out
                    lane.comm.allReduce(src.data.ptr, out.data.ptr, out.size, ntype, op,
                                        stream.ptr)
                    phases.mark("NCCL_ALLREDUCE")
                    self.kernels.unpack(lane.tables, stream, out, [(out.data.ptr, out.size)],
                                        kind, kind, post, divisor)
                    phases.mark("POSTSCALE")
            elif total:
                buf = lane.buffer(cp, "reduce", total, buf_dtype)
                self.kernels.pack(lane.tables, stream,
                                  [(e.tensor.data.ptr, e.tensor.size) for e in entries],
                                  buf, kind, buf_kind, pre)
                phases.mark("MEMCPY_IN_FUSION_BUFFER")
                lane.comm.allReduce(buf.data.ptr, buf.data.ptr, total, ntype, op,
                                    stream.ptr)
                phases.mark("NCCL_ALLREDUCE")
                self.kernels.unpack(lane.tables, stream, buf,
                                    [(o.data.ptr, o.size) for o in outputs], buf_kind,
                                    kind, post, divisor)
                phases.mark("MEMCPY_OUT_FUSION_BUFFER")
            wait = self._finish(lane, entries, names, "NCCL_ALLREDUCE", outputs, phases=phases,
                                timing=timing)
        yield from wait
        return outputs

    def _allreduce_two_level(self, response, entries, names, lane):
        """Reduce-scatter in the host, allreduce across hosts, allgather in
        the host (see the module doc), between one pack and one unpack."""
        topo = self.topology
        local = yield from self._open_group("local", topo.local_ranks, LOCAL_TAG, lane)
        cross = yield from self._open_group("cross", topo.cross_ranks, CROSS_TAG, lane)
        self.two_level_calls += 1
        kind, buf_kind, buf_dtype, ntype, op, divisor = self._reduction(response, lane)
        cp, stream = self.cp, lane.stream
        with self._on(lane, entries):
            outputs = self._outputs(response, entries)
            phases = self._phases(stream)
            total = sum(e.tensor.size for e in entries)
            if total:
                share = _aligned_share(total, local.size, buf_dtype.itemsize)
                buf = lane.buffer(cp, "reduce", share * local.size, buf_dtype)
                self.kernels.pack(lane.tables, stream,
                                  [(e.tensor.data.ptr, e.tensor.size) for e in entries],
                                  buf, kind, buf_kind, response.prescale)
                phases.mark("MEMCPY_IN_FUSION_BUFFER")
                mine = buf[local.rank * share:(local.rank + 1) * share]
                # In place, as NCCL defines it: recv = send + rank * count.
                local.comm.reduceScatter(buf.data.ptr, mine.data.ptr, share, ntype, op,
                                         stream.ptr)
                phases.mark("NCCL_REDUCESCATTER")
                cross.comm.allReduce(mine.data.ptr, mine.data.ptr, share, ntype, op,
                                     stream.ptr)
                phases.mark("NCCL_ALLREDUCE")
                local.comm.allGather(mine.data.ptr, buf.data.ptr, share, ntype, stream.ptr)
                phases.mark("NCCL_ALLGATHER")
                self.kernels.unpack(lane.tables, stream, buf[:total],
                                    [(o.data.ptr, o.size) for o in outputs], buf_kind, kind,
                                    response.postscale, divisor)
                phases.mark("MEMCPY_OUT_FUSION_BUFFER")
            wait = self._finish(lane, entries, names, "NCCL_HIERARCHICAL_ALLREDUCE", outputs,
                                phases=phases)
        yield from wait
        return outputs

    # ----------------------------------------------------------- allgather
    def allgather(self, response, entries, names):
        """Every rank's rows land in place in each output: per tensor and per
        rank one ncclBroadcast of that rank's bytes, all in one NCCL group."""
        lane = yield from self._lane(response, entries)
        size, me = lane.size, lane.rank
        storage = self._storage(response.dtype)
        rows = np.asarray(response.sizes, dtype=np.int64).reshape(len(entries), size)
        with self._on(lane, entries):
            outputs = [self._result((int(rows[i].sum()),) + tuple(e.shape[1:]),
                                    gpu.result_dtype(e, storage))
                       for i, e in enumerate(entries)]
            self.nccl.groupStart()
            try:
                for e, out, counts in zip(entries, outputs, rows):
                    row_bytes = _row_elems(e.shape) * storage.itemsize
                    for root, start in enumerate(_starts(counts * row_bytes)):
                        dst = out.data.ptr + start
                        src = e.tensor.data.ptr if root == me else dst
                        for at, nbytes in _pieces(int(counts[root]) * row_bytes):
                            lane.comm.broadcast(src + at, dst + at, nbytes,
                                                self.nccl.NCCL_UINT8, root, lane.stream.ptr)
            finally:
                self.nccl.groupEnd()
            wait = self._finish(lane, entries, names, "NCCL_ALLGATHER", outputs)
        yield from wait
        return outputs

    # ----------------------------------------------------------- broadcast
    def broadcast(self, response, entries, names, root):
        """One ncclBroadcast of bytes per tensor, in one NCCL group. A fused
        broadcast may mix dtypes (the response's is its first tensor's), so
        each output takes its own tensor's."""
        lane = yield from self._lane(response, entries)
        with self._on(lane, entries):
            outputs = [e.output if e.output is not None
                       else self._result(e.shape, gpu.result_dtype(
                           e, gpu.storage_dtype(e.dtype_info.dtype)))
                       for e in entries]
            self.nccl.groupStart()
            try:
                for e, out in zip(entries, outputs):
                    for at, nbytes in _pieces(out.nbytes):
                        lane.comm.broadcast(e.tensor.data.ptr + at, out.data.ptr + at, nbytes,
                                            self.nccl.NCCL_UINT8, root, lane.stream.ptr)
            finally:
                self.nccl.groupEnd()
            wait = self._finish(lane, entries, names, "NCCL_BCAST", outputs)
        yield from wait
        return outputs

    # ------------------------------------------------------------ alltoall
    def alltoall(self, response, entries, names):
        """splits[i] rows to rank i: grouped send/recv; this rank's own rows by
        a device copy."""
        lane = yield from self._lane(response, entries)
        size, me = lane.size, lane.rank
        e = entries[0]
        storage = self._storage(response.dtype)
        splits = np.asarray(response.sizes, dtype=np.int64).reshape(size, size)
        row_bytes = _row_elems(e.shape) * storage.itemsize
        send_counts, recv_rows = splits[me] * row_bytes, splits[:, me].copy()
        recv_counts = recv_rows * row_bytes
        send_starts, recv_starts = _starts(send_counts), _starts(recv_counts)
        cp, stream = self.cp, lane.stream
        with self._on(lane, entries):
            out = self._result((int(recv_rows.sum()),) + tuple(e.shape[1:]),
                               gpu.result_dtype(e, storage))
            src, dst = e.tensor.data.ptr, out.data.ptr
            if recv_counts[me]:
                cp.cuda.runtime.memcpyAsync(dst + recv_starts[me], src + send_starts[me],
                                            int(recv_counts[me]),
                                            cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
            self.nccl.groupStart()
            try:
                for peer in range(size):
                    if peer == me:
                        continue
                    for at, nbytes in _pieces(int(send_counts[peer])):
                        lane.comm.send(src + int(send_starts[peer]) + at, nbytes,
                                       self.nccl.NCCL_UINT8, peer, stream.ptr)
                    for at, nbytes in _pieces(int(recv_counts[peer])):
                        lane.comm.recv(dst + int(recv_starts[peer]) + at, nbytes,
                                       self.nccl.NCCL_UINT8, peer, stream.ptr)
            finally:
                self.nccl.groupEnd()
            results = [(out, recv_rows)]
            wait = self._finish(lane, entries, names, "NCCL_ALLTOALL", results)
        yield from wait
        return results

    # ------------------------------------------------------- reducescatter
    def reducescatter(self, response, entries, names):
        """Ranks get unequal shares (the first n % size one row more); NCCL's
        reduce-scatter takes equal ones: the pack kernel lays out rank r's rows
        of every tensor as block r, each block padded to the largest, one
        ncclReduceScatter reduces, and the unpack kernel scales this rank's
        block into its outputs."""
        lane = yield from self._lane(response, entries)
        size, me = lane.size, lane.rank
        kind, buf_kind, buf_dtype, ntype, op, divisor = self._reduction(response, lane)
        storage = self._storage(response.dtype)
        item = storage.itemsize
        rows = [reducescatter_rows(e.shape[0], size) for e in entries]
        row_elems = [_row_elems(e.shape) for e in entries]
        blocks = [sum(rows[i][r] * row_elems[i] for i in range(len(entries)))
                  for r in range(size)]
        block = max(blocks)
        segments, taken = [], [0] * len(entries)
        for r in range(size):
            for i, e in enumerate(entries):
                n = rows[i][r] * row_elems[i]
                segments.append((e.tensor.data.ptr + taken[i] * item, n))
                taken[i] += n
            if blocks[r] < block:
                segments.append((0, block - blocks[r]))  # padding
        cp, stream = self.cp, lane.stream
        with self._on(lane, entries):
            outputs = [self._result((rows[i][me],) + tuple(e.shape[1:]),
                                    gpu.result_dtype(e, storage))
                       for i, e in enumerate(entries)]
            if block:
                send = lane.buffer(cp, "send", block * size, buf_dtype)
                recv = lane.buffer(cp, "recv", block, buf_dtype)
                self.kernels.pack(lane.tables, stream, segments, send, kind, buf_kind,
                                  response.prescale)
                lane.comm.reduceScatter(send.data.ptr, recv.data.ptr, block, ntype, op,
                                        stream.ptr)
                self.kernels.unpack(lane.tables, stream, recv,
                                    [(o.data.ptr, o.size) for o in outputs], buf_kind, kind,
                                    response.postscale, divisor)
            wait = self._finish(lane, entries, names, "NCCL_REDUCESCATTER", outputs)
        yield from wait
        return outputs

    # ------------------------------------------------------------ send/recv
    def p2p(self, response, entries, names, pair):
        """`pair`: the sender's and the receiver's ranks in the set."""
        lane = yield from self._pair_lane(response, entries, pair)
        sending = self.comms.world.rank == response.ranks[0]
        peer = 1 - lane.rank  # in the pair's communicator
        spec = response.specs[0]
        with self._on(lane, entries):
            if sending:
                data, result, activity = entries[0].tensor, None, "NCCL_SEND"
                for at, nbytes in _pieces(data.nbytes):
                    lane.comm.send(data.data.ptr + at, nbytes, self.nccl.NCCL_UINT8, peer,
                                   lane.stream.ptr)
            else:
                result = self._result(tuple(spec.shape), self._storage(spec.dtype))
                activity = "NCCL_RECV"
                for at, nbytes in _pieces(result.nbytes):
                    lane.comm.recv(result.data.ptr + at, nbytes, self.nccl.NCCL_UINT8,
                                   peer, lane.stream.ptr)
            wait = self._finish(lane, entries, names, activity, [result])
        yield from wait
        return [result]


# Bytes moved by one NCCL call at most: some CuPy releases take broadcast's
# count as a C int, which 2 GiB or more overflows (OverflowError).
PIECE_BYTES = 1 << 30


def _pieces(nbytes):
    """(offset, length) of the calls that move `nbytes` bytes, in order
    (none for 0)."""
    return [(at, min(PIECE_BYTES, nbytes - at)) for at in range(0, nbytes, PIECE_BYTES)]


def _id_bytes(uid):
    """NCCL's unique id as bytes (CuPy 14 gives bytes, older a tuple of C
    chars: signed or not, as the platform's char is)."""
    if isinstance(uid, (bytes, bytearray)):
        return bytes(uid)
    return bytes(c & 0xFF for c in uid)
