"""What the ranks of a test job do to each other outside the coordinator: a
rank stops itself (SIGSTOP) and is continued once the others have seen
what they should, and ranks leave marks in a shared directory for each
other to wait for, rather than sleeping for a time (which a loaded machine
could pass first, or not reach)."""

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time

# One process: a shell's `sleep` would outlive its killed shell, and hold
# the job's output open until it ends.
_RESUMER = ("import os, signal, sys, time\n"
            "time.sleep(float(sys.argv[1]))\n"
            "os.kill(int(sys.argv[2]), signal.SIGCONT)\n")


def stop_self(resume, settle=0.0):
    """Stops this process now, until another continues it, or a child
    `resume` seconds later at the latest. Once continued it sleeps `settle`
    seconds (the stop lands on each thread as it next enters the kernel,
    possibly a moment after kill() returns), then ends the child: the job
    would wait for it."""
    resumer = subprocess.Popen([sys.executable, "-c", _RESUMER, str(resume), str(os.getpid())])
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(settle)
    resumer.kill()
    resumer.wait()


class _ContinueOnWarning(logging.Handler):
    def __init__(self, rank, pid):
        super().__init__()
        self.text, self.pid = f"rank {rank} has not answered", pid

    def emit(self, record):
        if self.text in record.getMessage():
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def continue_on_warning(rank, pid):
    """Continues process `pid` once this rank's coordinator has warned that
    `rank` has not answered (rank 0's watchdog warns)."""
    logging.getLogger("coordinator").addHandler(_ContinueOnWarning(rank, pid))


def leave_mark(directory, what, text=""):
    """Leaves the mark `what` in `directory`, whole (made, then renamed),
    holding `text`."""
    with open(os.path.join(directory, what + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(directory, what + ".tmp"), os.path.join(directory, what))


def marked(directory, marks, seconds):
    """Waits until every mark in `marks` is in `directory`, `seconds` at
    most; whether they all came."""
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(os.path.join(directory, m)) for m in marks):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


class BeforeNthOperation:
    """Wraps a rank's backend (`Background.ops`): `action()` runs just
    before its `n`-th operation starts, after every rank has been told to
    run it, so that the others are in that collective already."""

    def __init__(self, ops, n, action):
        self.ops, self.n, self.action = ops, n, action
        self.count = 0

    def run(self, *args, **kwargs):
        self.count += 1
        if self.count == self.n:
            self.action()
        return self.ops.run(*args, **kwargs)


def survivor_says(directory, rank, size, victim, exc, seconds=60):
    """Prints what survivor `rank` saw, `RANK r: <ExceptionType>: <message>`,
    leaves it in the file said.<rank> of `directory` (where given: the
    launcher may drop what a process printed last as the job ends), and
    waits until every rank but `victim` has, `seconds` at most, so that no
    survivor's exit ends the job before the others have had their say."""
    said = f"RANK {rank}: {type(exc).__name__}: {exc}"
    print(said, flush=True)
    if directory:
        leave_mark(directory, f"said.{rank}", said)
        marked(directory, [f"said.{r}" for r in range(size) if r != victim], seconds)


def while_in_flight(hvd, submit, check, names=("held.a", "held.b")):
    """Runs `check(name)` on every rank while the tensor `name`, which this
    rank submitted with `submit(name)`, is certain to be in flight; returns
    what `check` returned. The ranks but the last hold `names[0]`, the last
    holds `names[1]`, and each submits the other name only after a barrier
    that follows every rank's check. (Were one name submitted everywhere
    first, a slow rank could come to its check after the tensor had
    completed.) The barrier and the second submission happen even when the
    check fails, so the other ranks are not left waiting."""
    last = hvd.rank() == hvd.size() - 1
    mine, theirs = (names[1], names[0]) if last else names
    held = submit(mine)
    try:
        return check(mine)
    finally:
        hvd.barrier()
        other = submit(theirs)
        hvd.synchronize(held)
        hvd.synchronize(other)


def join_with_a_mark(hvd, directory, step):
    """Joins, leaving the mark "STEP.RANK" in `directory` once the join is
    queued (for a rank that must join after this one: joins_marked);
    returns what join() returned."""
    from coordinator.collectives import join_async

    joining = join_async()
    leave_mark(directory, f"{step}.{hvd.rank()}")
    return hvd.synchronize(joining)


def joins_marked(step, ranks):
    """The marks join_with_a_mark leaves at `step` on `ranks`."""
    return [f"{step}.{r}" for r in ranks]


@contextlib.contextmanager
def rank0_drops_cache_ids(hvd, sender, with_join=False):
    """Within it, rank 0 drops from its response cache every id a request
    list of rank `sender` (with `with_join`, only one that carries a join)
    names, just before reading the list: as if other tensors had evicted
    them before the sender heard. Nothing on the other ranks."""
    from coordinator import runtime
    from coordinator.wire import pb

    ctl = runtime.current().background.controller if hvd.rank() == 0 else None
    if ctl is None:
        yield
        return
    submit = ctl.submit

    def dropping(rank, request_list):
        if rank == sender and (not with_join or any(r.op == pb.JOIN
                                                    for r in request_list.requests)):
            for cached in request_list.cached:
                if ctl.cache.get(cached.cache_id) is not None:
                    ctl.cache._drop(cached.cache_id)
        return submit(rank, request_list)

    ctl.submit = dropping
    try:
        yield
    finally:
        ctl.submit = submit
