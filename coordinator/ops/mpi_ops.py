"""Moving bytes with MPI: the CPU backend.

Each method runs one planned Response on the entries this rank holds for it,
in the order the Response lists them, and returns one result per entry. The
order was decided by the controller; nothing here decides anything.
"""

import numpy as np
from mpi4py import MPI

from coordinator import dtypes, native
from coordinator.fusion import as_bytes, copy_scaled, pack, scale_inplace, unpack
from coordinator.wire import pb


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


def reducescatter_rows(n, size):
    """Rows of an n-row tensor each of `size` ranks receives: the first
    n % size ranks get one extra row."""
    base, extra = divmod(n, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


class MPIOps:
    name = "mpi"

    def __init__(self, comms, buffers, timeline, rank, algorithms=(), segment_bytes=0):
        self.comms = comms  # process set id -> communicator (this rank's sets)
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
        comm = self.comms.get(response.process_set_id)
        if comm is None:
            raise RuntimeError(f"this rank holds no communicator for process set "
                               f"{response.process_set_id}")
        return comm

    def _activity(self, names, activity):
        if self.timeline.enabled:
            self.timeline.activity_start(names, activity)

    def _activity_end(self, names):
        if self.timeline.enabled:
            self.timeline.activity_end(names)

    # ----------------------------------------------------------- allreduce
    def allreduce(self, response, entries, names):
        """Reduces the response's tensors: those below the response's pack
        limit through the fusion buffer, the others where they are (copying a
        large tensor in and out costs more than its own MPI call)."""
        comm = self._comm(response)
        info = dtypes.BY_WIRE[response.dtype]
        rdtype, mpi_type, mpi_op = native.reduction(info, response.reduce_op)
        post = response.postscale
        if response.reduce_op == pb.AVERAGE:
            post = post / comm.size
        reduce = (comm, self._algorithm(response), mpi_type, mpi_op, response.prescale, post)
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
            self._reduce_packed([entries[i].tensor for i in packed],
                                [outputs[i] for i in packed], [names[i] for i in packed],
                                rdtype, reduce)
        for i in direct:
            self._reduce_direct(entries[i].tensor, outputs[i], [names[i]], reduce)
        return outputs

    def _reduce_direct(self, src, out, names, reduce):
        comm, algorithm, mpi_type, mpi_op, pre, post = reduce
        src, out = src.reshape(-1), out.reshape(-1)
        if algorithm is None and pre == 1.0 and not _same_memory(src, out):
            self._activity(names, "MPI_ALLREDUCE")
            for part in self._segments(out.nbytes, out.itemsize):
                comm.Allreduce([src[part], mpi_type], [out[part], mpi_type], mpi_op)
            self._activity_end(names)
        else:
            if pre != 1.0 or not _same_memory(src, out):
                copy_scaled(src, out, pre)
            self._reduce_inplace(comm, algorithm, out, mpi_type, mpi_op, names)
        scale_inplace(out, post)

    def _reduce_packed(self, sources, outputs, names, rdtype, reduce):
        comm, algorithm, mpi_type, mpi_op, pre, post = reduce
        buf = self.buffers.get("reduce", sum(s.size for s in sources), rdtype)
        self._activity(names, "MEMCPY_IN_FUSION_BUFFER")
        pack(sources, buf, pre)
        self._activity_end(names)
        self._reduce_inplace(comm, algorithm, buf, mpi_type, mpi_op, names)
        self._activity(names, "MEMCPY_OUT_FUSION_BUFFER")
        unpack(buf, outputs, post)
        self._activity_end(names)

    def _algorithm(self, response):
        for algorithm in self.algorithms:
            if algorithm.applies(response):
                return algorithm
        return None

    def _segments(self, nbytes, itemsize):
        """Slices of at most `segment_bytes` covering a buffer: Open MPI reduces
        a large buffer several times slower than the same bytes in pieces
        (see README, Benchmarks)."""
        count = nbytes // itemsize
        step = max(1, self.segment_bytes // itemsize) if self.segment_bytes else count
        if count <= step:
            return (slice(0, count),)
        return [slice(i, min(i + step, count)) for i in range(0, count, step)]

    def _reduce_inplace(self, comm, algorithm, buf, mpi_type, mpi_op, names):
        if algorithm is None:
            self._activity(names, "MPI_ALLREDUCE")
            for part in self._segments(buf.nbytes, buf.itemsize):
                comm.Allreduce(MPI.IN_PLACE, [buf[part], mpi_type], mpi_op)
            self._activity_end(names)
        else:
            algorithm.allreduce_inplace(buf, mpi_type, mpi_op, names, self._activity,
                                        self._activity_end)

    # ----------------------------------------------------------- allgather
    def allgather(self, response, entries, names):
        comm = self._comm(response)
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
            self._activity(names, "MPI_ALLGATHER")
            comm.Allgatherv([as_bytes(entries[0].tensor), MPI.BYTE],
                            [as_bytes(outputs[0]), (counts, _displacements(counts)), MPI.BYTE])
            self._activity_end(names)
            return outputs
        # Fused: rank r's block holds its rows of every tensor, in order.
        seg = rows * np.asarray(row_bytes, dtype=np.int64)[:, None]  # tensor x rank bytes
        counts = seg.sum(axis=0)
        displs = _displacements(counts)
        send = self.buffers.get("send", int(counts[me]), np.uint8)
        recv = self.buffers.get("recv", int(counts.sum()), np.uint8)
        self._activity(names, "MEMCPY_IN_FUSION_BUFFER")
        pack([as_bytes(e.tensor) for e in entries], send)
        self._activity_end(names)
        self._activity(names, "MPI_ALLGATHER")
        comm.Allgatherv([send, MPI.BYTE], [recv, (counts, displs), MPI.BYTE])
        self._activity_end(names)
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

    # ----------------------------------------------------------- broadcast
    def broadcast(self, response, entries, names, root):
        comm = self._comm(response)
        is_root = comm.rank == root
        outputs = [e.output if e.output is not None else np.empty(e.shape, e.dtype_info.dtype)
                   for e in entries]
        if len(entries) == 1:
            src, out = entries[0].tensor, outputs[0]
            if is_root and not _same_memory(src, out):
                np.copyto(out, src)
            self._activity(names, "MPI_BCAST")
            comm.Bcast([as_bytes(out), MPI.BYTE], root=root)
            self._activity_end(names)
            return outputs
        total = sum(o.nbytes for o in outputs)
        buf = self.buffers.get("send", total, np.uint8)
        if is_root:
            self._activity(names, "MEMCPY_IN_FUSION_BUFFER")
            pack([as_bytes(e.tensor) for e in entries], buf)
            self._activity_end(names)
        self._activity(names, "MPI_BCAST")
        comm.Bcast([buf, MPI.BYTE], root=root)
        self._activity_end(names)
        self._activity(names, "MEMCPY_OUT_FUSION_BUFFER")
        unpack(buf, [as_bytes(o) for o in outputs])
        self._activity_end(names)
        return outputs

    # ------------------------------------------------------------ alltoall
    def alltoall(self, response, entries, names):
        comm = self._comm(response)
        size, me = comm.size, comm.rank
        e = entries[0]
        info = e.dtype_info
        splits = np.asarray(response.sizes, dtype=np.int64).reshape(size, size)
        row_bytes = _row_elems(e.shape) * info.dtype.itemsize
        send_counts = splits[me] * row_bytes
        recv_rows = splits[:, me].copy()
        recv_counts = recv_rows * row_bytes
        out = np.empty((int(recv_rows.sum()),) + tuple(e.shape[1:]), info.dtype)
        self._activity(names, "MPI_ALLTOALL")
        comm.Alltoallv([as_bytes(e.tensor), (send_counts, _displacements(send_counts)), MPI.BYTE],
                       [as_bytes(out), (recv_counts, _displacements(recv_counts)), MPI.BYTE])
        self._activity_end(names)
        return [(out, recv_rows)]

    # ------------------------------------------------------- reducescatter
    def reducescatter(self, response, entries, names):
        comm = self._comm(response)
        size, me = comm.size, comm.rank
        info = dtypes.BY_WIRE[response.dtype]
        rdtype, mpi_type, mpi_op = native.reduction(info, response.reduce_op)
        post = response.postscale
        if response.reduce_op == pb.AVERAGE:
            post = post / size
        rows = [reducescatter_rows(e.shape[0], size) for e in entries]
        row_elems = [_row_elems(e.shape) for e in entries]
        outputs = [np.empty((rows[i][me],) + tuple(e.shape[1:]), info.dtype)
                   for i, e in enumerate(entries)]
        # Rank-major layout: rank r's rows of every tensor, then rank r+1's.
        counts = np.array([sum(rows[i][r] * row_elems[i] for i in range(len(entries)))
                           for r in range(size)], dtype=np.int64)
        total = int(counts.sum())
        send = self.buffers.get("send", total, rdtype)
        recv = self.buffers.get("recv", int(counts[me]), rdtype)
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
        self._activity(names, "MPI_REDUCESCATTER")
        comm.Reduce_scatter([send, mpi_type], [recv, mpi_type], counts, mpi_op)
        self._activity_end(names)
        self._activity(names, "MEMCPY_OUT_FUSION_BUFFER")
        unpack(recv, outputs, post)
        self._activity_end(names)
        return outputs
