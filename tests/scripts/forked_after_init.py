"""Processes forked from a rank after init() (run by tests/test_fork_mpi.py
at np=2). argv[1]:
  core     an os.fork child tries the core's collectives, init() and
           shutdown(), then exits normally with status 3 (its atexit
           handlers run);
  torch    a DataLoader's workers (num_workers=2) ask their rank and try an
           allreduce;
  chainer  an os.fork child of a ChainerMN rank tries the communicator's
           object, array and point-to-point calls, then exits normally.
A fork has the coordinator's state but not its thread, and MPI is its
parent's: each call prints what it did (a collective used to wait there for
good, and send_obj/recv_obj used the parent's connections). Then every rank
runs a collective, so a fork that disturbed the job shows."""

import os
import sys

import numpy as np

mode = sys.argv[1]


def attempt(name, call):
    try:
        call()
        return f"{name} returned"
    except Exception as exc:
        return f"{name} raised {type(exc).__name__}: {exc}"


def report(lines):
    print("\n".join(lines), flush=True)


if mode == "core":
    import coordinator as hvd

    hvd.init()
    rank = hvd.rank()
    pid = os.fork()
    if pid == 0:
        report([f"child of {rank}: rank {hvd.rank()} size {hvd.size()}",
                attempt("allreduce", lambda: hvd.allreduce(np.ones(2), name="c")),
                attempt("barrier", hvd.barrier),
                attempt("join", hvd.join),
                attempt("broadcast_object", lambda: hvd.broadcast_object(1, 0)),
                attempt("init", hvd.init),
                attempt("shutdown", hvd.shutdown)])
        sys.exit(3)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    total = hvd.allreduce(np.array([rank + 1.0]), op=hvd.Sum, name="after")[0]
    print(f"rank {rank}: child exit status {status}, sum after {total:.0f}", flush=True)
elif mode == "torch":
    import torch

    import frontends.torch as hvd

    hvd.init()
    rank = hvd.rank()

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            line = f"worker of {rank} (pid {os.getpid()}): rank {hvd.rank()}"
            if i == 0:
                line += "; " + attempt("allreduce", lambda: hvd.allreduce(torch.ones(1),
                                                                           name="w"))
            return line

    for batch in torch.utils.data.DataLoader(Items(), batch_size=1, num_workers=2):
        print(batch[0], flush=True)
    total = hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum, name="after").item()
    print(f"rank {rank}: sum after {total:.0f}", flush=True)
elif mode == "chainer":
    import frontends.chainer as chainermn

    comm = chainermn.create_communicator("naive")
    rank, peer = comm.rank, 1 - comm.rank
    pid = os.fork()
    if pid == 0:
        report([f"child of {rank}: rank {comm.rank}",
                attempt("allreduce_obj", lambda: comm.allreduce_obj(1)),
                attempt("send_obj", lambda: comm.send_obj(1, dest=peer)),
                attempt("recv_obj", lambda: comm.recv_obj(peer)),
                attempt("allreduce", lambda: comm.allreduce(np.ones(3, np.float32))),
                attempt("send", lambda: comm.send(np.ones(3, np.float32), peer, 0))])
        sys.exit(0)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    # The parent's own objects still pair as they should.
    if rank == 0:
        comm.send_obj("from 0", dest=1)
        got = comm.recv_obj(1)
    else:
        got = comm.recv_obj(0)
        comm.send_obj("from 1", dest=0)
    print(f"rank {rank}: child exit status {status}, got {got!r}, "
          f"sum after {comm.allreduce_obj(rank + 1)}", flush=True)
