"""The exception types Horovod's TensorFlow API raises, for the core's errors.

Horovod's TensorFlow ops turn a failed collective into a `tf.errors.OpError`
whose class follows the status: ranks that disagree about a tensor (shape,
dtype, op, root rank...) give `FailedPreconditionError`, a call before
`init()` too, an invalid argument `InvalidArgumentError`, and a collective cut
short by a shutdown `UnknownError`. `translate` maps the core's exceptions the
same way and keeps the core's message, which names the tensor, the ranks and
what each of them sent.

Inside a `tf.function` the collective runs as a Python op, and TensorFlow
itself decides the class of an exception leaving a Python op
(tensorflow/python/lib/core/py_func.cc): ValueError and TypeError become
InvalidArgumentError, NotImplementedError UnimplementedError, anything else
UnknownError. There is no way to raise FailedPreconditionError from there, so
a mismatch inside a `tf.function` surfaces as `tf.errors.UnknownError` whose
message starts with the core's `TensorMismatchError: ...` text. Eagerly the
types are exactly Horovod's.
"""

import tensorflow as tf

from coordinator.errors import (HorovodInternalError, NotInitializedError, ShutdownError,
                                TensorMismatchError)


def _make(cls, exc):
    return cls(None, None, str(exc))


def translate(exc):
    """The tf.errors exception Horovod would raise for a core exception, or
    `exc` itself when it is not one of the core's."""
    if isinstance(exc, tf.errors.OpError):
        return exc
    if isinstance(exc, (TensorMismatchError, NotInitializedError)):
        return _make(tf.errors.FailedPreconditionError, exc)
    if isinstance(exc, ShutdownError):
        return _make(tf.errors.UnknownError, exc)
    if isinstance(exc, ValueError):
        return _make(tf.errors.InvalidArgumentError, exc)
    if isinstance(exc, HorovodInternalError):
        return _make(tf.errors.UnknownError, exc)
    return exc


def call(fn, *args, **kwargs):
    """Runs `fn` and re-raises the core's exceptions as tf.errors."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised, translated or not
        translated = translate(exc)
        if translated is exc:
            raise
        raise translated from exc


def xla_unsupported(what):
    """The error for a collective traced inside `jit_compile=True`."""
    return tf.errors.InvalidArgumentError(
        None, None,
        f"{what} cannot run inside a function compiled with jit_compile=True: the "
        "coordinator's collectives are Python ops (tf.numpy_function), which XLA cannot "
        "compile. Use tf.function without jit_compile (or jit_compile=False in Keras "
        "compile()), or keep the collective outside the compiled function.")
