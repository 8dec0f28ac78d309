"""Rank 1 is stopped (SIGSTOP) as it starts the first operation of a new
process set {0, 1}, and continued by rank 0 once it has warned that rank 1
has not answered (or RESUME seconds later at the latest: not after a time
alone, which a loaded machine could pass before the warning); rank 2 goes
on to a global allreduce meanwhile. Run with HOROVOD_STALL_CHECK_TIME_SECONDS=2.
Making a set's communicator blocks until every member makes it; rank 0
does so in a helper thread (as the set is added; until bb4b04b, on the
set's first operation, where rank 1 stopped before making it), so its
coordinator keeps answering: rank 0 names rank 1, and nobody names rank 0.
Every rank prints `RANK r: done` once both allreduces are through."""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import peers  # noqa: E402

import coordinator as hvd  # noqa: E402
from coordinator import runtime  # noqa: E402

RESUME = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0

hvd.init(process_sets="dynamic")
me = hvd.rank()
pids = hvd.allgather(np.array([os.getpid()], np.int64), name="pids")
pair = hvd.add_process_set([0, 1])


if me == 0:
    peers.continue_on_warning(1, int(pids[1]))


class StopAtTheSet:
    """Wraps rank 1's backend: stops the process as the set's first
    operation starts there."""

    def __init__(self, ops):
        self.ops = ops

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def run(self, response, *args, **kwargs):
        if response.process_set_id == pair.process_set_id:
            runtime.current().background.ops = self.ops  # once
            print(f"RANK {me}: stopping at {time.time():.3f}", flush=True)
            # The process stops as each thread next enters the kernel, this
            # one possibly after posting its part (seen once the set's
            # communicator was made before): it waits (settles) until it has.
            peers.stop_self(RESUME, settle=1.0)
        return self.ops.run(response, *args, **kwargs)


if me == 1:
    bg = runtime.current().background
    bg.ops = StopAtTheSet(bg.ops)
if me in (0, 1):
    out = hvd.allreduce(np.full(3, me + 1.0), op=hvd.Sum, name="a", process_set=pair)
    assert out[0] == 3.0, out
out = hvd.allreduce(np.ones(3), op=hvd.Sum, name="g")
assert out[0] == hvd.size(), out
print(f"RANK {me}: done", flush=True)
