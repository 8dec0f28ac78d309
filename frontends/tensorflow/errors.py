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
UnknownError, whatever the Python exception was. So a Python op cannot raise
FailedPreconditionError itself. `graph_call` (the body of every collective
op) marks the errors that must leave as FailedPreconditionError, and
`install_graph_error_types` makes TensorFlow's function call, the one place
every failing `tf.function` (a Keras train step included) passes through,
turn an UnknownError carrying that mark into FailedPreconditionError with the
same message; a tf.compat.v1 Session's run (`BaseSession._do_call`) does
the same. Errors without the mark are left alone. Where a TensorFlow
release moves either, the mark stays in an UnknownError's message and
tests/mpi/tf_cases.py (tf_graph_cases.py for Sessions) fails.
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


# Leads the message of an exception a Python op raises for a core error that
# must reach the caller as FailedPreconditionError (see the module doc).
_FAILED_PRECONDITION_MARK = "[coordinator: FailedPreconditionError] "


def graph_call(fn, *args):
    """Runs `fn` inside a Python op (tf.numpy_function). A core error that
    Horovod reports as FailedPreconditionError is re-raised with the mark
    that `install_graph_error_types` turns back into that class; others
    leave as they are (TensorFlow maps ValueError to InvalidArgumentError
    and the rest to UnknownError, as `translate` does)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - re-raised, marked or not
        if isinstance(translate(exc), tf.errors.FailedPreconditionError):
            raise RuntimeError(f"{_FAILED_PRECONDITION_MARK}{type(exc).__name__}: "
                               f"{exc}") from exc
        raise


def _failed_precondition(exc):
    """The FailedPreconditionError for a marked UnknownError, else None."""
    if not isinstance(exc, tf.errors.UnknownError):
        return None
    message = exc.message
    if _FAILED_PRECONDITION_MARK not in message:
        return None
    return tf.errors.FailedPreconditionError(
        exc.node_def, exc.op, message.replace(_FAILED_PRECONDITION_MARK, ""))


def install_graph_error_types():
    """Makes a failing `tf.function` call, and a tf.compat.v1 Session's run,
    raise FailedPreconditionError for the errors `graph_call` marked.
    Returns False where this TensorFlow has no such hook (the error then
    stays UnknownError, mark included)."""
    try:
        from tensorflow.python.client.session import BaseSession
        from tensorflow.python.eager.polymorphic_function import atomic_function

        scope = atomic_function.InterpolateRuntimeError
        original_exit, original_call = scope.__exit__, BaseSession._do_call
    except (ImportError, AttributeError):  # pragma: no cover - other TF releases
        return False
    if getattr(original_exit, "_coordinator_wrapped", False):
        return True

    def __exit__(self, typ, exc, tb):
        suppress = original_exit(self, typ, exc, tb)  # TF rewrites exc's message here
        replacement = _failed_precondition(exc)
        if replacement is not None:
            raise replacement.with_traceback(tb) from None
        return suppress

    def _do_call(self, fn, *args):
        try:
            return original_call(self, fn, *args)  # TF rewrites the message here too
        except tf.errors.UnknownError as exc:
            replacement = _failed_precondition(exc)
            if replacement is None:
                raise
            raise replacement.with_traceback(exc.__traceback__) from None

    __exit__._coordinator_wrapped = _do_call._coordinator_wrapped = True
    scope.__exit__ = __exit__
    BaseSession._do_call = _do_call
    return True


def xla_unsupported(what):
    """The error for a collective traced inside `jit_compile=True`."""
    return tf.errors.InvalidArgumentError(
        None, None,
        f"{what} cannot run inside a function compiled with jit_compile=True: the "
        "coordinator's collectives are Python ops (tf.numpy_function), which XLA cannot "
        "compile. Use tf.function without jit_compile (or jit_compile=False in Keras "
        "compile()), or keep the collective outside the compiled function.")
