"""A rank ends when the process that started it dies.

coordrun makes sure mpirun dies with it, and mpirun ends its ranks when it is
told to stop (SIGTERM, SIGINT). But a SIGKILLed mpirun (prterun) cannot: its
ranks, reparented to init, were measured sleeping on for good. So coordrun
sets EXIT_WITH_LAUNCHER in every rank's environment and `watch_launcher()`,
called at `init`, watches the rank's parent (prterun on the launching host,
prted on the others) through a pidfd. When the parent exits, the rank gets
SIGTERM, and SIGKILL if it is still alive GRACE seconds later.

PR_SET_PDEATHSIG would need no thread, but it fires when the parent *thread*
that forked the rank exits (prctl(2)), and prterun is multi-threaded.
"""

import logging
import os
import select
import signal
import threading
import time

EXIT_WITH_LAUNCHER = "COORDINATOR_EXIT_WITH_LAUNCHER"
# Seconds a rank's own SIGTERM handler (a last checkpoint, say) gets before
# SIGKILL. prterun, told to stop, gives about 1 s (measured with ranks that
# ignore SIGTERM); with the launcher gone nothing else waits on the rank.
GRACE = 5.0
# Where pidfds are missing (Linux < 5.3), how often the parent is checked.
POLL_PERIOD = 1.0

log = logging.getLogger("coordinator")

_lock = threading.Lock()
_watched = None  # the parent pid, once a watcher thread runs


def watch_launcher(environ=None):
    """Starts, once per process, a daemon thread that ends this process when
    its parent exits. Does nothing unless $COORDINATOR_EXIT_WITH_LAUNCHER is 1.
    Returns the parent pid being watched, or None."""
    global _watched
    environ = os.environ if environ is None else environ
    if environ.get(EXIT_WITH_LAUNCHER) != "1":
        return None
    with _lock:
        if _watched is None:
            parent = os.getppid()
            args = (parent, _pidfd(parent), _describe(parent))
            threading.Thread(target=_end_with, args=args, daemon=True,
                             name="coordinator-launcher-watch").start()
            _watched = parent
        return _watched


def _pidfd(pid):
    """A pidfd for `pid`, or None where pidfds are unavailable."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _end_with(parent, fd, description):
    """Waits until `parent` is no longer our parent, then ends this process."""
    # Checked after the pidfd was opened: if the parent had died before, the
    # pidfd may name another process that reused its pid.
    if fd is not None and os.getppid() == parent:
        select.select([fd], [], [])
    while os.getppid() == parent:
        time.sleep(POLL_PERIOD)
    log.error("the process that started this rank (%s) exited; ending this rank",
              description)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE)
    os.kill(os.getpid(), signal.SIGKILL)


def _describe(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f"{f.read().strip()}, pid {pid}"
    except OSError:
        return f"pid {pid}"
