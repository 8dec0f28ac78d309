"""An elastic job that uses a dynamic process set across resets: the pair
[0, 1] allreduces beside the global set in every step. The coordinator's
shutdown as the job re-forms releases the set, and a reset callback adds
the same `ProcessSet` object again; a worker spawned later adds it at the
top, as every rank did at the start. One line per step
("step <n> rank <r> size <s> pair <sum>"), a "done" line per rank.

Knobs (environment), for tests/test_elastic_mpi.py:
  STEPS, COMMIT, STEP_SLEEP
  KILL_AT=<step>:<rank>  SIGKILL that rank at that step, in membership 0
"""

import os
import signal
import time

import numpy as np

import coordinator as hvd
from coordinator import elastic
from coordinator.elastic import membership

STEPS = int(os.environ.get("STEPS", "40"))
COMMIT = int(os.environ.get("COMMIT", "5"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.05"))
KILL_AT = tuple(int(v) for v in os.environ["KILL_AT"].split(":")) \
    if os.environ.get("KILL_AT") else None

hvd.init(process_sets="dynamic")
pair = hvd.add_process_set(hvd.ProcessSet([0, 1]))
state = elastic.ObjectState(step=0, total=np.zeros(4))
me = membership.current()


def on_reset():
    released = pair.process_set_id is None
    hvd.add_process_set(pair)
    print(f"reset: rank {hvd.rank()} of {hvd.size()} at step {state.step}: the pair was "
          f"{'released' if released else 'still registered'}, now set "
          f"{pair.process_set_id}", flush=True)


state.register_reset_callbacks([on_reset])


@elastic.run
def train(state):
    while state.step < STEPS:
        if KILL_AT == (state.step, hvd.rank()) and me.generation == 0:
            print(f"killing rank {hvd.rank()} at step {state.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        state.total = state.total + hvd.allreduce(np.ones(4), op=hvd.Sum, name="g")
        got = None
        if pair.included():
            got = hvd.allreduce(np.full(2, hvd.rank() + 1.0), op=hvd.Sum, name="p",
                                process_set=pair)[0]
        state.step += 1
        print(f"step {state.step} rank {hvd.rank()} size {hvd.size()} pair {got}", flush=True)
        time.sleep(STEP_SLEEP)
        if state.step % COMMIT == 0:
            state.commit()


train(state)
print(f"done rank {hvd.rank()} size {hvd.size()} step {state.step} total {state.total[0]}",
      flush=True)
