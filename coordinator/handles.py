"""Handles: what an asynchronous submission returns.

A handle is an int, as in Horovod. It stands for one entry, or for the
entries of a grouped operation. `poll` says whether it is done;
`synchronize` waits, returns the result (a list for a group) and releases it,
raising the operation's error if it failed. For a result on a GPU it also
makes the caller's current stream wait for the work that wrote it.
"""

import itertools
import sys
import threading
import time

# How often a waiting thread checks on the job's health (dead peers, a
# failed background thread) while its operation has not completed.
HEALTH_CHECK_PERIOD = 0.25

# The threads that have submitted are remembered (the deadlock check); ended
# ones are forgotten once this many are.
PRUNE_SUBMITTERS = 64

# What threading.current_thread() is on a thread Python did not start (a
# framework's C++ pool thread that calls in to submit).
_POOL_THREAD = getattr(threading, "_DummyThread", ())

# Source files of frameworks' entries into their own runtimes (frontends
# name them: note_framework_runtime). A thread whose innermost Python frame
# is in one runs the framework's work, which submits through its pool
# threads: Keras's fit() on the main thread, inside TensorFlow's executor,
# while an executor thread waits for a gradient's allreduce.
_RUNTIME_FILES = []


def note_framework_runtime(path_fragment):
    """A frontend names a framework's runtime entry (a part of a source
    path, as "/tensorflow/python/eager/"): a submitting thread inside one
    counts for the deadlock check as a pool thread does (blocked_seconds)."""
    if path_fragment not in _RUNTIME_FILES:
        _RUNTIME_FILES.append(path_fragment)


def _in_framework_runtime(thread, frames):
    frame = frames.get(thread.ident)
    return frame is not None and any(f in frame.f_code.co_filename for f in _RUNTIME_FILES)


class HandleTable:
    def __init__(self, on_block=None):
        """on_block: called by a thread about to block in wait() (the
        runtime's TensorQueue.flush: a thread that waits submits nothing
        more until it is done waiting)."""
        self._on_block = on_block
        self._items = {}
        self._ids = itertools.count()
        self._waiting_lock = threading.Lock()
        # Threads blocked in wait() right now. While one is, its process has
        # nothing to do but wait for the background thread, which therefore
        # keeps polling instead of sleeping (background.py).
        self.waiting = 0
        # For the deadlock check (stall_inspector.py): the threads that have
        # submitted here, and when each thread blocked in wait() now began.
        self._submitters = {}  # threading.Thread -> time.monotonic() of its last submission
        self._prune_at = PRUNE_SUBMITTERS  # forget ended threads when there are this many
        self._blocked = {}  # threading.Thread -> time.monotonic() it blocked

    def add(self, item):
        thread = threading.current_thread()
        if thread not in self._submitters and len(self._submitters) >= self._prune_at:
            # A program that starts a thread per step must not grow this.
            for old in [t for t in list(self._submitters) if not _alive(t)]:
                self._submitters.pop(old, None)
            self._prune_at = max(PRUNE_SUBMITTERS, 2 * len(self._submitters))
        self._submitters[thread] = time.monotonic()
        handle = next(self._ids)
        self._items[handle] = item  # a single dict store is atomic under the GIL
        return handle

    def _get(self, handle):
        item = self._items.get(handle)
        if item is None:
            raise ValueError(f"handle {handle!r} is unknown: it was never returned by an "
                             "_async call, or was already synchronized")
        return item

    def poll(self, handle):
        item = self._get(handle)
        done = all(e.done for e in item) if isinstance(item, list) else item.done
        if not done:
            # A frontend that spins on poll() in Python would hold the GIL the
            # background thread needs between MPI calls: let it run.
            time.sleep(0)
        return done

    def entries(self, handle):
        item = self._get(handle)
        return item if isinstance(item, list) else [item]

    def wait(self, handle, health_check=None):
        item = self._items.get(handle)
        if item is None:
            item = self._get(handle)  # (raises)
        if type(item) is not list:  # one entry, completed: the common case, kept short
            if item.done and item.error is None and item.done_event is None:
                self._items.pop(handle, None)
                return item.result
            group = [item]
        else:
            group = item
        if not all(e.done for e in group):
            if self._on_block is not None:
                self._on_block()
            thread = threading.current_thread()
            with self._waiting_lock:
                self.waiting += 1
                self._blocked[thread] = time.monotonic()
            try:
                for entry in group:
                    if not entry.wait(HEALTH_CHECK_PERIOD):
                        while not entry.wait(HEALTH_CHECK_PERIOD):
                            if health_check is not None:
                                health_check()
            finally:
                with self._waiting_lock:
                    self.waiting -= 1
                    self._blocked.pop(thread, None)
        self._items.pop(handle, None)
        for entry in group:
            if entry.error is not None:
                raise entry.error
        for entry in group:
            if entry.done_event is not None:  # a device result (gpu.DeviceWait)
                entry.done_event.order_current_stream()
        if isinstance(item, list):
            return [e.result for e in item]
        return item.result

    def blocked_seconds(self, now=None):
        """How long this process has been blocked: some thread waits in
        wait(), and every live thread that has submitted work here either
        waits too or has been quiet since its last submission while it runs
        a framework's work: a pool thread (not started by Python: PyTorch's
        autograd threads for CUDA, TensorFlow's executors), or a thread
        inside a framework's runtime (note_framework_runtime); for as long
        as all that has held. 0 while another Python thread that has
        submitted before is not waiting (it may be computing what the
        others wait for), and before anything was submitted. A thread that
        has never submitted is not counted: one that starts to only later
        is the case this cannot see."""
        now = time.monotonic() if now is None else now
        with self._waiting_lock:
            blocked = dict(self._blocked)
        if not blocked:
            return 0.0
        latest = max(blocked.values())
        counted = False
        frames = None
        for thread, submitted in list(self._submitters.items()):
            if not _alive(thread):
                self._submitters.pop(thread, None)
                continue
            since = blocked.get(thread)
            if since is None:
                if not isinstance(thread, _POOL_THREAD):
                    if frames is None:
                        frames = sys._current_frames() if _RUNTIME_FILES else {}
                    if not _in_framework_runtime(thread, frames):
                        return 0.0
                since = submitted
            counted = True
            latest = max(latest, since)
        return max(0.0, now - latest) if counted else 0.0

    def release(self, handle):
        self._items.pop(handle, None)

    def __len__(self):
        return len(self._items)


def _alive(thread):
    try:
        return thread.is_alive()
    except (AssertionError, RuntimeError):  # a dummy thread whose thread ended
        return False
