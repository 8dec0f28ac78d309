"""ChainerMN's module path for NaiveCommunicator (see _named.py)."""

from frontends.chainer.communicators._named import NaiveCommunicator

__all__ = ["NaiveCommunicator"]
