"""create_communicator: ChainerMN's communicator names, mapped onto the coordinator.

'naive' is ChainerMN's CPU communicator. Every other name in ChainerMN (v6 and
v7) selects a GPU algorithm; here each of them is a communicator whose CuPy
arrays go through the coordinator's device backend (NCCL through CuPy, or
host staging where CuPy has no NCCL), fused, cached and timed like every
other tensor. The name says what ChainerMN did; the coordinator decides how
the bytes move (hierarchical and torus allreduce follow the job's
HOROVOD_HIERARCHICAL_ALLREDUCE / HOROVOD_TORUS_ALLREDUCE settings). As in
ChainerMN, they need CuPy and a CUDA GPU, and 'pure_nccl' needs NCCL; where
one is missing they raise a RuntimeError saying which.
"""

from frontends.chainer.communicators.communicator_base import CommunicatorBase
from frontends.chainer.communicators.coordinator_communicator import (
    CoordinatorCommunicator, DummyCommunicator, check_grad_dtype)

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


def _gpu_state(name):
    """None when `name` can run here, else what is missing."""
    from coordinator import gpu

    usable, why = gpu.probe()
    if not usable:
        return why
    if name == "pure_nccl":
        nccl, why = gpu.nccl_module()
        if nccl is None:
            return f"{why}; the other GPU communicators stage through host memory there"
    return None


def _gpu_error(name, missing):
    return RuntimeError(
        f"create_communicator({name!r}): this communicator {GPU_COMMUNICATORS[name]}; it "
        f"needs CuPy and a CUDA GPU{' with NCCL' if name == 'pure_nccl' else ''} (here: "
        f"{missing}). On CPU use create_communicator('naive'), whose gradients go through "
        "the coordinator's fusion, response cache and timeline.")


def _check_can_run(name):
    """Raises the RuntimeError of a GPU communicator that cannot run here
    (create_communicator, and ChainerMN's classes constructed directly)."""
    if name in GPU_COMMUNICATORS:
        missing = _gpu_state(name)
        if missing is not None:
            raise _gpu_error(name, missing)


def create_communicator(communicator_name="pure_nccl", mpi_comm=None, **kwargs):
    """A ChainerMN communicator over `mpi_comm` (default: MPI.COMM_WORLD).

    The default name is ChainerMN's, 'pure_nccl', which needs a GPU with NCCL:
    CPU jobs pass 'naive'. Keyword arguments: allreduce_grad_dtype (only with
    'pure_nccl', as in ChainerMN: gradients are reduced in that floating
    dtype, e.g. np.float16, and cast back) and batched_copy (accepted; the
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
    if communicator_name not in CPU_COMMUNICATORS + tuple(GPU_COMMUNICATORS):
        known = ", ".join(repr(n) for n in CPU_COMMUNICATORS + tuple(GPU_COMMUNICATORS))
        raise ValueError(f'Unrecognized communicator: "{communicator_name}" (known: {known})')
    grad_dtype = check_grad_dtype(allreduce_grad_dtype)
    _check_can_run(communicator_name)
    if mpi_comm is None:
        from mpi4py import MPI

        mpi_comm = MPI.COMM_WORLD
    kind = _named.BY_NAME.get(communicator_name, CoordinatorCommunicator)
    comm = kind(mpi_comm, name=communicator_name)
    comm.set_config("batched_copy", batched_copy)
    if grad_dtype is not None:
        comm.set_config("allreduce_grad_dtype", grad_dtype)
    return comm


# ChainerMN's module paths and classes (after the functions their GPU
# classes call): chainermn.communicators.naive_communicator.NaiveCommunicator,
# ... mpi_communicator_base.MpiCommunicatorBase.
from frontends.chainer.communicators import _named  # noqa: E402
from frontends.chainer.communicators import (  # noqa: E402
    dummy_communicator, flat_communicator, mpi_communicator_base, naive_communicator,
    non_cuda_aware_communicator, pure_nccl_communicator)

__all__ = ["CommunicatorBase", "CoordinatorCommunicator", "DummyCommunicator",
           "create_communicator",
           "GPU_COMMUNICATORS", "CPU_COMMUNICATORS", "dummy_communicator", "flat_communicator",
           "mpi_communicator_base", "naive_communicator", "non_cuda_aware_communicator",
           "pure_nccl_communicator"]
