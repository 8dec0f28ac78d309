"""create_communicator: ChainerMN's communicator names, mapped onto the coordinator.

'naive' is ChainerMN's CPU communicator and runs here: its tensors go through
the coordinator. Every other name in ChainerMN (v6 and v7) selects a GPU
algorithm, which needs CuPy, NCCL and CUDA GPUs there too; the coordinator has
no GPU backend yet, so those names raise a RuntimeError that says so, as
ChainerMN itself raises on a machine without them.
"""

from frontends.chainer.communicators.communicator_base import CommunicatorBase
from frontends.chainer.communicators.coordinator_communicator import CoordinatorCommunicator

# What each GPU communicator does in ChainerMN (v6 names are marked).
GPU_COMMUNICATORS = {
    "pure_nccl": "all-reduces gradients in GPU memory with NCCL 2",
    "flat": "packs gradients into one GPU buffer and all-reduces it with CUDA-aware MPI",
    "hierarchical": "reduces within each node with NCCL, then across nodes with MPI "
                    "(ChainerMN v6)",
    "two_dimensional": "reduce-scatters within nodes with NCCL, all-reduces across nodes "
                       "with MPI, all-gathers within nodes (ChainerMN v6)",
    "single_node": "all-reduces with NCCL within a single node (ChainerMN v6)",
    "non_cuda_aware": "uses NCCL within nodes and MPI through host memory across nodes",
    "dummy": "packs GPU gradients without communicating (ChainerMN's overhead benchmark)",
}
CPU_COMMUNICATORS = ("naive",)


def _gpu_state():
    try:
        import cupy
    except Exception:  # ImportError, or a broken CUDA install
        return "CuPy is not installed"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        count = 0
    if count == 0:
        return "no CUDA GPU is visible"
    return f"{count} GPU(s) are visible, but the coordinator cannot use them yet"


def _gpu_error(name):
    return RuntimeError(
        f"create_communicator({name!r}): this communicator {GPU_COMMUNICATORS[name]}; it "
        f"needs CuPy, NCCL and CUDA GPUs, and the coordinator has no GPU backend yet "
        f"(here: {_gpu_state()}). On CPU use create_communicator('naive'), whose gradients "
        "go through the coordinator's fusion, response cache and timeline.")


def create_communicator(communicator_name="pure_nccl", mpi_comm=None, **kwargs):
    """A ChainerMN communicator over `mpi_comm` (default: MPI.COMM_WORLD).

    The default name is ChainerMN's, 'pure_nccl', which needs GPUs: CPU jobs
    pass 'naive'. Keyword arguments: allreduce_grad_dtype (only with
    'pure_nccl', as in ChainerMN) and batched_copy (accepted; the
    coordinator's fusion does the packing). The coordinator is started on
    first use, or joined if another frontend already started it."""
    allreduce_grad_dtype = kwargs.pop("allreduce_grad_dtype", None)
    batched_copy = kwargs.pop("batched_copy", True)
    if kwargs:
        raise TypeError(f"create_communicator() got unexpected keyword arguments "
                        f"{sorted(kwargs)}")
    if communicator_name != "pure_nccl" and allreduce_grad_dtype is not None:
        raise ValueError("allreduce_grad_dtype is only available at 'pure_nccl' "
                         "communicator.")
    if communicator_name in GPU_COMMUNICATORS:
        raise _gpu_error(communicator_name)
    if communicator_name not in CPU_COMMUNICATORS:
        known = ", ".join(repr(n) for n in CPU_COMMUNICATORS + tuple(GPU_COMMUNICATORS))
        raise ValueError(f'Unrecognized communicator: "{communicator_name}" (known: {known})')
    if mpi_comm is None:
        from mpi4py import MPI

        mpi_comm = MPI.COMM_WORLD
    comm = CoordinatorCommunicator(mpi_comm, name=communicator_name)
    comm.set_config("batched_copy", batched_copy)
    return comm


__all__ = ["CommunicatorBase", "CoordinatorCommunicator", "create_communicator",
           "GPU_COMMUNICATORS", "CPU_COMMUNICATORS"]
