"""A custom TensorFlow 2 training loop on the bundled digits, data-parallel
with Horovod's DistributedGradientTape.

    coordrun -np 2 python examples/tensorflow/gradient_tape_digits.py [--epochs 10]

Each rank trains on its own shard. The training step is a tf.function: the
tape's gradients are averaged across ranks by one grouped allreduce inside
the graph. After the first step, the model's and the optimizer's variables
are broadcast from rank 0 (Horovod's recipe: the optimizer's variables exist
only once it has taken a step). Rank 0 prints the loss and test accuracy
after each epoch.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from coordinator.digits import load_digits  # noqa: E402
from coordinator.digits import train_test_split  # noqa: E402

import frontends.tensorflow as hvd  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank")
    args = parser.parse_args()

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25,
                                                        random_state=0)
    per_rank = len(x_train) // size  # equal shards: every rank takes the same steps
    x_train = x_train[rank * per_rank:(rank + 1) * per_rank]
    y_train = y_train[rank * per_rank:(rank + 1) * per_rank]
    dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
               .shuffle(per_rank, seed=rank).batch(args.batch_size))

    keras.utils.set_random_seed(rank)  # different on every rank until the broadcast
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(args.lr * size, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    first = True
    for epoch in range(1, args.epochs + 1):
        losses = []
        for xb, yb in dataset:
            losses.append(float(train_step(xb, yb)))
            if first:
                hvd.broadcast_variables(model.variables, root_rank=0)
                hvd.broadcast_variables(optimizer.variables, root_rank=0)
                first = False
        loss = float(hvd.allreduce(tf.constant(np.mean(losses)), name="epoch_loss"))
        logits = model(x_test, training=False)
        accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
        if rank == 0:
            print(f"epoch {epoch:3d}  loss {loss:.4f}  test accuracy {accuracy:.4f}", flush=True)

    fingerprint = float(sum(np.abs(v.numpy()).sum() for v in model.trainable_variables))
    everyone = hvd.allgather(tf.constant([fingerprint], tf.float64)).numpy()
    assert np.all(everyone == everyone[0]), f"ranks diverged: {everyone}"
    if rank == 0:
        print(f"done: {size} ranks, final test accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
