"""ChainerMN's module path for NonCudaAwareCommunicator (see _named.py)."""

from frontends.chainer.communicators._named import NonCudaAwareCommunicator

__all__ = ["NonCudaAwareCommunicator"]
