"""Training-like loop for timeline tests.

    timeline_job.py MODE OUT [STEPS]

MODE: "straggler" (rank 1 is 250 ms late with 'grad.late' every step),
"sigkill" (rank 0 kills itself mid-run), "runtime" (start/stop_timeline at
run time, twice)."""

import os
import signal
import sys
import time

import numpy as np

import coordinator as hvd

mode, out = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 8
hvd.init()
rank = hvd.rank()


def step(i):
    handles = [hvd.allreduce_async(np.full((3, 4), float(i), np.float32), name="grad.early"),
               hvd.allreduce_async(np.full(6, float(i), np.float32), name="grad.early2"),
               hvd.allreduce_async(np.ones(5, np.float64), name="grad.other"),
               hvd.broadcast_async(np.arange(3, dtype=np.int32), root_rank=0, name="params")]
    if mode == "straggler" and rank == 1:
        # Late by more than a loaded machine holds up a rank now and then:
        # with 40 ms, a rank held up that long before another tensor would
        # make that tensor the worst stall.
        time.sleep(0.25)
    handles.append(hvd.allreduce_async(np.ones(7, np.float32), name="grad.late"))
    for h in handles:
        hvd.synchronize(h)


if mode == "runtime":
    step(0)
    hvd.start_timeline(out + ".1", mark_cycles=True)
    step(1)
    step(2)
    hvd.stop_timeline()
    step(3)
    hvd.start_timeline(out + ".2")
    step(4)
    hvd.stop_timeline()
else:
    for i in range(steps):
        if mode == "sigkill" and rank == 0 and i == steps // 2:
            time.sleep(0.3)  # let the writer flush some batches first
            os.kill(os.getpid(), signal.SIGKILL)
        step(i)
hvd.shutdown()
