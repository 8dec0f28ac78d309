"""Starting and stopping the coordinator, and what it knows about the job."""

import importlib.util
import os

from coordinator import collectives, runtime
from coordinator.config import elastic_job
from coordinator.errors import NotInitializedError
from coordinator.ops_names import (ADD_PROCESS_SET_NAME, REMOVE_PROCESS_SET_NAME,
                                   add_by_members_name)
from coordinator.process_sets import ProcessSet, global_process_set
from coordinator.tensor_queue import Entry
from coordinator.wire import pb


def init(comm=None, process_sets=None):
    """Starts the coordinator: one background thread for this process.

    comm: an mpi4py communicator or a list of global ranks (default: all).
    process_sets: ProcessSets to register now (every rank passes a list of
    the same length, naming the same sets), or "dynamic" to allow
    add_process_set/remove_process_set later. As in Horovod, a ValueError
    is raised once the coordinator runs on a rank whose list names a set
    twice (or the global set), with the list's distinct sets registered,
    and on every rank, with none registered, when the lists do not fit.
    A second init() without shutdown() in between is an error.
    In an elastic job, comm=None means the job's current membership."""
    if comm is None:
        comm = _elastic_comm()
    rt = runtime.start(comm, process_sets)
    rt.dynamic_process_sets = (process_sets == "dynamic"
                               or rt.config.dynamic_process_sets)
    collectives.reset_names()
    error, rt.init_error = rt.init_error, None
    if error is not None:  # (the coordinator runs)
        raise error


def _elastic_comm():
    """The elastic job's current communicator (coordinator/elastic), or None
    (COMM_WORLD) outside an elastic job."""
    if not elastic_job():
        return None
    from coordinator.elastic import membership

    return membership.default_comm()


def ensure_initialized(comm=None, process_sets=None):
    """init() for frontends: starts the coordinator, or joins the one already
    running in this process, so PyTorch and TensorFlow used together share
    one background thread. Sets in `process_sets` not yet registered are
    added (collectively, as add_process_set does), and each ProcessSet of
    the list is bound to its set's id: a ValueError on a rank whose list
    names a set twice, as at the first init."""
    with runtime._lock:
        rt = runtime.current()
        if rt is None or not rt.background.thread.is_alive():
            init(comm, process_sets)
            return runtime.current()
    if process_sets == "dynamic":
        rt.dynamic_process_sets = True
    elif process_sets:
        _add_sets_of_init(rt, runtime._static_sets(process_sets))
    return rt


def _add_sets_of_init(rt, sets):
    """A later init()'s sets (collectively, in one order on every rank), as
    at the first init: a set given by a communicator may name a different
    group on each rank (`ProcessSet(comm.Split(...))`), so every rank's
    groups are gathered; each group not registered yet is added; then each
    ProcessSet of the list is bound to its set's id, as Horovod binds the
    sets its init() is given again. A list that does not fit adds none."""
    from coordinator import runtime as _runtime
    from coordinator.objects import allgather_object
    from coordinator.process_sets import ProcessSetTable

    if not sets:
        return
    mine = [tuple(rt.ranks_of(ps)) for ps in sets]
    everyone = allgather_object(mine, name="process_set.init")
    groups_at = _runtime._groups_by_position(everyone, sets, rt.size)
    registered = {tuple(ps.ranks) for ps in rt.process_sets.all().values()}
    for ranks in _runtime.new_groups(groups_at, sets, registered):
        _add_process_set(rt, ProcessSetTable.stand_in(ranks))
    error = _runtime.bind_init_list(rt.process_sets, sets, mine, rt.rank)
    if error is not None:
        raise error


def shutdown():
    """Stops the background thread. Operations still in flight on any rank
    fail with ShutdownError; later operations raise until init() again."""
    runtime.stop()


def is_initialized():
    """True while the coordinator runs: False before init(), after
    shutdown(), and once any rank has shut it down or it cannot go on (a
    dead or stalled peer)."""
    rt = runtime.current()
    return rt is not None and rt.alive


def _rt(what):
    rt = runtime.current()
    if rt is None:
        state = "has been shut down" if runtime.was_shut_down() else "has not been initialized"
        raise NotInitializedError(f"{what}(): the coordinator {state}; call init() first")
    return rt


def size():
    return _rt("size").size


def rank():
    return _rt("rank").rank


def local_size():
    return _rt("local_size").topology.local_size


def local_rank():
    return _rt("local_rank").topology.local_rank


def cross_size():
    return _rt("cross_size").topology.cross_size


def cross_rank():
    return _rt("cross_rank").topology.cross_rank


def is_homogeneous():
    return _rt("is_homogeneous").topology.homogeneous


def mpi_threads_supported():
    return _rt("mpi_threads_supported").transport.threads_supported()


def add_process_set(process_set):
    """Registers a process set on every rank (all ranks call this, in the same
    order, with the same ranks) and returns it."""
    rt = _rt("add_process_set")
    if not getattr(rt, "dynamic_process_sets", False):
        raise ValueError("add_process_set: dynamic process sets are off; set "
                         "HOROVOD_DYNAMIC_PROCESS_SETS=1 or call init(process_sets='dynamic')")
    return _add_process_set(rt, process_set)


def _add_process_set(rt, process_set):
    # One name for every add (each is blocking, and every rank adds in the
    # same order): ranks that ask for different sets meet, and rank 0 says
    # which asked for what; input one rank refuses goes to the others as its
    # refusal. Named by its ranks, as it was, one rank's bad or different
    # list left the others waiting until DeadlockError.
    name = ADD_PROCESS_SET_NAME
    try:
        ps = _unregistered(process_set)
        ranks = rt.ranks_of(ps)
        if rt.process_sets.id_of(ranks) is not None:
            raise ValueError(f"add_process_set: a process set with ranks {ranks} already "
                             "exists")
        _check_ranks(rt, ranks)
    except (ValueError, TypeError) as exc:
        collectives._tell_refusal(rt, name, pb.ADD_PROCESS_SET, 0, None, exc)
        raise
    rt.expect_process_set(name, ps)
    entry = Entry(name, pb.ADD_PROCESS_SET, ranks=tuple(ranks))
    return collectives.synchronize(collectives._submit(rt, [entry]))


def add_process_set_of_members(process_set):
    """Registers a process set that only its own ranks call this for (a
    ChainerMN communicator over part of the job, made by its members alone,
    or a split of one); the other ranks learn of it from rank 0. A set whose
    ranks are registered already is that set: `process_set` is bound to its
    id. Returns `process_set`. Not Horovod's: its add_process_set needs
    every rank."""
    rt = _rt("add_process_set")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    ranks = sorted(rt.ranks_of(ps) or ())
    name = add_by_members_name(ranks)
    entry = Entry(name, pb.ADD_PROCESS_SET, ranks=tuple(ranks), among_members=True)
    try:
        _unregistered(ps)
        _check_ranks(rt, ranks, with_this_rank=True)
    except ValueError as exc:
        entry.rejected = f"{type(exc).__name__}: {exc}"
        rt.queue.tell(entry)  # (its valid ranks fail too, naming this one)
        raise
    rt.expect_process_set(name, ps)
    collectives.synchronize(collectives._submit(rt, [entry]))
    return ps


def _unregistered(process_set):
    """`process_set` as a ProcessSet that is not registered yet."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"add_process_set: {ps!r} is already registered")
    return ps


def _check_ranks(rt, ranks, with_this_rank=False):
    """ValueError unless `ranks` can make a set of this job (and, where
    asked, hold this rank)."""
    if not ranks or any(not 0 <= r < rt.size for r in ranks) or (
            with_this_rank and rt.rank not in ranks):
        among = f" with this one (rank {rt.rank}) among them" if with_this_rank else ""
        raise ValueError(f"add_process_set: ranks {ranks} are not valid for {rt.size} "
                         f"ranks{among}")


def remove_process_set(process_set):
    """Unregisters a process set on every rank (all ranks call this). Returns
    False for an unregistered set or the global set."""
    rt = _rt("remove_process_set")
    pid = process_set.process_set_id
    dynamic = getattr(rt, "dynamic_process_sets", False)
    if pid is None or pid == 0 or process_set is global_process_set:
        if dynamic:
            # Nothing to remove here; but the others may be removing a set
            # (one name for every remove, as for add): they hear that this
            # rank removes none, and fail, where they waited until
            # DeadlockError.
            why = "the global process set" if pid == 0 else "an unregistered process set"
            collectives._tell_refusal(rt, REMOVE_PROCESS_SET_NAME, pb.REMOVE_PROCESS_SET, 0,
                                      None, ValueError(f"remove_process_set: given {why}"))
        return False
    if not dynamic:
        raise ValueError("remove_process_set: dynamic process sets are off; set "
                         "HOROVOD_DYNAMIC_PROCESS_SETS=1 or call init(process_sets='dynamic')")
    entry = Entry(REMOVE_PROCESS_SET_NAME, pb.REMOVE_PROCESS_SET, process_set_id=pid)
    return bool(collectives.synchronize(collectives._submit(rt, [entry])))


def start_timeline(file_path, mark_cycles=False):
    """Starts writing the timeline (a Chrome trace) to `file_path`. Every rank
    may call it; rank 0, which sees every rank's requests, writes the file."""
    rt = _rt("start_timeline")
    if not file_path:
        raise ValueError("start_timeline: file_path must be a non-empty path")
    if rt.rank == 0:
        rt.timeline.start(os.fspath(file_path), bool(mark_cycles))


def stop_timeline():
    """Stops writing the timeline and closes the file (still valid JSON)."""
    rt = _rt("stop_timeline")
    rt.timeline.stop()


# What this build holds, for every frontend's *_built / *_enabled queries.
# Host data moves over MPI (mpi4py); CUDA arrays go through CuPy, and through
# NCCL where CuPy can load it (coordinator/gpu.py). There is no Gloo, oneCCL,
# DDL or ROCm code, so those report False.
def mpi_built():
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled():
    return is_initialized()


def gloo_built():
    return False


def gloo_enabled():
    return False


def nccl_built():
    """NCCL's version code where CuPy can load NCCL (e.g. 22809 for 2.28.9),
    else 0, as Horovod returns when it was built without NCCL."""
    from coordinator import gpu

    return gpu.nccl_version()


def ccl_built():
    return False


def ddl_built():
    return False


def cuda_built():
    """True where CuPy is installed: CUDA arrays need it (a GPU is not asked for)."""
    from coordinator import gpu

    return gpu.cupy_installed()


def rocm_built():
    return False
