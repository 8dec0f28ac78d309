"""One rank is stopped (SIGSTOP) in the middle of training and continued
(SIGCONT) once every other rank has printed what it saw, or RESUME seconds
later at the latest (the others never saw anything). Not after a time
alone: a loaded machine may run the others' checks seconds late, and the
victim would then be back before they failed. Run with
HOROVOD_STALL_CHECK_TIME_SECONDS=2 and HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=5.
Every rank prints what its training loop saw:
`RANK r: <ExceptionType> after <seconds> s: <message>`.

Modes:
  collective  the victim stops inside the coordinator, just as it starts a
              collective the others are already running (a test hook wraps
              its backend), so the others sit in that collective;
  between     the victim's training loop stops itself between two steps, so
              the others wait in the negotiation cycle;
  shutdown    the victim stops itself between two steps, and once it is
              stopped the others call shutdown(), whose barrier it can never
              join: each prints `RANK r: shut down after <seconds> s` (and
              whether its background thread has ended), and the victim,
              once continued, what its next allreduce saw. The shutdown
              deadline is cut to SHUTDOWN_DEADLINE seconds here.

With FAKE_GPU=1 the allreduce takes a "CUDA" array of tests/gpu_fakes.py, so
in `collective` mode the others sit in an NCCL call (the fake's) with it.
"""

import os
import signal
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import peers  # noqa: E402

import coordinator as hvd  # noqa: E402
from coordinator import background, runtime  # noqa: E402

MODE = sys.argv[1]
VICTIM = int(sys.argv[2])
RESUME = float(sys.argv[3]) if len(sys.argv) > 3 else 60.0
STOP_AT = 20
# After a fatal error the others stay before exiting (which ends the job)
# until the stopped rank, once continued, has reported what it saw (it
# leaves a file saying so), or LINGER seconds at most.
LINGER = RESUME + 4
SHUTDOWN_DEADLINE = 3.0


def stop_me():
    """Stops this process now, until the others continue it (continue_victim),
    or a child RESUME seconds later at the latest."""
    print(f"RANK {hvd.rank()}: stopping at {time.time():.3f}", flush=True)
    peers.stop_self(RESUME)


def continue_victim():
    """Once every rank but the victim has printed what it saw, continues the
    victim (each of them does: once is enough), or after LINGER seconds."""
    peers.leave_mark(REPORTS, f"other.{me}")
    peers.marked(REPORTS, [f"other.{r}" for r in range(len(pids)) if r != VICTIM], LINGER)
    os.kill(int(pids[VICTIM]), signal.SIGCONT)


def reported():
    """The victim has printed its outcome."""
    with open(os.path.join(REPORTS, "victim"), "w"):
        pass


def linger():
    deadline = time.monotonic() + LINGER
    while time.monotonic() < deadline and not os.path.exists(os.path.join(REPORTS, "victim")):
        time.sleep(0.05)


def stopped(pid):
    """Whether process `pid` is stopped (state T in /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def shut_down_beside_a_stopped_rank(pids):
    while not stopped(pids[VICTIM]):
        time.sleep(0.01)
    bg = runtime.current().background
    start = time.monotonic()
    hvd.shutdown()
    # Whether its thread ended: where shutdown() gave up on joining it (its
    # last resort), it still runs. (The victim, stopped until
    # continue_victim below, cannot have been what let it end.)
    print(f"RANK {me}: shut down after {time.monotonic() - start:.1f} s, its thread "
          f"{'still runs' if bg.thread.is_alive() else 'ended'}", flush=True)
    continue_victim()
    linger()  # the victim, continued, reports before the job ends
    sys.exit(0)


FAKE_GPU = os.environ.get("FAKE_GPU") == "1"
if FAKE_GPU:
    from mpi4py import MPI

    import gpu_fakes

    gpu_fakes.install_for_a_job(MPI.COMM_WORLD)
hvd.init()
me = hvd.rank()
# (The tests give a directory they remove; by hand, one in /tmp.)
REPORTS = os.environ.get("REPORTS_DIR") or hvd.broadcast_object(
    tempfile.mkdtemp(prefix="stopped-rank-") if me == 0 else None, name="reports")
pids = hvd.allgather(np.array([os.getpid()], np.int64), name="pids")
if MODE == "shutdown":
    background.SHUTDOWN_TIMEOUT = SHUTDOWN_DEADLINE
if MODE == "collective" and me == VICTIM:
    bg = runtime.current().background
    bg.ops = peers.BeforeNthOperation(bg.ops, STOP_AT, stop_me)
start = None
for step in range(200):
    if MODE in ("between", "shutdown") and me == VICTIM and step == STOP_AT:
        stop_me()
    if MODE == "shutdown" and me != VICTIM and step == STOP_AT:
        shut_down_beside_a_stopped_rank(pids)
    start = time.monotonic()
    try:
        grad = np.full(1000, step, np.float64)
        out = hvd.allreduce(gpu_fakes.FakeDeviceArray(grad) if FAKE_GPU else grad, op=hvd.Sum,
                            name="grad")
        out = out.get() if FAKE_GPU else out
        assert out[0] == step * hvd.size(), (step, out[0])
    except Exception as exc:  # what the training loop sees
        waited = time.monotonic() - start
        print(f"RANK {me}: {type(exc).__name__} after {waited:.1f} s at step {step}: {exc}",
              flush=True)
        sys.stdout.flush()
        if me == VICTIM:
            reported()
        else:
            continue_victim()
            linger()
        break
    time.sleep(0.002)
else:
    print(f"RANK {me}: finished", flush=True)
sys.stdout.flush()
