"""ChainerMN's module path for PureNcclCommunicator (see _named.py)."""

from frontends.chainer.communicators._named import PureNcclCommunicator

__all__ = ["PureNcclCommunicator"]
