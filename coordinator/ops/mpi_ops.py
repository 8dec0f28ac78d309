"""Moving bytes with MPI: the CPU backend.

Each method runs one planned Response on the entries this rank holds for it,
in the order the Response lists them. It is a generator (see executor.py):
it starts non-blocking MPI calls, yields what to wait for (`Requests`), and
returns one result per entry, so a collective in flight never blocks the
background thread. The order was decided by the controller; nothing here
decides anything.

The backend owns its communicators: one per process set, made by the
members alone (`Create_group`) as the set is registered (at init, or as
add_process_set's answer runs, at the same point on every rank), and freed
when the set is removed; the host-aware algorithms get theirs on their
first operation, which every member runs. Not on the set's first
operation: a send/recv is run by two of its members, and the others may
never reach it (made there, the first send/recv of a set of three or more
waited for ever). `Create_group` blocks until every member has called it,
so a communicator is made in a helper thread, and an operation waits for
it like for any request: a member stopped just then leaves the background
thread free to answer, and the watchdog names the stopped one (rather
than the others naming this rank as silent). Its dtype policy is in
mpi_reduce.py.

Device (CUDA) tensors never reach this backend: they go through NCCL
(nccl_ops.py) or are staged through pinned host memory (staging.py), which
hands it host arrays. `mpi_cuda_aware()` says whether the MPI library could
take device memory at all.

Counts past what MPI's int arguments hold (2**31 - 1 elements or bytes; this
Open MPI implements MPI 3.1, without the large-count calls) are split: a
broadcast into pieces, an allreduce into segments, an allgather into one
broadcast per rank, an alltoall into point-to-point pieces, a reducescatter
into an allreduce.
"""

import collections
import ctypes
import threading
import time

import numpy as np
from mpi4py import MPI

from coordinator import dtypes
from coordinator.fusion import as_bytes, copy_scaled, pack, scale_inplace, unpack
from coordinator.ops.mpi_reduce import reduction
from coordinator.wire import pb

# The largest count one MPI call takes (its count arguments are C ints).
INT_MAX = 2 ** 31 - 1
# Pieces of a call that would pass INT_MAX.
PIECE = 1 << 30
ALLTOALL_TAG = 78
P2P_TAG = 79
PAIR_ID_TAG = 80  # a send/recv pair's NCCL id, and its answer (nccl_ops)
# Tags of Create_group: 1-4 for the host-aware algorithms (5 and 6 for their
# NCCL version's id exchange, nccl_ops), SET_TAG + id for sets,
# DEVICE_SET_TAG + id for the sets' communicators of the device lanes.
SET_TAG = 1000
DEVICE_SET_TAG = 20000


class Requests:
    """What an MPI step waits for: non-blocking requests."""

    __slots__ = ("requests",)

    def __init__(self, requests):
        self.requests = requests

    def ready(self):
        reqs = self.requests
        return reqs[0].Test() if len(reqs) == 1 else MPI.Request.Testall(reqs)


def wait(*requests):
    return Requests(list(requests))


class Communicators:
    """This rank's communicators, one per process set it belongs to, made
    from `world` and the set's members as the set is registered (`start`),
    or on first use.

    The device lanes of a set get a Communicators of their own
    (`tag=DEVICE_SET_TAG, reuse_world=False`): a set's device and host lanes
    run side by side, and collectives on one communicator must start in the
    same order on every member."""

    def __init__(self, world, members, tag=SET_TAG, reuse_world=True, order=None):
        self.world = world
        self.members = members  # process set id -> its global ranks
        self.tag = tag
        # Sets' communicators are made one at a time, in the order asked
        # (InOrder), shared by every Communicators of `world`.
        self.order = order if order is not None else InOrder()
        self._comms = {0: world} if reuse_world else {}
        self._making = {}  # process set id -> Making under way

    def __getitem__(self, process_set_id):
        """The set's communicator, made now if need be (blocks until every
        member makes it: `when_ready` does not)."""
        comm = self._comms.get(process_set_id)
        if comm is None:
            making = self._start(process_set_id)
            making.done.wait()
            comm = self._take(process_set_id, making)
        return comm

    get = __getitem__

    def when_ready(self, process_set_id):
        """A generator (for a backend's operation): yields while the set's
        communicator is made in a helper thread, then returns it."""
        comm = self._comms.get(process_set_id)
        if comm is not None:
            return comm
        making = self._start(process_set_id)
        yield from making.wait()
        return self._take(process_set_id, making)

    def start(self, process_set_id):
        """Starts making the set's communicator, in a helper thread, where
        this rank is a member. Every member calls it at the same point
        (the set's registration): see the module doc."""
        if process_set_id in self._comms or process_set_id in self._making:
            return
        ranks = self.members(process_set_id)
        if ranks is not None and self.world.rank in ranks:
            self._start(process_set_id)

    def group_when_ready(self, ranks, tag=0):
        """A generator: `group(ranks, tag)` made in a helper thread, yielding
        until it is (every member must reach it: see the module doc)."""
        making = Making(lambda: self.group(ranks, tag))
        yield from making.wait()
        return making.outcome()

    def _start(self, process_set_id):
        making = self._making.get(process_set_id)
        if making is None:
            ranks = self.members(process_set_id)
            if ranks is None or self.world.rank not in ranks:
                raise RuntimeError(f"this rank holds no communicator for process set "
                                   f"{process_set_id}")
            tag = self.tag + process_set_id
            making = self._making[process_set_id] = self.order.make(
                lambda: self.group(ranks, tag))
        return making

    def _take(self, process_set_id, making):
        if self._making.get(process_set_id) is making:
            del self._making[process_set_id]
        comm = self._comms[process_set_id] = making.outcome()
        return comm

    def group(self, ranks, tag=0):
        """A communicator over `ranks` (global), made by those ranks alone."""
        group = self.world.Get_group().Incl(list(ranks))
        try:
            return self.world.Create_group(group, tag)
        finally:
            group.Free()

    def revoke(self):
        from coordinator.control_channel import revoke

        revoke([c for pid, c in self._comms.items()] + [self.world])

    def release(self, process_set_id):
        comm = self._comms.pop(process_set_id, None)
        if comm is not None and comm is not self.world:
            comm.Free()
        making = self._making.pop(process_set_id, None)
        if making is not None:  # never used: freed once made
            making.then(lambda comm: comm.Free())

    @staticmethod
    def share_on(comm, payload, nbytes):
        """Sends `payload` (bytes) from rank 0 of `comm` (a set's communicator,
        or one of group()) to its other ranks, without blocking: returns (a
        bytearray that holds it once the requests are done, their Requests).
        The other ranks pass None. The requests are done on a rank only once
        every rank of `comm` has started them (a barrier goes with the
        broadcast), so what a rank does next with the payload, if it blocks
        until all the others do it too (joining an NCCL communicator), waits
        only for ranks that are on their way."""
        buf = bytearray(nbytes)
        if comm.rank == 0:
            buf[:] = payload
        return buf, Requests([comm.Ibcast([buf, MPI.BYTE], root=0), comm.Ibarrier()])

    @staticmethod
    def share_with(comm, payload, peer, nbytes):
        """share_on for two ranks of `comm` alone: this one and `peer`. The
        one with `payload` sends it; the other (payload None) answers once
        it has it, so the requests are done on either rank only once both
        have started them."""
        buf, answer = bytearray(nbytes), bytearray(1)
        if payload is not None:
            buf[:] = payload
            requests = [comm.Isend([buf, MPI.BYTE], peer, PAIR_ID_TAG),
                        comm.Irecv([answer, MPI.BYTE], peer, PAIR_ID_TAG)]
        else:
            requests = [comm.Irecv([buf, MPI.BYTE], peer, PAIR_ID_TAG),
                        comm.Isend([answer, MPI.BYTE], peer, PAIR_ID_TAG)]
        return buf, Requests(requests)


class Making:
    """A communicator being made in a helper thread (an MPI one here, an NCCL
    one in nccl_ops), for calls that block until every member makes it;
    `ready()` like a request's. `start=False`: the caller runs it (InOrder)."""

    # Those not made yet, for settle(): a helper thread still inside
    # MPI_Comm_create_group when the process finalizes MPI crashes it.
    _unfinished = set()
    _unfinished_lock = threading.Lock()

    def __init__(self, make, start=True):
        self.comm = None
        self.error = None
        self.done = threading.Event()
        self._make = make
        with Making._unfinished_lock:
            Making._unfinished.add(self)
        if start:
            threading.Thread(target=self.run, name="coordinator-communicator",
                             daemon=True).start()

    def run(self):
        try:
            self.comm = self._make()
        except BaseException as exc:  # raised where the operation waits for it
            self.error = exc
        finally:
            self.done.set()
            with Making._unfinished_lock:
                Making._unfinished.discard(self)

    @staticmethod
    def settle(timeout):
        """Waits up to `timeout` seconds for every communicator still being
        made to be made; False if some are not. At shutdown, before MPI may
        be finalized: every member of a registered set makes its
        communicators (in one order, InOrder), so they finish unless a
        member has stopped."""
        deadline = time.monotonic() + timeout
        while True:
            with Making._unfinished_lock:
                pending = list(Making._unfinished)
            if not pending:
                return True
            left = deadline - time.monotonic()
            if left <= 0 or not pending[0].done.wait(left):
                return False

    def ready(self):
        return self.done.is_set()

    def then(self, use):
        """Calls `use(comm)` once it is made (in a helper thread, or now)."""
        def run():
            self.done.wait()
            if self.comm is not None:
                use(self.comm)
        threading.Thread(target=run, name="coordinator-communicator", daemon=True).start()

    def wait(self):
        """A generator: yields this until the communicator is made."""
        while not self.ready():
            yield self

    def outcome(self):
        """The communicator made, or the error making it raised."""
        if self.error is not None:
            raise self.error
        return self.comm


class InOrder:
    """Makes sets' communicators one at a time, in the order asked, in one
    helper thread. Every member asks for a set's communicators at the same
    point (its registration, in the order rounds run), so each rank's order
    is the same as its peers' and no member waits on another's later set.

    Made at once in a thread each, they could wait for ever: Open MPI 5.0
    lets MPI_Comm_create_group calls started together on one parent block
    each other. Sets X = {0, 1, 2} and then Y = {0, 2, 3} (a host and a
    device-lane communicator each): X never finished on its members while
    Y waited for rank 3, which could only come once X's work had run
    (tests/scripts/communicators_in_order.py; found by the random
    collectives with a fake GPU and sets added at run time)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queue = collections.deque()
        self._running = False

    def make(self, make):
        """A Making for `make()`, run once those asked before it are made."""
        making = Making(make, start=False)
        with self._lock:
            self._queue.append(making)
            if self._running:
                return making
            self._running = True
        threading.Thread(target=self._run, name="coordinator-communicators",
                         daemon=True).start()
        return making

    def _run(self):
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                making = self._queue.popleft()
            making.run()


def mpi_cuda_aware(maps="/proc/self/maps"):
    """Whether the MPI library mpi4py loaded says it takes CUDA device memory
    (Open MPI's MPIX_Query_cuda_support); False when it has no such query.
    Handing a device pointer to an MPI that is not CUDA-aware crashes it."""
    path = _loaded_library("libmpi", maps)
    if path is None:
        return False
    try:
        query = ctypes.CDLL(path).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    query.restype = ctypes.c_int
    query.argtypes = []
    return bool(query())


def _loaded_library(stem, maps):
    """The path of the mapped shared library `stem`.so*, or None."""
    try:
        with open(maps) as lines:
            for line in lines:
                fields = line.split(None, 5)
                path = fields[5].strip() if len(fields) == 6 else ""
                name = path.rsplit("/", 1)[-1]
                if name.startswith(stem + ".so"):
                    return path
    except OSError:
        pass
    return None


def _same_memory(a, b):
    return a is b or (a.size > 0 and a.__array_interface__["data"][0]
                      == b.__array_interface__["data"][0] and a.nbytes == b.nbytes)


def _row_elems(shape):
    n = 1
    for d in shape[1:]:
        n *= d
    return n


def _displacements(counts):
    displs = np.zeros(len(counts), dtype=np.int64)
    if len(counts) > 1:
        np.cumsum(counts[:-1], out=displs[1:])
    return displs


def _fits(counts, displs=None):
    """Whether counts (and displacements) fit MPI's int arguments."""
    if len(counts) and int(np.max(counts)) > INT_MAX:
        return False
    if displs is not None and len(displs) and int(np.max(displs)) > INT_MAX:
        return False
    return True


def _pieces(n, step=PIECE):
    return [slice(i, min(i + step, n)) for i in range(0, n, step)] or [slice(0, 0)]


def reducescatter_rows(n, size):
    """Rows of an n-row tensor each of `size` ranks receives: the first
    n % size ranks get one extra row."""
    base, extra = divmod(n, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


class MPIOps:
    name = "mpi"

    def __init__(self, comms, buffers, timeline, rank, algorithms=(), segment_bytes=0):
        self.comms = comms  # Communicators
        # Allreduces larger than this run as consecutive calls of this size.
        self.segment_bytes = segment_bytes
        self.buffers = buffers
        self.timeline = timeline
        self.rank = rank
        # Allreduce algorithms tried before the flat MPI_Allreduce (e.g.
        # hierarchical, 2D-torus); each says which responses it applies to.
        self.algorithms = list(algorithms)

    def enabled(self, response):
        return response.device == -1

    def _comm(self, response):
        """A generator: the response's communicator (see when_ready)."""
        return self.comms.when_ready(response.process_set_id)

    def add_process_set(self, process_set_id):
        self.comms.start(process_set_id)

    def remove_process_set(self, process_set_id):
        self.comms.release(process_set_id)

    def revoke(self):
        self.comms.revoke()

    def zeros(self, shape, dtype, device):
        """A joined rank's stand-in for a tensor it did not submit."""
        return np.zeros(shape, dtype)

    def _buffer(self, response, slot, count, dtype):
        """A fusion buffer of this response's lane (its process set): lanes
        run side by side, so each has its own."""
        return self.buffers.get(slot, count, dtype, lane=response.process_set_id)

    def _activity(self, names, activity):
        if self.timeline.enabled:
            self.timeline.activity_start(names, activity)

    def _activity_end(self, names):
        if self.timeline.enabled:
            self.timeline.activity_end(names)

    def _call(self, names, activity, *requests):
        """Waits for `requests` inside a timeline activity."""
        self._activity(names, activity)
        yield Requests(list(requests))
        self._activity_end(names)

    # ----------------------------------------------------------- allreduce
    def allreduce(self, response, entries, names):
        """Reduces the response's tensors: those below the response's pack
        limit through the fusion buffer, the others where they are (copying a
        large tensor in and out costs more than its own MPI call)."""
        comm = yield from self._comm(response)
        info = dtypes.BY_WIRE[response.dtype]
        rdtype, mpi_type, mpi_op = reduction(info, response.reduce_op)
        divisor = comm.size if response.reduce_op == pb.AVERAGE else 1
        reduce = (comm, self._algorithm(response), mpi_type, mpi_op, response.prescale,
                  response.postscale, divisor)
        outputs = [e.output if e.output is not None else np.empty(e.shape, info.dtype)
                   for e in entries]
        limit = response.pack_limit
        direct, packed = [], []
        for i, e in enumerate(entries):
            big = len(entries) == 1 or (limit and e.tensor.nbytes >= limit)
            # A dtype reduced in another one (bfloat16 without the native
            # kernel) always goes through the buffer, which converts it.
            (direct if big and rdtype == info.dtype else packed).append(i)
        if len(packed) == 1 and rdtype == info.dtype:
            direct.append(packed.pop())
        if packed:
            yield from self._reduce_packed(response, [entries[i].tensor for i in packed],
                                           [outputs[i] for i in packed],
                                           [names[i] for i in packed], rdtype, reduce)
        for i in direct:
            yield from self._reduce_direct(entries[i].tensor, outputs[i], [names[i]], reduce)
        return outputs

    def _reduce_direct(self, src, out, names, reduce):
        comm, algorithm, mpi_type, mpi_op, pre, post, divisor = reduce
        src, out = src.reshape(-1), out.reshape(-1)
        if algorithm is None and pre == 1.0 and not _same_memory(src, out):
            self._activity(names, "MPI_ALLREDUCE")
            for part in self._segments(out.nbytes, out.itemsize):
                yield wait(comm.Iallreduce([src[part], mpi_type], [out[part], mpi_type], mpi_op))
            self._activity_end(names)
        else:
            if pre != 1.0 or not _same_memory(src, out):
                copy_scaled(src, out, pre)
            yield from self._reduce_inplace(comm, algorithm, out, mpi_type, mpi_op, names)
        scale_inplace(out, post, divisor)

    def _reduce_packed(self, response, sources, outputs, names, rdtype, reduce):
        comm, algorithm, mpi_type, mpi_op, pre, post, divisor = reduce
        buf = self._buffer(response, "reduce", sum(s.size for s in sources), rdtype)
        self._activity(names, "MEMCPY_IN_FUSION_BUFFER")
        pack(sources, buf, pre)
        self._activity_end(names)
        yield from self._reduce_inplace(comm, algorithm, buf, mpi_type, mpi_op, names)
        self._activity(names, "MEMCPY_OUT_FUSION_BUFFER")
        unpack(buf, outputs, post, divisor)
        self._activity_end(names)

    def _algorithm(self, response):
        for algorithm in self.algorithms:
            if algorithm.applies(response):
                return algorithm
        return None

    def _segments(self, nbytes, itemsize):
        """Slices of at most `segment_bytes` (and at most PIECE elements)
        covering a buffer: Open MPI reduces a large buffer several times
        slower than the same bytes in pieces (see README, Benchmarks)."""
        count = nbytes // itemsize
        step = max(1, self.segment_bytes // itemsize) if self.segment_bytes else count
        step = min(step, PIECE)
        if count <= step:
            return (slice(0, count),)
        return [slice(i, min(i + step, count)) for i in range(0, count, step)]

    def _reduce_inplace(self, comm, algorithm, buf, mpi_type, mpi_op, names):
        if algorithm is None:
            self._activity(names, "MPI_ALLREDUCE")
            for part in self._segments(buf.nbytes, buf.itemsize):
                yield wait(comm.Iallreduce(MPI.IN_PLACE, [buf[part], mpi_type], mpi_op))
            self._activity_end(names)
        else:
            yield from algorithm.allreduce_inplace(buf, mpi_type, mpi_op, names,
                                                   self._activity, self._activity_end)

    # ----------------------------------------------------------- allgather
    def allgather(self, response, entries, names):
        comm = yield from self._comm(response)
        size = comm.size
        me = comm.rank
        info = dtypes.BY_WIRE[response.dtype]
        item = info.dtype.itemsize
        rows = np.asarray(response.sizes, dtype=np.int64).reshape(len(entries), size)
        row_bytes = [_row_elems(e.shape) * item for e in entries]
        outputs = [np.empty((int(rows[i].sum()),) + tuple(e.shape[1:]), info.dtype)
                   for i, e in enumerate(entries)]
        if len(entries) == 1:
            counts = rows[0] * row_bytes[0]
            yield from self._allgatherv(comm, as_bytes(entries[0].tensor),
                                        as_bytes(outputs[0]), counts, names)
            return outputs
        # Fused: rank r's block holds its rows of every tensor, in order.
        seg = rows * np.asarray(row_bytes, dtype=np.int64)[:, None]  # tensor x rank bytes
        counts = seg.sum(axis=0)
        displs = _displacements(counts)
        send = self._buffer(response, "send", int(counts[me]), np.uint8)
        recv = self._buffer(response, "recv", int(counts.sum()), np.uint8)
        self._activity(names, "MEMCPY_IN_FUSION_BUFFER")
        pack([as_bytes(e.tensor) for e in entries], send)
        self._activity_end(names)
        yield from self._allgatherv(comm, send, recv, counts, names)
        self._activity(names, "MEMCPY_OUT_FUSION_BUFFER")
        for i, out in enumerate(outputs):
            dst = as_bytes(out)
            pos = 0
            for r in range(size):
                n = int(seg[i, r])
                start = int(displs[r] + seg[:i, r].sum())
                dst[pos:pos + n] = recv[start:start + n]
                pos += n
        self._activity_end(names)
        return outputs

    def _allgatherv(self, comm, send, recv, counts, names):
        """Gathers each rank's `counts[r]` bytes into `recv`, in rank order."""
        displs = _displacements(counts)
        if _fits(counts, displs) and int(counts.sum()) <= INT_MAX:
            yield from self._call(names, "MPI_ALLGATHER", comm.Iallgatherv(
                [send, MPI.BYTE], [recv, (counts, displs), MPI.BYTE]))
            return
        # Past MPI's int counts: each rank broadcasts its block, in pieces.
        me = comm.rank
        start = int(displs[me])
        recv[start:start + int(counts[me])] = send[:int(counts[me])]
        self._activity(names, "MPI_ALLGATHER")
        for root in range(comm.size):
            block = recv[int(displs[root]):int(displs[root] + counts[root])]
            for part in _pieces(block.size):
                yield wait(comm.Ibcast([block[part], MPI.BYTE], root=root))
        self._activity_end(names)

    # ----------------------------------------------------------- broadcast
    def broadcast(self, response, entries, names, root):
        comm = yield from self._comm(response)
        is_root = comm.rank == root
        outputs = [e.output if e.output is not None else np.empty(e.shape, e.dtype_info.dtype)
                   for e in entries]
        if len(entries) == 1:
            src, out = entries[0].tensor, outputs[0]
            if is_root and not _same_memory(src, out):
                np.copyto(out, src)
            yield from self._bcast(comm, as_bytes(out), root, names)
            return outputs
        total = sum(o.nbytes for o in outputs)
        buf = self._buffer(response, "send", total, np.uint8)
        if is_root:
            self._activity(names, "MEMCPY_IN_FUSION_BUFFER")
            pack([as_bytes(e.tensor) for e in entries], buf)
            self._activity_end(names)
        yield from self._bcast(comm, buf, root, names)
        self._activity(names, "MEMCPY_OUT_FUSION_BUFFER")
        unpack(buf, [as_bytes(o) for o in outputs])
        self._activity_end(names)
        return outputs

    def _bcast(self, comm, buf, root, names):
        self._activity(names, "MPI_BCAST")
        for part in _pieces(buf.size):
            yield wait(comm.Ibcast([buf[part], MPI.BYTE], root=root))
        self._activity_end(names)

    # ------------------------------------------------------------ alltoall
    def alltoall(self, response, entries, names):
        comm = yield from self._comm(response)
        size, me = comm.size, comm.rank
        e = entries[0]
        info = e.dtype_info
        splits = np.asarray(response.sizes, dtype=np.int64).reshape(size, size)
        row_bytes = _row_elems(e.shape) * info.dtype.itemsize
        send_counts = splits[me] * row_bytes
        recv_rows = splits[:, me].copy()
        recv_counts = recv_rows * row_bytes
        out = np.empty((int(recv_rows.sum()),) + tuple(e.shape[1:]), info.dtype)
        send, recv = as_bytes(e.tensor), as_bytes(out)
        send_displs, recv_displs = _displacements(send_counts), _displacements(recv_counts)
        self._activity(names, "MPI_ALLTOALL")
        if (_fits(send_counts, send_displs) and _fits(recv_counts, recv_displs)
                and int(send_counts.sum()) <= INT_MAX and int(recv_counts.sum()) <= INT_MAX):
            yield wait(comm.Ialltoallv([send, (send_counts, send_displs), MPI.BYTE],
                                   [recv, (recv_counts, recv_displs), MPI.BYTE]))
        else:  # past MPI's int counts: point-to-point, in pieces
            requests = []
            for peer in range(size):
                src = send[int(send_displs[peer]):int(send_displs[peer] + send_counts[peer])]
                dst = recv[int(recv_displs[peer]):int(recv_displs[peer] + recv_counts[peer])]
                if peer == me:
                    dst[:] = src
                    continue
                for part in _pieces(dst.size):
                    requests.append(comm.Irecv([dst[part], MPI.BYTE], peer, ALLTOALL_TAG))
                for part in _pieces(src.size):
                    requests.append(comm.Isend([src[part], MPI.BYTE], peer, ALLTOALL_TAG))
            yield Requests(requests)
        self._activity_end(names)
        return [(out, recv_rows)]

    # ------------------------------------------------------------ send/recv
    def p2p(self, response, entries, names, pair):
        """Sends the sender's tensor to the receiver; `pair` holds their ranks
        in the set. A lane runs one operation at a time, and both ranks run
        the set's operations in one order, so one tag is enough."""
        comm = yield from self._comm(response)
        sender, receiver = pair
        self._activity(names, "MPI_SEND" if comm.rank == sender else "MPI_RECV")
        if comm.rank == sender:
            data = as_bytes(entries[0].tensor)
            yield Requests([comm.Isend([data[part], MPI.BYTE], receiver, P2P_TAG)
                            for part in _pieces(data.size)])
            result = None
        else:
            spec = response.specs[0]
            result = np.empty(tuple(spec.shape), dtypes.BY_WIRE[spec.dtype].dtype)
            data = as_bytes(result)
            yield Requests([comm.Irecv([data[part], MPI.BYTE], sender, P2P_TAG)
                            for part in _pieces(data.size)])
        self._activity_end(names)
        return [result]

    # ------------------------------------------------------- reducescatter
    def reducescatter(self, response, entries, names):
        comm = yield from self._comm(response)
        size, me = comm.size, comm.rank
        info = dtypes.BY_WIRE[response.dtype]
        rdtype, mpi_type, mpi_op = reduction(info, response.reduce_op)
        divisor = size if response.reduce_op == pb.AVERAGE else 1
        rows = [reducescatter_rows(e.shape[0], size) for e in entries]
        row_elems = [_row_elems(e.shape) for e in entries]
        outputs = [np.empty((rows[i][me],) + tuple(e.shape[1:]), info.dtype)
                   for i, e in enumerate(entries)]
        # Rank-major layout: rank r's rows of every tensor, then rank r+1's.
        counts = np.array([sum(rows[i][r] * row_elems[i] for i in range(len(entries)))
                           for r in range(size)], dtype=np.int64)
        total = int(counts.sum())
        send = self._buffer(response, "send", total, rdtype)
        recv = self._buffer(response, "recv", int(counts[me]), rdtype)
        self._activity(names, "MEMCPY_IN_FUSION_BUFFER")
        offset = 0
        starts = [0] * len(entries)
        for r in range(size):
            for i, e in enumerate(entries):
                flat = e.tensor.reshape(-1)
                begin = starts[i]
                n = rows[i][r] * row_elems[i]
                copy_scaled(flat[begin:begin + n], send[offset:offset + n], response.prescale)
                starts[i] += n
                offset += n
        self._activity_end(names)
        if _fits(counts):
            yield from self._call(names, "MPI_REDUCESCATTER", comm.Ireduce_scatter(
                [send, mpi_type], [recv, mpi_type], counts, mpi_op))
        else:  # past MPI's int counts: reduce everything, keep this rank's share
            yield from self._reduce_inplace(comm, None, send, mpi_type, mpi_op, names)
            start = int(counts[:me].sum())
            recv[:] = send[start:start + int(counts[me])]
        self._activity(names, "MEMCPY_OUT_FUSION_BUFFER")
        unpack(recv, outputs, response.postscale, divisor)
        self._activity_end(names)
        return outputs
