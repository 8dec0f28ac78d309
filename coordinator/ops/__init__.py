"""Backends that move tensor bytes, the one factory that builds them, and
the manager that picks one per response.

A backend exposes one generator method per operation (it starts
non-blocking calls, yields what they wait for and returns the results;
executor.py drives it), says which responses it can run (`enabled`), owns
its communicators per process set (started by `add_process_set` or made
on first use, released by `remove_process_set`) and its dtype policy, and allocates a joined rank's
zero stand-ins where its tensors live (`zeros`). `create_backends` is the
one place that says which backends exist and in which order they are asked:
for device (CUDA) tensors NCCL first (where CuPy, NCCL and a GPU are
available), then staging through pinned host memory into host backends of
their own (Adasum on the GPU, and everything where NCCL is unavailable);
for host tensors Adasum, then MPI with the host-aware strategies
(hierarchical, 2D torus) ahead of its flat allreduce.
"""

import logging

from coordinator.ops_names import device_name, op_name
from coordinator.wire import pb

log = logging.getLogger("coordinator")

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
    from coordinator.ops.mpi_ops import Communicators, InOrder, MPIOps
    from coordinator.ops.torus import TorusAllreduce

    order = InOrder()  # the host and device lanes' sets, made in one order
    comms = Communicators(world, members, order=order)
    algorithms = []
    if config.torus_allreduce:
        algorithms.append(TorusAllreduce(comms, topology))
    if config.hierarchical_allreduce:
        algorithms.append(HierarchicalAllreduce(comms, topology))
    backends = _device_backends(config, world, members, buffers, timeline, rank, topology,
                                order)
    backends.append(AdasumOps(comms, timeline))
    backends.append(MPIOps(comms, buffers, timeline, rank, algorithms, config.segment_bytes))
    return OperationManager(backends)


def device_plan(gpu_ok, nccl_ok, cuda_aware):
    """Which backends run device tensors: (names, why), in the order asked."""
    if not gpu_ok:
        return [], "no GPU backend"
    aware = ("MPI says it is CUDA-aware, but only host memory is handed to it"
             if cuda_aware else "MPI is not CUDA-aware, so device memory never reaches it")
    if nccl_ok:
        return (["nccl", "mpi-staged"], "GPU tensors: NCCL; Adasum staged through pinned host "
                f"memory for MPI ({aware})")
    return (["mpi-staged"], "GPU tensors staged through pinned host memory for MPI, as NCCL "
            f"is unavailable ({aware})")


def _device_backends(config, world, members, buffers, timeline, rank, topology=None,
                     order=None):
    """The backends for device tensors, or none where they cannot arrive (no
    CuPy, no GPU). Imports CuPy only where it is installed."""
    from coordinator import gpu

    gpu_ok, found = gpu.probe()
    if not gpu_ok:
        log.debug("rank %d: no GPU backend: %s", rank, found)
        return []
    from coordinator.fusion import FusionBuffers
    from coordinator.ops.adasum import AdasumOps
    from coordinator.ops.mpi_ops import DEVICE_SET_TAG, Communicators, MPIOps, mpi_cuda_aware
    from coordinator.ops.staging import HostStaging, StagedDeviceOps

    nccl, why_not = gpu.nccl_module()
    names, plan = device_plan(True, nccl is not None, mpi_cuda_aware())
    log.info("rank %d: %s; %s%s", rank, found, plan, f" ({why_not})" if why_not else "")
    # The device lanes' own communicators and buffers: they run beside the
    # host lanes of the same sets (see mpi_ops.Communicators).
    comms = Communicators(world, members, tag=DEVICE_SET_TAG, reuse_world=False, order=order)
    host = OperationManager([AdasumOps(comms, timeline),
                             MPIOps(comms, FusionBuffers(buffers.limit), timeline, rank, (),
                                    config.segment_bytes)])
    backends = []
    if "nccl" in names:
        from coordinator.ops.nccl_ops import NCCLOps

        host_aware = config.hierarchical_allreduce or config.torus_allreduce
        backends.append(NCCLOps(comms, timeline, nccl, topology if host_aware else None))
    backends.append(StagedDeviceOps(host, HostStaging(), timeline))
    return backends


class OperationManager:
    def __init__(self, backends):
        self.backends = list(backends)

    def _each(self, method, *args):
        """Calls `method` of every backend that has it."""
        for backend in self.backends:
            call = getattr(backend, method, None)
            if call is not None:
                call(*args)

    def revoke(self):
        """After a peer died: releases peers waiting on the backends'
        communicators (ULFM), so a re-formed job leaves nothing stuck."""
        self._each("revoke")

    def settle(self, timeout):
        """Before MPI may be finalized: waits up to `timeout` seconds for the
        communicators still being made in helper threads (a set registered
        just before shutdown); False if some were not."""
        from coordinator.ops.mpi_ops import Making

        return Making.settle(timeout)

    def abort_device_communicators(self):
        """After the job failed: drops the work queued on this rank's device
        communicators (ncclCommAbort), which peers may never finish."""
        self._each("abort_communicators")

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

    def add_process_set(self, process_set_id):
        """A set was registered (on every rank, at the same point): the
        backends start making its communicators."""
        self._each("add_process_set", process_set_id)

    def remove_process_set(self, process_set_id):
        self._each("remove_process_set", process_set_id)

    def run(self, response, entries, names, **kwargs):
        """The generator that runs `response` (see the module doc)."""
        method = _METHODS[response.op]
        for backend in self.backends:
            if backend.enabled(response) and hasattr(backend, method):
                return getattr(backend, method)(response, entries, names, **kwargs)
        raise RuntimeError(f"no backend can run {op_name(response.op)} on "
                           f"{device_name(response.device)} (enabled backends: "
                           f"{', '.join(b.name for b in self.backends)})")
