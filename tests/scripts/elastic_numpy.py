"""An elastic job on the core API (NumPy): every rank adds its ones to a
running sum, committed every COMMIT steps. One line per step
("step <n> rank <r> size <s> t=<time>"), a "done" line per rank at the end.

Knobs (environment), for tests/test_elastic_mpi.py:
  STEPS, COMMIT, STEP_SLEEP
  KILL_AT=<step>:<rank>[:<membership>],...  SIGKILL that rank at that step
      (in that membership, default 0)
  FAIL_HOST=<host>  a worker the driver placed on <host> SIGKILLs itself
      after FAIL_AFTER (default 3) steps, in every membership
  FAIL_OP_AT=<step>:<rank>  that rank's backend raises as it runs its next
      operation from that step on (in membership 0): the job fails on every
      rank, and goes on after a reset with every worker
  FAIL_OP_ALWAYS=1  ... in every membership: the resets do not repair it
  STOP_AT=<step>:<rank>[:<membership>]  SIGSTOP that rank at that step (it
      stays stopped: a hung worker)
  MISTAKE_AT=<step>:<kind>  at that step (in every membership) the program
      makes a mistake on every rank: kind "mismatch" (rank r allreduces
      r + 3 numbers) or "deadlock" (rank r allreduces a tensor named for r):
      the job must stop, not reset
  FINISH_AT=<step>:<rank>  that rank's training function returns at that
      step (in membership 0), as if its data ran out: the job stops
  RAISE_AT=<step>:<rank>  that rank's training raises a RuntimeError at that
      step (in membership 0): it leaves, the others go on without it
  OUTCOMES=<dir>  a rank that raises out of training writes its "raised"
      line to <dir>/rank<r> too
  OUTCOMES_AWAIT=<n>  a rank that wrote its outcome raises only once <n>
      ranks have (within 60 s): the launcher ends the job as the first rank
      exits, which on a loaded machine could be before a slower rank wrote
  LEDGER=1  every rank adds rank + 1 instead of ones, and the state keeps
      the size of each step's membership, so the final line can say what the
      total must be (" ledger <expected total> steps <steps in the ledger>")
"""

import os
import signal
import time

import numpy as np

import coordinator as hvd
from coordinator import elastic, runtime
from coordinator.elastic import membership

STEPS = int(os.environ.get("STEPS", "60"))
COMMIT = int(os.environ.get("COMMIT", "5"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))


def points(variable):
    """The (step, rank, membership) points of a KILL_AT-like variable."""
    return {tuple(int(v) for v in (item.split(":") + ["0"])[:3])
            for item in os.environ.get(variable, "").split(",") if item}


KILLS = points("KILL_AT")
STOPS = points("STOP_AT")
FAIL_HOST = os.environ.get("FAIL_HOST", "")
FAIL_AFTER = int(os.environ.get("FAIL_AFTER", "3"))
LEDGER = os.environ.get("LEDGER") == "1"
FINISHES = tuple(int(v) for v in os.environ["FINISH_AT"].split(":")) \
    if os.environ.get("FINISH_AT") else None
RAISES = tuple(int(v) for v in os.environ["RAISE_AT"].split(":")) \
    if os.environ.get("RAISE_AT") else None
OUTCOMES = os.environ.get("OUTCOMES", "")
OUTCOMES_AWAIT = int(os.environ.get("OUTCOMES_AWAIT", "0"))
FAIL_OP_ALWAYS = os.environ.get("FAIL_OP_ALWAYS") == "1"
MISTAKE = os.environ["MISTAKE_AT"].split(":") if os.environ.get("MISTAKE_AT") else None
FAIL_OP = tuple(int(v) for v in os.environ["FAIL_OP_AT"].split(":")) \
    if os.environ.get("FAIL_OP_AT") else None

hvd.init()
state = elastic.ObjectState(step=0, total=np.zeros(4), ledger=[])
me = membership.current()


def on_reset():
    print(f"reset: rank {hvd.rank()} of {hvd.size()} at step {state.step} "
          f"t={time.time():.3f}", flush=True)


state.register_reset_callbacks([on_reset])


class FailingOps:
    """The backend of this rank, whose next operation raises."""

    def __init__(self, ops):
        self.ops = ops

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def run(self, *args, **kwargs):
        runtime.current().background.ops = self.ops  # once
        raise MemoryError("injected: no memory for the fusion buffer")


def make_mistake(kind):
    print(f"mistake ({kind}) on rank {hvd.rank()} at step {state.step} t={time.time():.3f}",
          flush=True)
    if kind == "mismatch":
        hvd.allreduce(np.ones(3 + hvd.rank()), name="mistake")
    elif kind == "deadlock":
        hvd.allreduce(np.ones(3), name=f"mistake{hvd.rank()}")


def die(why):
    print(f"killing rank {hvd.rank()} ({why}) t={time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


@elastic.run
def train(state):
    started = state.step
    host = me.slot(timeout=10)[0] if FAIL_HOST else None
    while state.step < STEPS:
        now = (state.step, hvd.rank(), me.generation)
        if now in KILLS:
            die(f"step {state.step}")
        if now in STOPS:
            print(f"stopping rank {hvd.rank()} (step {state.step}) t={time.time():.3f}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if host == FAIL_HOST and state.step - started >= FAIL_AFTER:
            die(f"on failing host {host}")
        if FAIL_OP and (state.step, hvd.rank()) == FAIL_OP and (
                FAIL_OP_ALWAYS or me.generation == 0):
            print(f"failing the next operation of rank {hvd.rank()} at step {state.step}",
                  flush=True)
            bg = runtime.current().background
            bg.ops = FailingOps(bg.ops)
        if FINISHES and now == (*FINISHES, 0):
            print(f"rank {hvd.rank()} returns early at step {state.step}", flush=True)
            return
        if RAISES and now == (*RAISES, 0):
            raise RuntimeError(f"a bug in rank {hvd.rank()}'s training at step {state.step}")
        if MISTAKE and state.step == int(MISTAKE[0]):
            make_mistake(MISTAKE[1])
        mine = np.full(4, hvd.rank() + 1.0) if LEDGER else np.ones(4)
        got = hvd.allreduce(mine, op=hvd.Sum, name="g")
        state.total = state.total + got
        if LEDGER:
            state.ledger = state.ledger + [hvd.size()]
        state.step += 1
        print(f"step {state.step} rank {hvd.rank()} size {hvd.size()} t={time.time():.3f}",
              flush=True)
        time.sleep(STEP_SLEEP)
        if state.step % COMMIT == 0:
            state.commit()


try:
    train(state)
except Exception as exc:
    line = (f"rank {hvd.rank()} raised {type(exc).__name__}: {exc} "
            f"notes {getattr(exc, '__notes__', [])} t={time.time():.3f}")
    print(line, flush=True)
    if OUTCOMES:  # stdout may be cut short as the launcher ends the job
        with open(os.path.join(OUTCOMES, f"rank{hvd.rank()}"), "w") as f:
            f.write(line + "\n")
        end = time.monotonic() + 60
        while (len([n for n in os.listdir(OUTCOMES) if n.startswith("rank")]) < OUTCOMES_AWAIT
               and time.monotonic() < end):
            time.sleep(0.05)
    raise
ledger = (f" ledger {sum(n * (n + 1) / 2 for n in state.ledger)} steps {len(state.ledger)}"
          if LEDGER else "")
print(f"done rank {hvd.rank()} size {hvd.size()} step {state.step} total {state.total[0]}"
      + ledger, flush=True)
