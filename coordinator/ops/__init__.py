"""Backends that move tensor bytes, and the manager that picks one.

A backend exposes one method per operation and says which responses it can
run (`enabled`). The manager asks each backend in turn, so a new engine (NCCL)
or algorithm (hierarchical, 2D-torus) is one new backend placed ahead of the
plain MPI one.

Each method is a generator: it starts non-blocking calls, yields what they
wait for and returns the results (executor.py drives it).
"""

from coordinator.ops_names import device_name, op_name
from coordinator.wire import pb

_METHODS = {
    pb.ALLREDUCE: "allreduce",
    pb.ALLGATHER: "allgather",
    pb.BROADCAST: "broadcast",
    pb.ALLTOALL: "alltoall",
    pb.REDUCESCATTER: "reducescatter",
    pb.P2P: "p2p",
}


class OperationManager:
    def __init__(self, backends):
        self.backends = list(backends)

    def run(self, response, entries, names, **kwargs):
        """The generator that runs `response` (see the module doc)."""
        method = _METHODS[response.op]
        for backend in self.backends:
            if backend.enabled(response) and hasattr(backend, method):
                return getattr(backend, method)(response, entries, names, **kwargs)
        raise RuntimeError(f"no backend can run {op_name(response.op)} on "
                           f"{device_name(response.device)} (enabled backends: "
                           f"{', '.join(b.name for b in self.backends)})")
