"""horovod.tensorflow.keras.elastic over the coordinator: `run`,
`KerasState` and the callbacks that keep it current during `model.fit`.

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, epochs=epochs - state.epoch,
                  callbacks=[hvd.elastic.CommitStateCallback(state),
                             hvd.elastic.UpdateBatchStateCallback(state),
                             hvd.elastic.UpdateEpochStateCallback(state)])

Keras 3 reads the number of steps of an epoch once, so
UpdateBatchStateCallback's shortening of the first epoch after a reset
(through `params["steps"]`) has no effect on the steps Keras runs; the batch
number is still tracked in `state.batch`.
"""

import keras

from frontends.tensorflow.elastic import TensorFlowKerasState, run

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]


class KerasState(TensorFlowKerasState):
    """State of a Keras model and optimizer (the compiled one by default);
    other keyword arguments are synced as plain objects."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits `state` every `batches_per_commit` batches and at the end of
    every epoch."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.backend = keras.backend
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit  # the same on every rank

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.commit()

    def commit(self):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps `state.batch` at the number of the last batch finished (0 at
    the end of each epoch)."""

    def __init__(self, state):
        super().__init__()
        self.backend = keras.backend
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps `state.epoch` at the number of epochs finished, counted across
    resets: fit() counts from 0 each time (call it with
    epochs=total - state.epoch, as Horovod's examples do)."""

    def __init__(self, state):
        super().__init__()
        self.backend = keras.backend
        self.state = state
        self.initial_epoch = self.state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        # +1: a reset after state.batch went back to 0 must not repeat it.
        self.state.epoch = self.initial_epoch + epoch + 1
