"""Hierarchical allreduce (HOROVOD_HIERARCHICAL_ALLREDUCE=1).

Reduce within each host to its first rank, allreduce among those first ranks
across hosts, then broadcast within each host. Across hosts only one rank per
host sends, so the slow links carry 1/local_size of the flat ring's traffic
at the price of two extra intra-host steps.
"""

from mpi4py import MPI

from coordinator.wire import pb

REDUCIBLE = frozenset({pb.SUM, pb.AVERAGE, pb.MIN, pb.MAX, pb.PRODUCT})


class HierarchicalAllreduce:
    name = "hierarchical"

    def __init__(self, local_comm, cross_comm, local_rank):
        self.local = local_comm  # the ranks of this host
        self.cross = cross_comm  # the ranks with the same local rank, one per host
        self.local_rank = local_rank
        self.calls = 0

    def applies(self, response):
        # The global set only: its hosts are known; a subset would need its
        # own host split.
        return (response.process_set_id == 0 and response.reduce_op in REDUCIBLE
                and self.cross.size > 1 and self.local.size > 1)

    def allreduce_inplace(self, buf, mpi_type, mpi_op, names, begin, end):
        """A generator of non-blocking steps (see executor.py)."""
        self.calls += 1
        root = self.local_rank == 0
        begin(names, "MPI_REDUCE")
        if root:
            yield [self.local.Ireduce(MPI.IN_PLACE, [buf, mpi_type], mpi_op, root=0)]
        else:
            yield [self.local.Ireduce([buf, mpi_type], None, mpi_op, root=0)]
        end(names)
        if root:
            begin(names, "MPI_ALLREDUCE")
            yield [self.cross.Iallreduce(MPI.IN_PLACE, [buf, mpi_type], mpi_op)]
            end(names)
        begin(names, "MPI_BCAST")
        yield [self.local.Ibcast([buf, mpi_type], root=0)]
        end(names)
