"""One rank's part in a collective fails after every rank agreed to run it
(its backend raises, as an allocation or a driver call can): the others may
already be in the collective and would wait for it forever. Every rank
prints what its training loop saw: `RANK r: <ExceptionType> at step <n>:
<message>`, or `RANK r: finished`. The victim's loop goes on after an error
(as a loop that retries would), so a survivor that hangs cannot be ended by
the victim's exit.

Usage: failing_rank.py WHERE VICTIM [SOLO]
  WHERE  start:  the backend raises as it is asked to run the operation;
         run:    the operation's generator raises once started;
         thread: the background thread itself fails (a bug) as it takes
                 up the operation;
         skip:   the background thread drops the operation (a bug: the
                 ranks disagree on what runs), so the others wait in it
                 while the victim answers; run with stall checks on.
  SOLO   the failing operation runs in a process set of the victim alone:
         only that tensor fails, and the job goes on.
"""

import sys
import time

import numpy as np

import coordinator as hvd
from coordinator import runtime

WHERE = sys.argv[1]
VICTIM = int(sys.argv[2])
SOLO = len(sys.argv) > 3 and sys.argv[3] == "solo"
FAIL_AT = 20
STEPS = 60


class FailingOps:
    """Wraps the victim's backend: its FAIL_AT-th operation fails."""

    def __init__(self, ops, fail_at):
        self.ops = ops
        self.fail_at = fail_at
        self.count = 0

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def run(self, response, *args, **kwargs):
        self.count += 1
        if self.count != self.fail_at:
            return self.ops.run(response, *args, **kwargs)
        if WHERE == "start":
            raise MemoryError("injected: no memory for the fusion buffer")

        def failing():
            yield None
            raise RuntimeError("injected: the transport failed mid-operation")
        return failing()


hvd.init(process_sets="dynamic" if SOLO else None)
me = hvd.rank()
solo = hvd.add_process_set([VICTIM]) if SOLO else None
if me == VICTIM and WHERE in ("thread", "skip"):
    bg = runtime.current().background
    execute, calls = bg._execute, []

    def failing_execute(resp, *args, **kwargs):
        calls.append(resp)
        if len(calls) == FAIL_AT:
            if WHERE == "skip":
                return None
            raise KeyError("injected: a bug in the background thread")
        return execute(resp, *args, **kwargs)
    bg._execute = failing_execute
elif me == VICTIM:
    bg = runtime.current().background
    # With SOLO, the victim's first operation after the set's registration
    # is the solo allreduce below.
    bg.ops = FailingOps(bg.ops, 1 if SOLO else FAIL_AT)
if SOLO and me == VICTIM:
    try:
        hvd.allreduce(np.ones(3), name="alone", process_set=solo)
    except hvd.HorovodInternalError as exc:
        print(f"RANK {me}: solo failed: {exc}", flush=True)
failures = 0
for step in range(STEPS):
    try:
        out = hvd.allreduce(np.full(1000, step, np.float64), op=hvd.Sum, name="grad")
        assert out[0] == step * hvd.size(), (step, out[0])
    except (hvd.HorovodInternalError, hvd.StallError) as exc:
        failures += 1
        if failures == 1:
            print(f"RANK {me}: {type(exc).__name__} at step {step}: {exc}", flush=True)
        if me != VICTIM:
            break
    time.sleep(0.002)
else:
    if not failures:
        print(f"RANK {me}: finished", flush=True)
sys.stdout.flush()
# The victim stays alive a while after its loop (a process busy elsewhere):
# the others must not need its exit to learn that it failed. The others
# stay until the victim has gone through its loop, so that the job's end is
# the script's, not an exit that ends the job for them.
time.sleep(5.0 if me == VICTIM and not SOLO else 1.0)
