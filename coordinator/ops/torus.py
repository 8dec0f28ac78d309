"""2D-torus allreduce (HOROVOD_TORUS_ALLREDUCE=1), after Mikami et al.,
"Massively Distributed SGD: ImageNet/ResNet-50 Training in a Flash" (2018).

The ranks form a logical grid: a row is one host (its local ranks), a column
is the ranks with the same local rank on every host. The vector is
reduce-scattered along the row, each rank's share is allreduced along its
column, and the shares are allgathered along the row. Every rank sends
about 2(X-1)/X of the vector in the rows and 2(Y-1)/(XY) of it in the
columns, instead of 2(P-1)/P in one flat ring over all P = XY ranks.
"""

import numpy as np
from mpi4py import MPI

from coordinator.ops.mpi_ops import wait
from coordinator.wire import pb

REDUCIBLE = frozenset({pb.SUM, pb.AVERAGE, pb.MIN, pb.MAX, pb.PRODUCT})


def shares(n, parts):
    """Elements of an n-element vector each of `parts` ranks owns."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def fits(response, topology):
    """Whether a response can run as a 2D torus (here or on NCCL): a
    reduction of the global set, whose hosts are known, on several hosts of
    the same number of ranks (the shares of a row must line up with the
    columns)."""
    return (response.process_set_id == 0 and response.reduce_op in REDUCIBLE
            and topology.homogeneous and topology.local_size > 1
            and topology.cross_size > 1)


class TorusAllreduce:
    name = "torus"

    def __init__(self, comms, topology):
        self.comms = comms  # mpi_ops.Communicators
        self.topology = topology
        self.row = self.column = None  # this host's ranks; same local rank on every host
        self.calls = 0

    def applies(self, response):
        return fits(response, self.topology)

    def allreduce_inplace(self, buf, mpi_type, mpi_op, names, begin, end):
        """A generator of non-blocking steps (see executor.py)."""
        if self.row is None:
            row = yield from self.comms.group_when_ready(self.topology.local_ranks, tag=3)
            column = yield from self.comms.group_when_ready(self.topology.cross_ranks, tag=4)
            self.row, self.column = row, column
        counts = np.array(shares(buf.size, self.row.size), dtype=np.int64)
        displs = np.zeros_like(counts)
        np.cumsum(counts[:-1], out=displs[1:])
        self.calls += 1
        part = np.empty(counts[self.row.rank], buf.dtype)
        begin(names, "MPI_REDUCESCATTER")
        yield wait(self.row.Ireduce_scatter([buf, mpi_type], [part, mpi_type], counts, mpi_op))
        end(names)
        begin(names, "MPI_ALLREDUCE")
        yield wait(self.column.Iallreduce(MPI.IN_PLACE, [part, mpi_type], mpi_op))
        end(names)
        begin(names, "MPI_ALLGATHER")
        yield wait(self.row.Iallgatherv([part, mpi_type], [buf, (counts, displs), mpi_type]))
        end(names)
