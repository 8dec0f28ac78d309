"""A job for tests/test_multihost.py, run by coordrun on two hosts.

    multihost_job.py check GO_FILE   topology and exact allreduces, then wait
                                     for GO_FILE (the test looks at the
                                     sockets meanwhile)
    multihost_job.py train           allreduce until something fails
"""

import os
import socket
import sys
import time

import numpy as np

import coordinator as hvd


def algorithm_calls():
    """Calls of the host-aware allreduce in use, or None for none."""
    from coordinator import runtime

    algorithms = runtime.current().ops.backends[-1].algorithms
    return algorithms[0].calls if algorithms else None


def check(go_file):
    me, n = hvd.rank(), hvd.size()
    print(f"RANK {me} HOST {socket.gethostname()} local {hvd.local_rank()}/{hvd.local_size()} "
          f"cross {hvd.cross_rank()}/{hvd.cross_size()}", flush=True)
    before = algorithm_calls()
    for count in (1, 7, 1000, 16 * 1024 + 3, 1 << 20):  # up to 4 MiB of float32
        for dtype in (np.float32, np.float64, np.int32):
            inputs = [(np.arange(count) % 97 + 13 * r).astype(dtype) for r in range(n)]
            out = hvd.allreduce(inputs[me], op=hvd.Sum, name=f"sum.{count}.{np.dtype(dtype)}")
            assert np.array_equal(out, np.sum(inputs, axis=0, dtype=dtype)), (count, dtype)
    avg = hvd.allreduce(np.full(5, float(me)), name="avg")
    assert np.allclose(avg, np.mean(range(n))), avg
    after = algorithm_calls()
    print(f"RANK {me} EXACT algorithm calls {None if after is None else after - before}",
          flush=True)
    watch = _network_watch()
    deadline = time.monotonic() + 10
    while watch is not None and watch.listening and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"RANK {me} READY watching {watch.watching if watch else []} pid {os.getpid()}",
          flush=True)
    while not os.path.exists(go_file):
        time.sleep(0.05)
    hvd.shutdown()
    print(f"RANK {me} DONE", flush=True)


def _network_watch():
    from coordinator import runtime

    return runtime.current().monitor.network


def train():
    start = time.monotonic()
    print(f"RANK {hvd.rank()} TRAINING pid {os.getpid()}", flush=True)
    try:
        while True:
            hvd.allreduce(np.ones(1000), name="grad")
            time.sleep(0.005)
    except Exception as exc:
        print(f"RANK {hvd.rank()} RAISED after {time.monotonic() - start:.1f} s "
              f"{type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    hvd.init()
    if sys.argv[1] == "check":
        check(sys.argv[2])
    else:
        train()
