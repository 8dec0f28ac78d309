"""horovod.tensorflow.elastic over the coordinator: `run`,
`TensorFlowKerasState`, `TensorFlowState`.

TensorFlow reports a failed collective as a `tf.errors.OpError` (inside a
tf.function, a Keras train step included, TensorFlow decides the class), so
`run` turns those that come from the coordinator back into
HorovodInternalError before the elastic loop sees them, as Horovod does;
except the program's own mistakes (`errors.repairable`), which a reset
would meet again: they leave as they came, and the job stops.

Deliberate differences from Horovod 0.28.1, all for TensorFlow 2 / Keras 3:
states copy variables to host memory (NumPy) on commit; `TensorFlowState`
broadcasts its variables on sync (Horovod's does so only in TF1 sessions);
an optimizer that has not built its variables yet is built on the model's
trainable variables when the state is made, so a new worker holds the same
variables as the others when they sync.
"""

import numpy as np
import tensorflow as tf

from coordinator.elastic import (HostsUpdatedInterrupt, ObjectState, State, membership,
                                 run_fn)
from coordinator.elastic.loop import make_reset, not_retried
from coordinator.errors import FINISHED_TEXT, PROGRAM_ERRORS, HorovodInternalError, repairable
from frontends.tensorflow.basics import init, rank, shutdown
from frontends.tensorflow.functions import broadcast_object, broadcast_variables

__all__ = ["run", "TensorFlowKerasState", "TensorFlowState", "State", "ObjectState",
           "HostsUpdatedInterrupt"]

# What marks a tf.errors.OpError as a failed collective of the coordinator.
_CORE_ERROR_MARKS = ("HorovodAllreduce", "HorovodAllgather", "HorovodBroadcast",
                     "HorovodAlltoall", "HorovodReducescatter", "RankFailedError",
                     "HorovodInternalError", "ShutdownError", "StallError",
                     "the coordinator", "coordinator's background thread")


# What marks one of the program's own mistakes in the message of an error
# raised inside a tf.function, which carries no cause: the class's name, as
# TensorFlow writes a Python op's exception ("DeadlockError: Deadlocked ...").
_PROGRAM_ERROR_MARKS = tuple(f"{cls.__name__}: " for cls in PROGRAM_ERRORS) + (FINISHED_TEXT,)


def _core_failure(exc):
    """What a TensorFlow error stands for: "repairable" (a failed collective
    a reset can repair), "program" (one of the program's own mistakes), or
    None (not the coordinator's)."""
    cause = exc
    while cause is not None:
        if isinstance(cause, HorovodInternalError):
            return "repairable" if repairable(cause) else "program"
        cause = cause.__cause__ or cause.__context__
    message = getattr(exc, "message", "") or str(exc)
    if any(mark in message for mark in _PROGRAM_ERROR_MARKS):
        return "program"
    return "repairable" if any(mark in message for mark in _CORE_ERROR_MARKS) else None


def run(func):
    """Runs `func(state, ...)` elastically (see coordinator.elastic.loop);
    TensorFlow errors from failed collectives count as a lost worker."""

    def wrapper(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            failure = _core_failure(exc)
            if failure == "repairable":
                raise HorovodInternalError(exc) from exc
            if failure == "program" and membership.current() is not None:
                exc.add_note(not_retried(exc))
            raise

    return run_fn(_keep_name(wrapper, func), make_reset(shutdown, init))


def _keep_name(wrapper, func):
    wrapper.__name__ = getattr(func, "__name__", "train")
    wrapper.__doc__ = getattr(func, "__doc__", None)
    wrapper.__wrapped__ = func
    return wrapper


def _variables(obj):
    """`obj.variables` (a Keras 3 property) or `obj.variables()` (older)."""
    value = obj.variables
    return list(value() if callable(value) else value)


def _host_copy(variables):
    return [np.array(v) for v in variables]


def _assign(variables, values):
    for var, value in zip(variables, values):
        var.assign(value)


def _model_built(model):
    return model.built if hasattr(model, "build") else True


class TensorFlowKerasState(ObjectState):
    """State of a Keras model and its optimizer (the model's compiled one
    when `optimizer` is None); other keyword arguments are synced as plain
    objects. `backend` is accepted for compatibility (TF1)."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        self.model = model
        if not _model_built(model):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.optimizer = optimizer or model.optimizer
        self.backend = backend
        if self.optimizer is not None and not getattr(self.optimizer, "built", True):
            self.optimizer.build(model.trainable_variables)
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _all_variables(self):
        variables = list(self.model.variables)
        if self.optimizer is not None:
            variables += _variables(self.optimizer)
        return variables

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        self._load_model()
        super().restore()

    def sync(self):
        broadcast_variables(self._all_variables(), root_rank=0)
        self._save_model()
        super().sync()

    def _save_model(self):
        self._saved_model_state = _host_copy(self.model.variables)
        self._saved_optimizer_state = (_host_copy(_variables(self.optimizer))
                                       if self.optimizer is not None else [])

    def _load_model(self):
        _assign(self.model.variables, self._saved_model_state)
        if self.optimizer is not None:
            _assign(_variables(self.optimizer), self._saved_optimizer_state)


class TensorFlowState(ObjectState):
    """State of a list of tf.Variables: eager TensorFlow 2's, or a TF1
    graph's, read and written through `session`.

    As Horovod's, `variables` defaults to the graph's global variables
    (none when executing eagerly, where the state holds only its keyword
    attributes) and `session` to the default session."""

    def __init__(self, variables=None, session=None, **kwargs):
        self.variables = list(variables or tf.compat.v1.global_variables())
        self._eager = tf.executing_eagerly()
        self.session = session or (None if self._eager else tf.compat.v1.get_default_session())
        if not self._eager and self.variables and self.session is None:
            raise ValueError("TensorFlowState of a TF1 graph's variables needs its session: "
                             "pass session=, or make the state inside `with session.as_default()`")
        # A graph's broadcast is one op, made once: made again at every sync
        # it would grow the graph.
        self._bcast_op = (None if self._eager or not self.variables
                          else broadcast_variables(self.variables, root_rank=0))
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        self._load_model()
        super().restore()

    def sync(self):
        if self._bcast_op is not None:
            self.session.run(self._bcast_op)
        elif self.variables:
            broadcast_variables(self.variables, root_rank=0)
        self._save_model()
        super().sync()

    def _save_model(self):
        if self._eager:
            self._values = _host_copy(self.variables)
        else:
            self._values = self.session.run(self.variables) if self.variables else []

    def _load_model(self):
        if self._eager:
            _assign(self.variables, self._values)
        else:
            for var, value in zip(self.variables, self._values):
                var.load(value, self.session)
