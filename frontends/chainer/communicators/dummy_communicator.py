"""ChainerMN's module path for DummyCommunicator."""

from frontends.chainer.communicators.coordinator_communicator import DummyCommunicator

__all__ = ["DummyCommunicator"]
