"""A ChainerMN job whose rank 1 raises (a bug of its own) while the others
wait for it in a communicator method: argv[1] names which. Each waiting
rank writes what it got, and after how long, to OUTCOMES/<rank>.

Until the `_obj` methods and the arrays' shapes moved to the core, the
others waited in mpi4py's collectives for good (rank 1 waited for them in
MPI_Finalize)."""

import os
import sys
import time

import numpy as np

import frontends.chainer as chainermn

OPS = {
    "gather_obj": lambda comm: comm.gather_obj({"x": 1}),
    "bcast_obj": lambda comm: comm.bcast_obj(None, root=1),
    "allreduce_obj": lambda comm: comm.allreduce_obj(1),
    "allgather": lambda comm: comm.allgather(np.ones(3, np.float32)),
    "alltoall": lambda comm: comm.alltoall([np.ones(2, np.float32)] * comm.size),
    "scatter": lambda comm: comm.scatter(np.ones((comm.size, 2), np.float32), root=1),
    "recv_obj": lambda comm: comm.recv_obj(1),
}


def main():
    op = sys.argv[1]
    comm = chainermn.create_communicator("naive")
    comm.bcast_obj("started")  # everyone is up
    if comm.rank == 1:
        time.sleep(0.5)
        raise ValueError("a bug in rank 1's training")
    start = time.monotonic()
    try:
        OPS[op](comm)
        outcome = "returned"
    except Exception as exc:  # noqa: BLE001 - the outcome is the point
        outcome = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(os.environ["OUTCOMES"], str(comm.rank)), "w") as f:
        f.write(f"{time.monotonic() - start:.1f}\n{outcome}\n")


if __name__ == "__main__":
    main()
