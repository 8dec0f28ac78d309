"""A PyTorch model and a TensorFlow model trained in the same job, through one
coordinator.

    coordrun -np 2 python examples/mixed/torch_and_tensorflow.py [--epochs 5]

Both frontends are initialised in every process, and both share the one
background thread the first init() started: their gradients are negotiated
together, fused together where their dtypes allow, and show up in one
timeline. Each step trains the PyTorch MLP and the Keras MLP on the same
shard of the bundled digits; rank 0 prints both test accuracies.
"""

import argparse
import os
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402
from coordinator.digits import load_digits  # noqa: E402
from coordinator.digits import train_test_split  # noqa: E402

import frontends.tensorflow as hvd_tf  # noqa: E402
import frontends.torch as hvd_torch  # noqa: E402


def load(rank, size):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25,
                                                        random_state=0)
    return x_train[rank::size], y_train[rank::size], x_test, y_test


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    tf.config.threading.set_intra_op_parallelism_threads(1)
    torch.set_num_threads(1)
    hvd_torch.init()
    hvd_tf.init()  # joins the coordinator PyTorch started
    workers = [t for t in threading.enumerate() if t.name == "coordinator-background"]
    assert len(workers) == 1, f"{len(workers)} background threads"
    rank, size = hvd_torch.rank(), hvd_torch.size()
    assert (rank, size) == (hvd_tf.rank(), hvd_tf.size())
    x_train, y_train, x_test, y_test = load(rank, size)

    torch.manual_seed(0)
    torch_model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                      torch.nn.Linear(64, 10))
    torch_opt = hvd_torch.DistributedOptimizer(
        torch.optim.SGD(torch_model.parameters(), lr=0.1),
        named_parameters=torch_model.named_parameters())
    hvd_torch.broadcast_parameters(torch_model.state_dict(), root_rank=0)

    tf.random.set_seed(0)
    tf_model = tf.keras.Sequential([tf.keras.Input((64,)),
                                    tf.keras.layers.Dense(64, activation="relu"),
                                    tf.keras.layers.Dense(10)])
    tf_opt = tf.keras.optimizers.SGD(0.1)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    hvd_tf.broadcast_variables(tf_model.variables, root_rank=0)

    steps = len(x_train) // args.batch_size
    for epoch in range(1, args.epochs + 1):
        for step in range(steps):
            xb = x_train[step * args.batch_size:(step + 1) * args.batch_size]
            yb = y_train[step * args.batch_size:(step + 1) * args.batch_size]
            # PyTorch: gradients are submitted from backward hooks...
            torch_opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(torch_model(torch.from_numpy(xb)),
                                                     torch.from_numpy(yb))
            loss.backward()
            # ...and while they are in flight, TensorFlow submits its own.
            with hvd_tf.DistributedGradientTape(tf.GradientTape()) as tape:
                tf_loss = loss_fn(yb, tf_model(xb, training=True))
            grads = tape.gradient(tf_loss, tf_model.trainable_variables)
            tf_opt.apply_gradients(zip(grads, tf_model.trainable_variables))
            torch_opt.step()
        with torch.no_grad():
            torch_acc = (torch_model(torch.from_numpy(x_test)).argmax(1).numpy()
                         == y_test).mean()
        tf_acc = (np.argmax(tf_model(x_test).numpy(), axis=1) == y_test).mean()
        if rank == 0:
            print(f"epoch {epoch}  torch test accuracy {torch_acc:.4f}  "
                  f"tensorflow test accuracy {tf_acc:.4f}", flush=True)
    # Every rank ends with the same weights in both frameworks.
    w = np.array([sum(p.sum().item() for p in torch_model.parameters()),
                  sum(float(tf.reduce_sum(v)) for v in tf_model.variables)])
    assert np.allclose(hvd_torch.allgather(torch.from_numpy(w[None])).numpy(), w)
    if rank == 0:
        print(f"done: {size} ranks, one background thread, torch {torch_acc:.4f}, "
              f"tensorflow {tf_acc:.4f}")
    hvd_torch.shutdown()


if __name__ == "__main__":
    main()
