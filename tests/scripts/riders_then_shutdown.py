"""Every rank runs the same tiny allreduces, then shuts down at once.

A rider completes with its cycle, so a fast rank can finish its last one
and shut down before a slower rank has read that cycle: the slower rank must
still complete it, not fail it with a ShutdownError. With `--slow-reader`,
rank 0 reads the last cycle 0.3 s after it completed (as a descheduled
thread would), so that the other ranks' shutdown
always arrives first. Prints one line per rank: its count of results and of
wrong results."""

import argparse
import threading
import time

import numpy as np

import coordinator as hvd
from coordinator import background

parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int, nargs="?", default=400)
parser.add_argument("--slow-reader", action="store_true")
args = parser.parse_args()

hvd.init()
rank, size = hvd.rank(), hvd.size()
last_submitted = threading.Event()

if args.slow_reader and rank == 0:
    from mpi4py import MPI

    from coordinator import control_channel

    test = control_channel.Cycle.test
    hold = []

    def slow_test(self):
        # Once the last step is submitted, this thread leaves the cycle in
        # flight for 0.3 s (as a descheduled thread would), while MPI still
        # progresses it, so that the others finish and shut down first.
        if last_submitted.is_set():
            if not hold:
                hold.append(time.monotonic() + 0.3)
            if time.monotonic() < hold[0]:
                self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=4242)  # MPI progress
                self.moved = False
                return None
        return test(self)

    control_channel.Cycle.test = slow_test

wrong = 0
for step in range(args.steps):
    handle = hvd.allreduce_async(np.array([rank + step], np.float32), name="x", op=hvd.Sum)
    if step == args.steps - 1:
        last_submitted.set()
    got = hvd.synchronize(handle)
    wrong += int(got[0] != sum(r + step for r in range(size)))
print(f"rank {rank}: {args.steps} results, {wrong} wrong", flush=True)
hvd.shutdown()
