"""The last rank stops after the job's last collective, before its
shutdown (run by tests/test_lifecycle_mpi.py). The others' shutdown waits
for it until its deadline (30 s; cut to 3 s here, as by stopped_rank.py: the
tests are about what comes next), then MPI_Finalize waits for it too, and
cannot be interrupted.

argv[1]:
  stopped  it stops itself (SIGSTOP) for good;
  paused   it stops itself, and a child continues it 3 s after the others
           wait in MPI_Finalize under their watchers (which give a rank
           stopped there COORDINATOR_SILENT_RANK_SECONDS).
argv[2], optional: "mpi4py-first": the program imports mpi4py's MPI before
the coordinator, so mpi4py finalizes MPI at exit (after a shutdown that not
every rank confirmed, under the watcher the coordinator starts at exit).
Each rank prints when its program is done. With STOPPED_MARK set (a file's
path), a child of the last rank makes that file once its parent is stopped,
and the others wait for the file: they may run on other hosts, which do not
see its pid."""

import os
import signal
import subprocess
import sys
import time

import numpy as np

if sys.argv[2:] == ["mpi4py-first"]:
    from mpi4py import MPI

    assert MPI.Is_initialized()  # (importing it started MPI)

import coordinator as hvd
from coordinator.mpi_watch import stopped

mode = sys.argv[1]
hvd.init()
# (imported after init(): the coordinator's background module imports
# mpi4py's MPI, which would start MPI as the program's)
from coordinator import background  # noqa: E402

background.SHUTDOWN_TIMEOUT = 3.0
rank, size = hvd.rank(), hvd.size()
print(f"rank {rank}: sum {hvd.allreduce(np.ones(1), op=hvd.Sum)[0]:.0f}", flush=True)
last = hvd.allgather_object(os.getpid())[-1]


# The child that continues the paused rank.
RESUMER = """
import os, signal, sys, time
def watchers():
    found = 0
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\\0")
        except OSError:
            continue
        found += any(a.endswith(b"mpi_watch.py") for a in argv) and b"finalize" in argv
    return found
deadline = time.monotonic() + 120
while watchers() < int(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.05)
# Stopped for some looks of theirs (every 0.5 s), far within their limit.
time.sleep(3)
os.kill(int(sys.argv[1]), signal.SIGCONT)
"""

# The child that tells the others, through a file, that its parent stopped
# (the standard library only: it starts in milliseconds, well within the
# others' COORDINATOR_SILENT_RANK_SECONDS while they wait for it).
MARKER = """
import os, sys, time
def stopped(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in "Tt"
while not stopped(os.getppid()):
    time.sleep(0.01)
open(sys.argv[1], "w").close()
"""
mark = os.environ.get("STOPPED_MARK")

if rank == size - 1 and mode == "stopped":
    if mark:
        subprocess.Popen([sys.executable, "-I", "-S", "-c", MARKER, mark])
    os.kill(os.getpid(), signal.SIGSTOP)
elif rank == size - 1 and mode == "paused":
    resumer = subprocess.Popen([sys.executable, "-c", RESUMER, str(os.getpid()),
                                str(size - 1)])
    os.kill(os.getpid(), signal.SIGSTOP)
    resumer.wait()
else:
    # Shut down only once it has stopped: its coordinator would otherwise
    # confirm the shutdown first (the job then waits for it, as for a slow
    # rank, with no watcher).
    deadline = time.monotonic() + 60
    while not (os.path.exists(mark) if mark else stopped(last)) and \
            time.monotonic() < deadline:
        time.sleep(0.01)
print(f"rank {rank}: done", flush=True)
