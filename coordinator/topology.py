"""Where the ranks are: local (same host) and cross (same local rank) groups.

`COORDINATOR_SIMULATED_LOCAL_SIZE` fixes the number of ranks per host, so
hierarchical algorithms can be exercised on one machine: ranks
[0, L), [L, 2L), ... then count as separate hosts.
"""

from mpi4py import MPI


class Topology:
    def __init__(self, local_rank, local_size, cross_rank, cross_size, homogeneous,
                 local_comm, cross_comm, simulated):
        self.local_rank = local_rank
        self.local_size = local_size
        self.cross_rank = cross_rank
        self.cross_size = cross_size
        self.homogeneous = homogeneous
        self.local_comm = local_comm
        self.cross_comm = cross_comm
        self.simulated = simulated

    @classmethod
    def discover(cls, comm, local_size_override=0):
        rank, size = comm.rank, comm.size
        if local_size_override:
            if size % local_size_override:
                raise ValueError(
                    f"COORDINATOR_SIMULATED_LOCAL_SIZE={local_size_override} does not divide "
                    f"the {size} ranks into equal hosts")
            local_comm = comm.Split(rank // local_size_override, rank)
        else:
            local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        local_rank, local_size = local_comm.rank, local_comm.size
        cross_comm = comm.Split(local_rank, rank)
        sizes = comm.allgather(local_size)
        return cls(local_rank, local_size, cross_comm.rank, cross_comm.size,
                   len(set(sizes)) == 1, local_comm, cross_comm, bool(local_size_override))
