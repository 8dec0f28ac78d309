"""ChainerMN's communicator classes, by name: each is the coordinator's
communicator with its name, so that `isinstance` checks and direct
construction (`NaiveCommunicator(mpi_comm)`, as ChainerMN's tests do) work.
A GPU one checks, as ChainerMN's does, that it can run here."""

from frontends.chainer.communicators.coordinator_communicator import (
    CoordinatorCommunicator, DummyCommunicator)


class _Named(CoordinatorCommunicator):
    NAME = "naive"

    def __init__(self, mpi_comm, name=None, _process_set=None, _prefix=None):
        name = name or self.NAME
        from frontends.chainer.communicators import _check_can_run

        _check_can_run(name)
        super().__init__(mpi_comm, name=name, _process_set=_process_set, _prefix=_prefix)


class NaiveCommunicator(_Named):
    """ChainerMN's 'naive': NumPy arrays."""
    NAME = "naive"


class PureNcclCommunicator(_Named):
    """ChainerMN's 'pure_nccl': CuPy arrays on the core's NCCL backend."""
    NAME = "pure_nccl"


class FlatCommunicator(_Named):
    """ChainerMN's 'flat': CuPy arrays on the core's device backend."""
    NAME = "flat"


class NonCudaAwareCommunicator(_Named):
    """ChainerMN's 'non_cuda_aware': CuPy arrays on the core's device backend."""
    NAME = "non_cuda_aware"


BY_NAME = {c.NAME: c for c in (NaiveCommunicator, PureNcclCommunicator, FlatCommunicator,
                               NonCudaAwareCommunicator)}
BY_NAME["dummy"] = DummyCommunicator
