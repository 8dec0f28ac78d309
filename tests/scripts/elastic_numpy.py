"""An elastic job on the core API (NumPy): every rank adds its ones to a
running sum, committed every COMMIT steps. One line per step
("step <n> rank <r> size <s> t=<time>"), a "done" line per rank at the end.

Knobs (environment), for tests/test_elastic_mpi.py:
  STEPS, COMMIT, STEP_SLEEP
  KILL_AT=<step>:<rank>[:<membership>],...  SIGKILL that rank at that step
      (in that membership, default 0)
  FAIL_HOST=<host>  a worker the driver placed on <host> SIGKILLs itself
      after FAIL_AFTER (default 3) steps, in every membership
"""

import os
import signal
import time

import numpy as np

import coordinator as hvd
from coordinator import elastic
from coordinator.elastic import membership

STEPS = int(os.environ.get("STEPS", "60"))
COMMIT = int(os.environ.get("COMMIT", "5"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))
KILLS = [tuple(int(v) for v in (item.split(":") + ["0"])[:3])
         for item in os.environ.get("KILL_AT", "").split(",") if item]
FAIL_HOST = os.environ.get("FAIL_HOST", "")
FAIL_AFTER = int(os.environ.get("FAIL_AFTER", "3"))

hvd.init()
state = elastic.ObjectState(step=0, total=np.zeros(4))
me = membership.current()


def on_reset():
    print(f"reset: rank {hvd.rank()} of {hvd.size()} at step {state.step} "
          f"t={time.time():.3f}", flush=True)


state.register_reset_callbacks([on_reset])


def die(why):
    print(f"killing rank {hvd.rank()} ({why}) t={time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


@elastic.run
def train(state):
    started = state.step
    host = me.slot(timeout=10)[0] if FAIL_HOST else None
    while state.step < STEPS:
        for step, rank, generation in KILLS:
            if (state.step, hvd.rank(), me.generation) == (step, rank, generation):
                die(f"step {step}")
        if host == FAIL_HOST and state.step - started >= FAIL_AFTER:
            die(f"on failing host {host}")
        got = hvd.allreduce(np.ones(4), op=hvd.Sum, name="g")
        state.total = state.total + got
        state.step += 1
        print(f"step {state.step} rank {hvd.rank()} size {hvd.size()} t={time.time():.3f}",
              flush=True)
        time.sleep(STEP_SLEEP)
        if state.step % COMMIT == 0:
            state.commit()


train(state)
print(f"done rank {hvd.rank()} size {hvd.size()} step {state.step} total {state.total[0]}",
      flush=True)
