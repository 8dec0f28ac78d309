"""An elastic Keras job (Horovod's Keras elastic example, shrunk): a small
dense model on synthetic data, trained with model.fit and the elastic
callbacks. Prints one line per step ("step <n> size <s> t=<time>") and, at
the end, a checksum of the weights on every rank.

Knobs (environment): EPOCHS, COMMIT, STEP_SLEEP; KILL_AT=<step>:<rank>
SIGKILLs that rank of the first membership at that step.
"""

import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import frontends.tensorflow.keras as hvd  # noqa: E402

EPOCHS = int(os.environ.get("EPOCHS", "3"))
COMMIT = int(os.environ.get("COMMIT", "2"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))
KILL_AT = os.environ.get("KILL_AT", "")
BATCH = 8
LR = 0.05

hvd.init()
rng = np.random.default_rng(0)
x = rng.standard_normal((384, 10)).astype(np.float32)
y = (x.sum(axis=1) > 0).astype(np.float32)

keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1)])
optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(LR * hvd.size(), momentum=0.9))
model.compile(optimizer=optimizer, loss=keras.losses.BinaryCrossentropy(from_logits=True),
              jit_compile=False)
state = hvd.elastic.KerasState(model, batch=0, epoch=0, steps=0)


def on_reset():
    optimizer.learning_rate.assign(LR * hvd.size())
    print(f"reset: rank {hvd.rank()} of {hvd.size()} at epoch {state.epoch} "
          f"t={time.time():.3f}", flush=True)


state.register_reset_callbacks([on_reset])


class Steps(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if not KILL_AT:
            return
        step, victim = map(int, KILL_AT.split(":"))
        from coordinator.elastic import membership
        if (state.steps == step and hvd.rank() == victim
                and membership.current().generation == 0):
            print(f"killing rank {victim} at step {step} t={time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, batch, logs=None):
        state.steps += 1
        print(f"step {state.steps} size {hvd.size()} rank {hvd.rank()} "
              f"t={time.time():.3f}", flush=True)
        time.sleep(STEP_SLEEP)


@hvd.elastic.run
def train(state):
    shard_x, shard_y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    model.fit(shard_x, shard_y, batch_size=BATCH, epochs=EPOCHS - state.epoch,
              steps_per_epoch=len(shard_x) // BATCH, shuffle=False, verbose=0,
              callbacks=[Steps(),
                         hvd.elastic.CommitStateCallback(state, batches_per_commit=COMMIT),
                         hvd.elastic.UpdateBatchStateCallback(state),
                         hvd.elastic.UpdateEpochStateCallback(state)])


train(state)
weights = np.concatenate([w.ravel() for w in model.get_weights()]).astype(np.float64)
print(f"final rank {hvd.rank()} size {hvd.size()} epoch {state.epoch} "
      f"checksum {weights.sum():.12e} {np.abs(weights).sum():.12e}", flush=True)
