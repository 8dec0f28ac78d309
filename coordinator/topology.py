"""Where the ranks are: local (same host) and cross (same local rank) groups.

Computed from every rank's host name, gathered once at `init` over the
control transport; no communicator is made here (the MPI backend builds the
host and cross-host communicators it needs from these rank lists).

`COORDINATOR_SIMULATED_LOCAL_SIZE` fixes the number of ranks per host, so
hierarchical algorithms can be exercised on one machine: ranks
[0, L), [L, 2L), ... then count as separate hosts.
"""


class Topology:
    def __init__(self, rank, hosts, simulated=False):
        """`hosts`: a host key per rank, indexed by rank."""
        self.hosts = list(hosts)
        order = list(dict.fromkeys(self.hosts))  # hosts in order of their lowest rank
        self.local_ranks = [r for r, h in enumerate(self.hosts) if h == self.hosts[rank]]
        self.local_rank = self.local_ranks.index(rank)
        self.local_size = len(self.local_ranks)
        self.host_ranks = [[r for r, h in enumerate(self.hosts) if h == host] for host in order]
        self.cross_ranks = sorted(ranks[self.local_rank] for ranks in self.host_ranks
                                  if len(ranks) > self.local_rank)
        self.cross_rank = self.cross_ranks.index(rank)
        self.cross_size = len(self.cross_ranks)
        self.homogeneous = len({len(ranks) for ranks in self.host_ranks}) == 1
        self.simulated = simulated

    @classmethod
    def discover(cls, rank, hostnames, local_size_override=0):
        """The layout of ranks whose host names are `hostnames` (indexed by
        rank), or of simulated hosts of `local_size_override` ranks each."""
        size = len(hostnames)
        if local_size_override:
            if size % local_size_override:
                raise ValueError(
                    f"COORDINATOR_SIMULATED_LOCAL_SIZE={local_size_override} does not divide "
                    f"the {size} ranks into equal hosts")
            return cls(rank, [r // local_size_override for r in range(size)], simulated=True)
        return cls(rank, hostnames)
