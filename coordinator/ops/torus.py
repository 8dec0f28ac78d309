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

from coordinator.wire import pb

REDUCIBLE = frozenset({pb.SUM, pb.AVERAGE, pb.MIN, pb.MAX, pb.PRODUCT})


def shares(n, parts):
    """Elements of an n-element vector each of `parts` ranks owns."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class TorusAllreduce:
    name = "torus"

    def __init__(self, row_comm, column_comm, homogeneous):
        self.row = row_comm  # this host's ranks
        self.column = column_comm  # same local rank on every host
        self.homogeneous = homogeneous
        self.calls = 0

    def applies(self, response):
        return (response.process_set_id == 0 and response.reduce_op in REDUCIBLE
                and self.homogeneous and self.row.size > 1 and self.column.size > 1)

    def allreduce_inplace(self, buf, mpi_type, mpi_op, names, begin, end):
        """A generator of non-blocking steps (see executor.py)."""
        counts = np.array(shares(buf.size, self.row.size), dtype=np.int64)
        displs = np.zeros_like(counts)
        np.cumsum(counts[:-1], out=displs[1:])
        self.calls += 1
        part = np.empty(counts[self.row.rank], buf.dtype)
        begin(names, "MPI_REDUCESCATTER")
        yield [self.row.Ireduce_scatter([buf, mpi_type], [part, mpi_type], counts, mpi_op)]
        end(names)
        begin(names, "MPI_ALLREDUCE")
        yield [self.column.Iallreduce(MPI.IN_PLACE, [part, mpi_type], mpi_op)]
        end(names)
        begin(names, "MPI_ALLGATHER")
        yield [self.row.Iallgatherv([part, mpi_type], [buf, (counts, displs), mpi_type])]
        end(names)
