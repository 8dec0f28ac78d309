"""ChainerMN's module path for MpiCommunicatorBase: the base of every communicator
here (the coordinator's, whose tensors go through the coordinator)."""

from frontends.chainer.communicators.coordinator_communicator import (
    CoordinatorCommunicator as MpiCommunicatorBase)

__all__ = ["MpiCommunicatorBase"]
