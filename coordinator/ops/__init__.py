"""Backends that move tensor bytes, the one factory that builds them, and
the manager that picks one per response.

A backend exposes one generator method per operation (it starts
non-blocking calls, yields what they wait for and returns the results;
executor.py drives it), says which responses it can run (`enabled`), owns
its communicators per process set (made on first use, released by
`remove_process_set`) and its dtype policy, and allocates a joined rank's
zero stand-ins where its tensors live (`zeros`). `create_backends` is the
one place that says which backends exist and in which order they are asked:
NCCL for device tensors first (where CuPy and NCCL are available), then
Adasum, then MPI with the host-aware strategies (hierarchical, 2D torus)
ahead of its flat allreduce.
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


def create_backends(config, world, members, buffers, timeline, rank, topology, control=None):
    """The backends of this process, in the order they are asked.

    world: the data communicator (Transport.data_world()); members(pset):
    a process set's global ranks; control: the control transport, through
    which device backends agree on their communicators' ids."""
    from coordinator.ops.adasum import AdasumOps
    from coordinator.ops.hierarchical import HierarchicalAllreduce
    from coordinator.ops.mpi_ops import Communicators, MPIOps
    from coordinator.ops.torus import TorusAllreduce

    comms = Communicators(world, members)
    algorithms = []
    if config.torus_allreduce:
        algorithms.append(TorusAllreduce(comms, topology))
    if config.hierarchical_allreduce:
        algorithms.append(HierarchicalAllreduce(comms, topology))
    backends = [AdasumOps(comms, timeline)]
    backends.append(MPIOps(comms, buffers, timeline, rank, algorithms, config.segment_bytes))
    return OperationManager(backends)


class OperationManager:
    def __init__(self, backends):
        self.backends = list(backends)

    def backend_for(self, response):
        for backend in self.backends:
            if backend.enabled(response):
                return backend
        raise RuntimeError(f"no backend can run {op_name(response.op)} on "
                           f"{device_name(response.device)} (backends: "
                           f"{', '.join(b.name for b in self.backends)})")

    def zeros(self, response, shape, dtype):
        """A joined rank's stand-in, allocated by the backend that runs it."""
        return self.backend_for(response).zeros(shape, dtype, response.device)

    def remove_process_set(self, process_set_id):
        for backend in self.backends:
            release = getattr(backend, "remove_process_set", None)
            if release is not None:
                release(process_set_id)

    def run(self, response, entries, names, **kwargs):
        """The generator that runs `response` (see the module doc)."""
        method = _METHODS[response.op]
        for backend in self.backends:
            if backend.enabled(response) and hasattr(backend, method):
                return getattr(backend, method)(response, entries, names, **kwargs)
        raise RuntimeError(f"no backend can run {op_name(response.op)} on "
                           f"{device_name(response.device)} (enabled backends: "
                           f"{', '.join(b.name for b in self.backends)})")
