"""ChainerMN's module path for FlatCommunicator (see _named.py)."""

from frontends.chainer.communicators._named import FlatCommunicator

__all__ = ["FlatCommunicator"]
