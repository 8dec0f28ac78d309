"""Keras 3 `model.fit` on the bundled digits, data-parallel with Horovod's API.

    coordrun -np 2 python examples/tensorflow/keras_digits.py [--epochs 10]
    python examples/tensorflow/keras_digits.py --no-distribute [--world 2]

Each rank fits on its own shard of the training set. The DistributedOptimizer
averages the gradients across ranks, BroadcastGlobalVariablesCallback starts
every rank from rank 0's weights, MetricAverageCallback averages the logged
metrics, and LearningRateWarmupCallback ramps the scaled learning rate up
over the first epochs. The model is the convolutional network of Horovod's
Keras MNIST example (`--model mlp`: one hidden layer instead). Rank 0 prints
one line per epoch, then the median time per training step in the steady
state (see StepTimer) and per epoch (epochs after the first, which includes
tracing).

--no-distribute runs the same training without the coordinator, on the shard
of a job of --world ranks that OMPI_COMM_WORLD_RANK (default 0) names: the
baseline that examples/tensorflow/compare_overhead.py times against.
--raw-mpi (under mpirun) averages the gradients with one MPI_Allreduce
through mpi4py inside the train step instead, with no coordinator: what any
reduction in a Python op costs at the least.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from coordinator.digits import load_digits  # noqa: E402
from coordinator.digits import train_test_split  # noqa: E402


class StepTimer(keras.callbacks.Callback):
    """Time per training step of each epoch, in the steady state: from the
    end of the epoch's first batch to the end of its last, over the steps in
    between. The first batch is left out because it absorbs what happens
    between epochs (Keras builds the epoch's data iterator, which takes 10 to
    250 ms here, differently on each rank): with distribution, the rank that
    finishes that early waits inside its first step for the others."""

    def __init__(self):
        super().__init__()
        self.per_step = []
        self.per_epoch = []  # whole epochs, wall clock: for reference

    def on_epoch_begin(self, epoch, logs=None):
        self.start, self.steps = None, 0
        self.epoch_start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        else:
            self.end = now
            self.steps += 1

    def on_epoch_end(self, epoch, logs=None):
        if self.steps:
            self.per_step.append((self.end - self.start) / self.steps)
        self.per_epoch.append(time.perf_counter() - self.epoch_start)


def raw_mpi_optimizer(optimizer):
    """`optimizer` made to average the gradients with one blocking
    MPI_Allreduce (mpi4py, COMM_WORLD) in a tf.numpy_function: no
    negotiation, no fusion buffer, no background thread."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD

    def average(*arrays):
        flat = np.concatenate([a.ravel() for a in arrays])
        comm.Allreduce(MPI.IN_PLACE, flat, MPI.SUM)
        flat /= comm.size
        out, at = [], 0
        for a in arrays:
            out.append(flat[at:at + a.size].reshape(a.shape))
            at += a.size
        return out

    class RawMPI(type(optimizer)):
        def apply(self, grads, trainable_variables=None):
            grads = list(grads)
            reduced = tf.numpy_function(average, grads, [g.dtype for g in grads], stateful=True)
            for r, g in zip(reduced, grads):
                r.set_shape(g.shape)
            return super().apply(list(reduced), trainable_variables)

    return RawMPI.from_config(optimizer.get_config())


def after_first(times):
    """Median of `times` without the first epoch's (which includes tracing)."""
    return np.median(times[1:]) if len(times) > 1 else times[0]


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
    parser.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    parser.add_argument("--no-distribute", action="store_true",
                        help="train without the coordinator (the overhead baseline)")
    parser.add_argument("--world", type=int, default=1,
                        help="with --no-distribute: train on rank 0's shard of this many")
    parser.add_argument("--raw-mpi", action="store_true",
                        help="average with a bare MPI_Allreduce, no coordinator (the floor)")
    args = parser.parse_args()

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    if args.no_distribute:
        hvd = None
        # Under mpirun (the overhead baseline) each process takes "its" shard.
        rank, size = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0)), args.world
    elif args.raw_mpi:
        from mpi4py import MPI

        hvd = None
        rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
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

    exchanging = hvd is not None or args.raw_mpi
    # Different on every rank until the broadcast (raw MPI has none: same seed).
    keras.utils.set_random_seed(0 if args.raw_mpi else rank)
    if args.model == "cnn":
        x_train, x_test = x_train.reshape(-1, 8, 8, 1), x_test.reshape(-1, 8, 8, 1)
        L = keras.layers
        model = keras.Sequential([keras.Input((8, 8, 1)),
                                  L.Conv2D(32, 3, activation="relu"),
                                  L.Conv2D(64, 3, activation="relu"),
                                  L.MaxPooling2D(2), L.Dropout(0.25), L.Flatten(),
                                  L.Dense(128, activation="relu"), L.Dropout(0.5),
                                  L.Dense(10)])
    else:
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dense(10)])
    # The usual Horovod recipe: scale the learning rate by the number of ranks.
    lr = args.lr * (size if exchanging else 1)
    optimizer = keras.optimizers.SGD(lr, momentum=0.9)
    callbacks = []
    if args.raw_mpi:
        optimizer = raw_mpi_optimizer(optimizer)
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
    if exchanging:
        # Every rank holds the same model.
        fingerprint = float(sum(np.abs(w).sum() for w in model.get_weights()))
        if hvd:
            everyone = hvd.allgather([fingerprint]).numpy()
        else:
            everyone = np.array(MPI.COMM_WORLD.allgather(fingerprint))
        assert np.all(everyone == everyone[0]), f"ranks diverged: {everyone}"
    if rank == 0:
        print(f"median step time {after_first(timer.per_step) * 1e3:.3f} ms")
        print(f"median epoch time {after_first(timer.per_epoch) * 1e3:.1f} ms")
        mode = (f"{size} ranks" if hvd else f"{size} ranks, raw MPI" if args.raw_mpi
                else "without distribution")
        print(f"done: {mode}, final test accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
