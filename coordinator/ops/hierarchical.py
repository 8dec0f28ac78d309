"""Hierarchical allreduce (HOROVOD_HIERARCHICAL_ALLREDUCE=1).

Reduce within each host to its first rank, allreduce among those first ranks
across hosts, then broadcast within each host. Across hosts only one rank per
host sends, so the slow links carry 1/local_size of the flat ring's traffic
at the price of two extra intra-host steps.
"""

from mpi4py import MPI

from coordinator.ops.mpi_ops import wait
from coordinator.ops.torus import REDUCIBLE



class HierarchicalAllreduce:
    name = "hierarchical"

    def __init__(self, comms, topology):
        self.comms = comms  # mpi_ops.Communicators
        self.topology = topology
        self.local = self.cross = None  # made on first use
        self.calls = 0

    def applies(self, response):
        # The global set only: its hosts are known; a subset would need its
        # own host split.
        topo = self.topology
        return (response.process_set_id == 0 and response.reduce_op in REDUCIBLE
                and topo.cross_size > 1 and topo.local_size > 1)

    def allreduce_inplace(self, buf, mpi_type, mpi_op, names, begin, end):
        """A generator of non-blocking steps (see executor.py)."""
        if self.local is None:
            local = yield from self.comms.group_when_ready(self.topology.local_ranks, tag=1)
            cross = yield from self.comms.group_when_ready(self.topology.cross_ranks, tag=2)
            self.local, self.cross = local, cross
        self.calls += 1
        root = self.topology.local_rank == 0
        begin(names, "MPI_REDUCE")
        if root:
            yield wait(self.local.Ireduce(MPI.IN_PLACE, [buf, mpi_type], mpi_op, root=0))
        else:
            yield wait(self.local.Ireduce([buf, mpi_type], None, mpi_op, root=0))
        end(names)
        if root:
            begin(names, "MPI_ALLREDUCE")
            yield wait(self.cross.Iallreduce(MPI.IN_PLACE, [buf, mpi_type], mpi_op))
            end(names)
        begin(names, "MPI_BCAST")
        yield wait(self.local.Ibcast([buf, mpi_type], root=0))
        end(names)
