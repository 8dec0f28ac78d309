"""One rank is stopped (SIGSTOP) while the others wait in an MPI call of
the program's own, outside the coordinator, with nothing of the
coordinator's in flight: they used to wait there for good. Run with
COORDINATOR_SILENT_RANK_SECONDS set low.

    stopped_beside_raw_mpi.py MODE VICTIM [BRIEF]

MODE: `world`, a raw `MPI.COMM_WORLD.Barrier()`; `chainer`, ChainerMN's
`comm.mpi_comm.Barrier()` (frontends.chainer); `set`, a barrier on the
communicator a process set was made from (ranks 0 and 1, 2 and 3, ...);
`split`, a barrier on a communicator the program split from
`MPI.COMM_WORLD` after init() and told nobody of. Every other rank prints what
its barrier did and what its next allreduce raised, as `RANK r: <what>
after <seconds> s: <message>`; then they continue the victim, which
prints what it saw and everyone leaves. With BRIEF (seconds, under the
silence limit) the victim is stopped only that long, then takes its part
in the barrier and the allreduce, which pass everywhere."""

import os
import signal
import socket
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import peers  # noqa: E402

import coordinator as hvd  # noqa: E402
from mpi4py import MPI  # noqa: E402

MODE, VICTIM = sys.argv[1], int(sys.argv[2])
BRIEF = float(sys.argv[3]) if len(sys.argv) > 3 else None
RESUME = BRIEF or 60.0

if MODE == "set":  # (Horovod's way: a set given to init() by a communicator)
    comm = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.rank // 2)  # ranks 0 and 1, 2 and 3, ...
    hvd.init(process_sets=[hvd.ProcessSet(comm)])
else:
    hvd.init()
if MODE == "chainer":
    import frontends.chainer as chainermn

    comm = chainermn.create_communicator("naive").mpi_comm
elif MODE == "world":
    comm = MPI.COMM_WORLD
elif MODE == "split":
    comm = MPI.COMM_WORLD.Split(0, MPI.COMM_WORLD.rank)
me = hvd.rank()
# (pid, host): only a rank of the victim's host can continue it (the hosts
# of tests/test_multihost.py have PID namespaces of their own).
pids = hvd.allgather_object((os.getpid(), socket.gethostname()))
reports = hvd.broadcast_object(os.environ.get("REPORTS_DIR") or tempfile.mkdtemp(
    prefix="stopped-raw-") if me == 0 else None)
hvd.allreduce(np.ones(1), name="warm-up")


def say(what, start, message):
    print(f"RANK {me}: {what} after {time.monotonic() - start:.1f} s: {message}", flush=True)


def barrier():
    start = time.monotonic()
    try:
        comm.Barrier()
        say("barrier passed", start, "")
    except MPI.Exception as exc:
        say("MPI.Exception", start, exc.Get_error_string())


def allreduce():
    start = time.monotonic()
    try:
        hvd.allreduce(np.ones(1), name="after")
        say("allreduce passed", start, "")
    except hvd.HorovodInternalError as exc:
        say(type(exc).__name__, start, exc)


# The others enter their barrier once the victim is about to stop, not
# before: spinning in it, they kept the victim off a loaded machine's cores
# for the silence limit in one run of the suite, and it was named before it
# had stopped (then failed the warm-up, and exited before it could be continued).
if me == VICTIM:
    peers.leave_mark(reports, f"stopping.{me}")
    peers.stop_self(RESUME)
    if BRIEF:
        barrier()
    allreduce()
    peers.leave_mark(reports, f"victim.{me}")
else:
    peers.marked(reports, [f"stopping.{VICTIM}"], 60.0)
    barrier()
    allreduce()
    peers.leave_mark(reports, f"other.{me}")
    peers.marked(reports, [f"other.{r}" for r in range(len(pids)) if r != VICTIM], 60.0)
    if pids[VICTIM][1] == socket.gethostname():
        os.kill(pids[VICTIM][0], signal.SIGCONT)
    peers.marked(reports, [f"victim.{VICTIM}"], 60.0)
hvd.shutdown()
print(f"RANK {me}: done", flush=True)
