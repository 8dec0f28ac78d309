"""Adasum allreduce on the CPU (Maleki et al., "Scaling Distributed Training
with Adaptive Summation", MLSys 2021).

Two gradients a and b combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

which is their sum when they are orthogonal and their average when they are
equal. Ranks combine pairwise in a binary tree (recursive doubling: at level
k a rank exchanges its current vector with rank ^ 2^k), each tensor of a
fused buffer separately, as Horovod does per layer. Both partners evaluate
the formula with the lower rank's vector as `a`, so every rank ends with
bit-identical results. With a rank count that is not a power of two, the
ranks past the largest power of two first fold into a partner and receive
the result at the end.
"""

import numpy as np

from coordinator import dtypes
from coordinator.fusion import pack, unpack
from coordinator.ops.mpi_ops import wait
from coordinator.wire import pb

TAG = 77


# Squared norms that float32 holds without losing the squares of the
# vector's elements to underflow or overflow.
_SAFE_NORMS = (1e-20, 1e30)


def _dots(x, y):
    """(x.y, x.x, y.y). Horovod accumulates them in double; BLAS's float32
    dot is seven times faster than one accumulated in float64, and as good
    where the squares neither underflow nor overflow. Elsewhere (values
    below about 1e-19, where the squares vanish and the formula fell back to
    the plain sum, twice the average of equal vectors; or above about 1e19)
    they are computed again in float64."""
    dot, nx, ny = float(np.dot(x, y)), float(np.dot(x, x)), float(np.dot(y, y))
    low, high = _SAFE_NORMS
    if x.dtype != np.float64 and not (low < nx < high and low < ny < high):
        x, y = x.astype(np.float64), y.astype(np.float64)
        dot, nx, ny = float(np.dot(x, y)), float(np.dot(x, x)), float(np.dot(y, y))
    return dot, nx, ny


def combine(a, b, segments):
    """adasum(a, b) for each [start, end) segment; returns a new array."""
    out = np.empty_like(a)
    for start, end in segments:
        x, y = a[start:end], b[start:end]
        dot, nx, ny = _dots(x, y)
        cx = 1.0 - dot / (2.0 * nx) if nx > 0 else 1.0
        cy = 1.0 - dot / (2.0 * ny) if ny > 0 else 1.0
        np.multiply(x, cx, out=out[start:end])
        out[start:end] += cy * y
    return out


def adasum_vectors(comm, vec, segments):
    """Runs the Adasum tree over `comm` with non-blocking calls, yielding
    their requests (see executor.py); returns the combined vector."""
    size, rank = comm.size, comm.rank
    p2 = 1
    while p2 * 2 <= size:
        p2 *= 2
    other = np.empty_like(vec)
    if rank >= p2:  # fold into a partner, wait for the answer
        yield wait(comm.Isend(vec, dest=rank - p2, tag=TAG))
        yield wait(comm.Irecv(vec, source=rank - p2, tag=TAG))
        return vec
    if rank + p2 < size:
        yield wait(comm.Irecv(other, source=rank + p2, tag=TAG))
        vec = combine(vec, other, segments)
    distance = 1
    while distance < p2:
        partner = rank ^ distance
        yield wait(comm.Isend(vec, dest=partner, tag=TAG),
                   comm.Irecv(other, source=partner, tag=TAG))
        vec = combine(vec, other, segments) if rank < partner else combine(other, vec, segments)
        distance *= 2
    if rank + p2 < size:
        yield wait(comm.Isend(vec, dest=rank + p2, tag=TAG))
    return vec


class AdasumOps:
    name = "adasum"

    def __init__(self, comms, timeline):
        self.comms = comms  # mpi_ops.Communicators, shared with the MPI backend
        self.timeline = timeline

    def enabled(self, response):
        return (response.op == pb.ALLREDUCE and response.reduce_op == pb.ADASUM
                and response.device == -1)

    def zeros(self, shape, dtype, device):
        return np.zeros(shape, dtype)

    def allreduce(self, response, entries, names):
        comm = yield from self.comms.when_ready(response.process_set_id)
        info = dtypes.BY_WIRE[response.dtype]
        # Accumulate in at least float32; float64 stays float64.
        work = np.float64 if info.dtype == np.float64 else np.float32
        total = sum(e.tensor.size for e in entries)
        vec = np.empty(total, work)
        pack([e.tensor for e in entries], vec, response.prescale)
        segments, start = [], 0
        for e in entries:
            segments.append((start, start + e.tensor.size))
            start += e.tensor.size
        if self.timeline.enabled:
            self.timeline.activity_start(names, "ADASUM")
        vec = yield from adasum_vectors(comm, vec, segments)
        if self.timeline.enabled:
            self.timeline.activity_end(names)
        outputs = [e.output if e.output is not None else np.empty(e.shape, info.dtype)
                   for e in entries]
        unpack(vec, outputs, response.postscale)
        return outputs
