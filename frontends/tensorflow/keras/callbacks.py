"""Horovod's Keras callbacks, for Keras 3.

Differences from Horovod forced by Keras 3, and what they change:

- BroadcastGlobalVariablesCallback broadcasts in `on_train_begin`, because
  Keras 3's `fit` builds the model and the optimizer before calling it. Every
  rank therefore starts the first step from the root's weights (Horovod's
  tf.keras version had to wait for the end of the first batch, when the
  optimizer's slots existed). If the optimizer is not built yet at that
  point, its variables are broadcast at the end of the first batch, as in
  Horovod.
- Keras 3 optimizers keep `momentum` as a Python float that a compiled train
  step has baked in, so the learning-rate callbacks can change only the
  learning rate (a variable). Their momentum correction is applied when the
  optimizer's momentum is a variable, and otherwise skipped with a warning.
- BestModelCheckpoint takes an optional `filepath` (Horovod's Spark
  estimator sets it after construction); it must be set before training.
"""

import warnings

import keras
import numpy as np

import coordinator as core
from frontends.tensorflow import basics, errors, functions
from frontends.tensorflow.gradients import source_key


def _value(variable):
    return float(np.asarray(keras.ops.convert_to_numpy(variable)))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcasts the model's and the optimizer's variables from `root_rank`
    when training starts, so every rank starts from the same state (random
    initialisation or a checkpoint loaded on the root only)."""

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._optimizer_done = False
        self._local_keys = set()
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, (list, tuple, set)):
            local_variables = [local_variables]
        for var in local_variables:
            self.register_local_var(var)

    def register_local_var(self, var):
        """Leaves `var` out of the broadcast."""
        if not hasattr(var, "assign"):
            raise ValueError("All local variables must be of tf.Variable type.")
        self._local_keys.add(source_key(var))

    def _broadcast_model(self):
        variables = [v for v in self.model.variables if source_key(v) not in self._local_keys]
        functions.broadcast_variables(variables, root_rank=self.root_rank)

    def _broadcast_optimizer(self):
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None or not getattr(optimizer, "built", True):
            return False
        functions.broadcast_variables(list(optimizer.variables), root_rank=self.root_rank)
        return True

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        self._broadcast_model()
        self._optimizer_done = self._broadcast_optimizer()
        self.broadcast_done = self._optimizer_done

    def on_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        if not self._optimizer_done:
            self._broadcast_model()
            self._optimizer_done = self._broadcast_optimizer()
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces every metric in the epoch's logs by its average over the
    ranks, at the end of each epoch. Put it before callbacks that read the
    metrics (ReduceLROnPlateau, TensorBoard, checkpoints)."""

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def _average_metrics_in_place(self, logs):
        if not logs:
            return
        names = sorted(logs)
        values = np.array([float(np.asarray(logs[n])) for n in names], np.float64)
        averaged = errors.call(core.allreduce, values, op=core.Average,
                               name="MetricAverageCallback")
        for name, value in zip(names, averaged):
            logs[name] = float(value)

    def on_epoch_end(self, epoch, logs=None):
        self._average_metrics_in_place(logs)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to `initial_lr * multiplier(epoch)` between
    `start_epoch` and `end_epoch` (exclusive). `multiplier` is a constant
    (exponential decay: multiplier ** (epoch - start_epoch)) or a function.
    With `staircase` it changes at each epoch's first batch with an integer
    epoch; otherwise at every batch with epoch + batch / steps_per_epoch."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self.restore_momentum = None
        self._warned_momentum = False
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _autodetect_steps_per_epoch(self):
        steps = self.params.get("steps")
        if steps:
            return steps
        raise ValueError("Could not autodetect the number of steps per epoch. Please specify "
                         f"the steps_per_epoch parameter to the {type(self).__name__}().")

    def _momentum_variable(self):
        momentum = getattr(self.model.optimizer, "momentum", None)
        if momentum is None:
            return None
        if hasattr(momentum, "assign"):
            return momentum
        if not self._warned_momentum:
            warnings.warn(f"{type(self).__name__}: the optimizer's momentum is a Python "
                          "number, fixed in the compiled train step (Keras 3), so momentum "
                          "correction is skipped", stacklevel=2)
            self._warned_momentum = True
        return None

    def _adjust_learning_rate(self, epoch):
        optimizer = self.model.optimizer
        old_lr = _value(optimizer.learning_rate)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        if self.momentum_correction:
            momentum = self._momentum_variable()
            if momentum is not None and old_lr:
                self.restore_momentum = _value(momentum)
                momentum.assign(self.restore_momentum * new_lr / old_lr)

    def _restore_momentum_if_needed(self):
        if self.restore_momentum is not None:
            self.model.optimizer.momentum.assign(self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (
                self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_batch_end(self, batch, logs=None):
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _value(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warmup ("Accurate, Large Minibatch SGD", Goyal et al.): the
    learning rate goes from initial_lr / size to initial_lr over
    `warmup_epochs`, batch by batch:
    lr(epoch) = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1),
    with epoch counted at the end of each batch."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            size = basics.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and basics.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_value(self.model.optimizer.learning_rate):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """ModelCheckpoint that keeps only the best model (save_best_only=True).
    `filepath` may be given later (set `.filepath` before training)."""

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto",
                 save_freq="epoch", filepath=None):
        placeholder = filepath or ("unset.weights.h5" if save_weights_only else "unset.keras")
        super().__init__(filepath=placeholder, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs=None):
        if not self.filepath:
            raise ValueError("BestModelCheckpoint: set `filepath` before training")
        super().on_train_begin(logs)
