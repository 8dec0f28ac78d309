"""HOROVOD_THREAD_AFFINITY (set by tests/test_affinity_mpi.py): each rank's
background thread runs on the core listed for its local rank, the list
wrapping around; the training thread is left alone. A core the process may
not use is a warning, and the thread runs where it would have."""

import os


def _cores(thread):
    return os.sched_getaffinity(thread.native_id)


def _listed_core(hvd):
    cores = [int(c) for c in os.environ["HOROVOD_THREAD_AFFINITY"].split(",")]
    return cores[hvd.local_rank() % len(cores)]


def case_the_background_thread_runs_on_its_local_ranks_core(hvd):
    import threading
    import time

    from coordinator import runtime

    core = _listed_core(hvd)
    thread = runtime.current().background.thread
    allowed = os.sched_getaffinity(0)
    if core in allowed:
        # (the thread pins itself as it starts, which init does not wait for)
        deadline = time.monotonic() + 10
        while _cores(thread) != {core} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _cores(thread) == {core}, (core, _cores(thread))
    else:  # warned, and left where it was
        assert _cores(thread) == allowed, (core, _cores(thread), allowed)
    assert _cores(threading.main_thread()) == allowed  # the training thread is left alone
