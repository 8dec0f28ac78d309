"""Two sets registered one after the other, at np=4, as rounds register
them on every member: X = {0, 1, 2}, whose device-lane communicator
(mpi_ops.Communicators.start) was still being made as Y = {0, 2, 3} asked
for its host and device-lane ones (as in the run that found this). Rank 3
registers Y only once X's communicator is made on all of X's members (they
tell it), as a rank whose background thread waits on X's work would.
ROUNDS times, with new sets each time.

Open MPI 5.0 lets MPI_Comm_create_group calls started together on one
parent block each other: made in a thread each, X now and then never
finished while Y waited for rank 3, and rank 3 waited for X. Prints
"OK <rank>" when every set's communicators are made; "STUCK <rank>" after
WAIT seconds."""

import os
import sys
import time

from mpi4py import MPI

from coordinator.ops import mpi_ops

WAIT = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 16
TOLD = 7
X_RANKS, Y_RANKS = [0, 1, 2], [0, 2, 3]


def made(comms, pid, deadline):
    """Whether `pid`'s communicators were made (or never asked for) in time."""
    for comm in comms:
        making = comm._making.get(pid)
        while making is not None and not making.done.wait(0.01):
            if time.monotonic() > deadline:
                return False
    return True


def round_(world, comms, x, y, deadline):
    me = world.rank
    world.Barrier()  # every rank starts together
    if me in X_RANKS:
        comms[1].start(x)
        for c in comms:
            c.start(y)  # not a member of Y (rank 1): nothing to make
        if not made(comms, x, deadline):
            return False
        world.send(me, dest=3, tag=TOLD)
        return made(comms, y, deadline)
    told = [world.irecv(source=r, tag=TOLD) for r in X_RANKS]
    while not all(req.Test() for req in told):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    for c in comms:
        c.start(y)
    return made(comms, y, deadline)


def main():
    world = MPI.COMM_WORLD
    data = world.Dup()
    sets = {}
    order = mpi_ops.InOrder()
    comms = [mpi_ops.Communicators(data, sets.get, order=order),
             mpi_ops.Communicators(data, sets.get, tag=mpi_ops.DEVICE_SET_TAG,
                                   reuse_world=False, order=order)]
    deadline = time.monotonic() + WAIT
    ok = True
    for r in range(ROUNDS):
        x, y = 2 * r + 1, 2 * r + 2
        sets[x], sets[y] = X_RANKS, Y_RANKS
        ok = round_(world, comms, x, y, deadline)
        if not ok:
            break
    print(f"{'OK' if ok else 'STUCK'} {world.rank}", flush=True)
    if not ok:
        os._exit(1)  # threads stuck in MPI would hold up Finalize


if __name__ == "__main__":
    main()
