"""The classic hang of uneven data without join(), in Keras and PyTorch:
one rank has one batch more, and the other, done training, calls a
collective on its accuracy. Each rank's framework runs the collectives on
its own threads (Keras's fit() inside TensorFlow's executor); the deadlock
check still sees that both wait on each other, and both fail after
COORDINATOR_DEADLOCK_SECONDS=2 (set by tests/test_lifecycle_mpi.py), where
the job used to wait for ever (Horovod's does)."""

import time

import numpy as np

from tf_common import configure_tensorflow

configure_tensorflow()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402

import frontends.tensorflow.keras as hvd_keras  # noqa: E402
import frontends.torch as hvd_torch  # noqa: E402


def setup(core):
    hvd_keras.init()
    hvd_torch.init()


def _expect_deadlock(fn):
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # Keras wraps the StallError in TensorFlow's error
        text = str(exc)
        assert "Deadlocked" in text and "(COORDINATOR_DEADLOCK_SECONDS)" in text, text
        assert time.monotonic() - start < 60
        return text
    raise AssertionError("no deadlock error")


def case_keras_fit_with_one_batch_more_on_rank_0(hvd):
    me = hvd_keras.rank()
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="mse")
    rows = 40 if me == 0 else 32  # 5 batches of 8 against 4
    x = np.random.rand(rows, 4).astype("float32")
    y = np.random.rand(rows, 2).astype("float32")

    def train_then_report():
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
        hvd_keras.allreduce(tf.constant([1.0]), name="keras.accuracy")

    text = _expect_deadlock(train_then_report)
    if me == 1:
        assert "'keras.accuracy'" in text, text
    hvd_keras.allreduce(tf.constant([1.0]), name="keras.after")  # the job goes on


def case_torch_optimizer_with_one_batch_more_on_rank_0(hvd):
    me = hvd_torch.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = hvd_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    hvd_torch.broadcast_parameters(model.state_dict(), root_rank=0)

    def train_then_report():
        for _ in range(5 if me == 0 else 4):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
        hvd_torch.allreduce(torch.tensor([1.0]), name="torch.accuracy")

    text = _expect_deadlock(train_then_report)
    assert ("'allreduce.torch.accuracy'" in text) if me == 1 else ("'allreduce.weight'" in text
                                                                   or "'allreduce.bias'" in text), text
    hvd_torch.allreduce(torch.tensor([1.0]), name="torch.after")
