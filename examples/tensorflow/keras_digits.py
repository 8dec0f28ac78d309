"""Keras 3 `model.fit` on scikit-learn's digits, data-parallel with Horovod's API.

    coordrun -np 2 python examples/tensorflow/keras_digits.py [--epochs 10]
    python examples/tensorflow/keras_digits.py --no-distribute [--world 2]

Each rank fits on its own shard of the training set. The DistributedOptimizer
averages the gradients across ranks, BroadcastGlobalVariablesCallback starts
every rank from rank 0's weights, MetricAverageCallback averages the logged
metrics, and LearningRateWarmupCallback ramps the scaled learning rate up
over the first epochs. Rank 0 prints one line per epoch, then the median
time per training step (epochs after the first, which includes tracing).

--no-distribute runs the same training without the coordinator, on the shard
of a job of --world ranks that OMPI_COMM_WORLD_RANK (default 0) names: the
baseline that examples/tensorflow/compare_overhead.py times against.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402


class StepTimer(keras.callbacks.Callback):
    """Time per training step of each epoch: first batch start to last
    batch end, so evaluation at the end of the epoch is not counted."""

    def __init__(self):
        super().__init__()
        self.per_step = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start, self.steps = None, 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.start is None:
            self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.end = time.perf_counter()
        self.steps += 1

    def on_epoch_end(self, epoch, logs=None):
        self.per_step.append((self.end - self.start) / self.steps)


class PrintEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch {epoch + 1:3d}  loss {logs['loss']:.4f}  accuracy {logs['accuracy']:.4f}"
              f"  test accuracy {logs['val_accuracy']:.4f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank")
    parser.add_argument("--warmup-epochs", type=int, default=2)
    parser.add_argument("--no-distribute", action="store_true",
                        help="train without the coordinator (the overhead baseline)")
    parser.add_argument("--world", type=int, default=1,
                        help="with --no-distribute: train on rank 0's shard of this many")
    args = parser.parse_args()

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    if args.no_distribute:
        hvd = None
        # Under mpirun (the overhead baseline) each process takes "its" shard.
        rank, size = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0)), args.world
    else:
        import frontends.tensorflow.keras as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25,
                                                        random_state=0)
    # Equal shards, so every rank takes the same number of steps.
    per_rank = len(x_train) // size
    x_train = x_train[rank * per_rank:(rank + 1) * per_rank]
    y_train = y_train[rank * per_rank:(rank + 1) * per_rank]

    keras.utils.set_random_seed(rank)  # different on every rank until the broadcast
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    # The usual Horovod recipe: scale the learning rate by the number of ranks.
    lr = args.lr * (size if hvd else 1)
    optimizer = keras.optimizers.SGD(lr, momentum=0.9)
    callbacks = []
    if hvd:
        optimizer = hvd.DistributedOptimizer(optimizer)
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                     hvd.callbacks.MetricAverageCallback(),
                     # Keras 3 compiles SGD's momentum in as a constant, so the
                     # warmup cannot correct it: say so instead of being warned.
                     hvd.callbacks.LearningRateWarmupCallback(
                         initial_lr=lr, warmup_epochs=args.warmup_epochs,
                         momentum_correction=False)]
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    timer = StepTimer()
    callbacks.append(timer)
    if rank == 0:
        callbacks.append(PrintEpoch())
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
              validation_data=(x_test, y_test), verbose=0, callbacks=callbacks)

    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if hvd:
        # Every rank holds the same model.
        fingerprint = float(sum(np.abs(w).sum() for w in model.get_weights()))
        everyone = hvd.allgather([fingerprint]).numpy()
        assert np.all(everyone == everyone[0]), f"ranks diverged: {everyone}"
    if rank == 0:
        step = np.median(timer.per_step[1:]) if len(timer.per_step) > 1 else timer.per_step[0]
        print(f"median step time {step * 1e3:.3f} ms")
        mode = "without distribution" if hvd is None else f"{size} ranks"
        print(f"done: {mode}, final test accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
