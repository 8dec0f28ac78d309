"""Rank 0 gives up on three requests, as the coordinator does when a peer
never comes (a negotiation cycle in flight at shutdown, an abandoned
collective, a control message it cancels), and exits. Rank 1 posts its
side of each only once rank 0 has dropped its last reference to them and
is exiting: MPI completes them during rank 0's MPI_Finalize, which waits in
its closing fence for rank 1 and progresses them meanwhile.

Every buffer is larger than MALLOC_MMAP_THRESHOLD_ (tests/test_leftovers_mpi.py
sets it to 64 KiB): glibc unmaps such a buffer when it is freed, so MPI
touching it after Python freed it is a SIGSEGV rather than a silent
corruption. `--unkept PART` drops the coordinator's keeping of one part
(cycle, operations or sends: leftovers.keep does nothing for it), to show
that it would be.

Usage: mpirun -n 2 python late_peer_at_exit.py SIGNAL_FILE [--unkept PART]
"""

import atexit
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from coordinator import leftovers
from coordinator.control_channel import ControlChannel, Cycle
from coordinator.executor import Executor, Operation
from coordinator.ops.mpi_ops import wait

SIGNAL = sys.argv[1]
UNKEPT = sys.argv[sys.argv.index("--unkept") + 1] if "--unkept" in sys.argv else None
part = None  # the part rank 0 is giving up on


def _keep_but_unkept(obj, keep=leftovers.keep):
    if part != UNKEPT:
        keep(obj)


leftovers.keep = _keep_but_unkept
# Past Open MPI's eager limits (4 KiB in shared memory): the sender's
# buffer is read when the receiver matches it, not when it is posted. And
# past the mmap threshold, as is every buffer here.
MESSAGE_BYTES = 1 << 20
ELEMS = 1 << 16
SLOTS = 64 * 16384  # the cycle's words: 2 x 16384 x 8 bytes
PAYLOAD_WORDS = 16384
TAG = 5

comm = MPI.COMM_WORLD
cycle_comm, payload_comm, op_comm, channel_comm = (comm.Dup() for _ in range(4))


def new_cycle():
    return Cycle(cycle_comm, SLOTS, payload_comm, payload_capacity=PAYLOAD_WORDS)


def give_up():
    """Rank 0: starts its side of each and lets go of it (its last reference
    goes as this returns)."""
    global part
    part = "cycle"
    cycle = new_cycle()
    cycle.set(SLOTS - 1)
    cycle.payload_out(PAYLOAD_WORDS)[:] = 1.0
    cycle.post(flags=0, now=time.monotonic())
    cycle.close()  # still in flight: rank 1 has not posted

    def allreduce():
        buf = np.ones(ELEMS)
        yield wait(op_comm.Iallreduce(MPI.IN_PLACE, [buf, MPI.DOUBLE], MPI.SUM))
        return [buf]

    part = "operations"
    executor = Executor()
    executor.start(Operation(None, [], ["late"], (0, -1), allreduce()))  # (set, host)
    assert len(executor.abandon()) == 1
    part = "sends"
    channel = ControlChannel(channel_comm)
    channel.send(1, TAG, bytes(MESSAGE_BYTES))
    channel.cancel_sends()
    # Rank 1 goes on once rank 0 has let go and nothing will progress MPI
    # here before MPI_Finalize.
    atexit.register(lambda: open(SIGNAL, "w").close())


def complete_late():
    """Rank 1: waits for rank 0 to exit, then completes all three."""
    while not os.path.exists(SIGNAL):
        time.sleep(0.05)
    cycle = new_cycle()
    cycle.set(SLOTS - 1)
    cycle.payload_out(PAYLOAD_WORDS)[:] = 2.0
    cycle.post(flags=0, now=time.monotonic())
    while (result := cycle.test()) is None:
        pass
    assert result[0] == [SLOTS - 1] and (cycle.payload == 3.0).all(), result
    buf = np.ones(ELEMS)
    # (a non-blocking collective matches only non-blocking ones)
    op_comm.Iallreduce(MPI.IN_PLACE, [buf, MPI.DOUBLE], MPI.SUM).Wait()
    assert (buf == 2.0).all()
    message = bytearray(MESSAGE_BYTES)
    channel_comm.Recv([message, MPI.BYTE], 0, TAG)
    cycle.close()
    print("rank 1 completed them", flush=True)


if comm.rank == 0:
    give_up()
else:
    complete_late()
