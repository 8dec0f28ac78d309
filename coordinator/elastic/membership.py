"""Who is in the job now, as an MPI communicator, and how it is re-formed.

The engines do the work (README, "Elastic training"):

- Losing ranks: the job runs under `mpirun --with-ft ulfm`, so a dead rank
  does not end it. The survivors call `MPI_Comm_shrink` (ULFM) on the job's
  communicator: a fault-tolerant agreement on who is alive, which gives the
  new communicator (measured here: about 1 ms at 3 ranks).
- Adding ranks: the members call `MPI_Comm_spawn` together, with the hosts
  the driver chose, and merge the intercommunicator with the new processes
  (`MPI_Intercomm_merge`); the new processes find their parents through
  `MPI_Comm_get_parent` when they call `init()`.

The coordinator itself is shut down before and initialised again after, on
the new communicator (`init(comm=...)`): a job is re-formed by stop,
agree, start, as Horovod's elastic mode does over Gloo.

Each membership is a generation the driver numbers; rank 0 asks the driver
(Reform) what to do, and every rank gets the answer over MPI.
"""

import atexit
import logging
import os
import signal
import sys
import threading
import time

from coordinator.config import ELASTIC_ENV, elastic_job
from coordinator.elastic import worker
from coordinator.errors import HorovodInternalError, finished_peer
from coordinator.launcher_watch import EXIT_WITH_LAUNCHER

log = logging.getLogger("coordinator.elastic")

# Attempts at re-forming when another rank fails while the job re-forms.
REFORM_ATTEMPTS = 5


class JobStoppedError(RuntimeError):
    """The driver stopped the job (reset limit, too few workers, ...); not a
    HorovodInternalError, so elastic.run does not try again."""


class Membership:
    def __init__(self):
        self.comm = None  # the job's communicator (errors returned, not fatal)
        self.generation = 0
        # This worker's rank and the size of membership `generation` (the
        # communicator may be a shrunk one while the job re-forms).
        self.rank_in_generation = 0
        self.generation_size = 0
        self.hosts_version = 0  # the change of hosts the membership accounts for
        self.resets = 0
        self.failures = 0  # re-formings after a lost worker
        self.departures = 0  # workers that left because their host did
        self.added_last = 0  # workers the last re-forming started
        self.last_reform_seconds = None
        self._lock = threading.RLock()
        self.agent = None

    # ------------------------------------------------------------- joining
    def communicator(self):
        """The communicator init() should use: joins the job on first use
        (merging with the parents when this process was spawned)."""
        with self._lock:
            if self.comm is None:
                self._join()
            return self.comm

    def _join(self):
        MPI = _mpi()
        parent = MPI.Comm.Get_parent()
        if parent == MPI.COMM_NULL:
            comm = MPI.COMM_WORLD.Dup()
            comm.Set_errhandler(MPI.ERRORS_RETURN)
            self.generation = 0
        else:
            comm = parent.Merge(high=True)
            comm.Set_errhandler(MPI.ERRORS_RETURN)
            self.generation, self.hosts_version = comm.bcast(None, root=0)
        self.comm = comm
        self.generation_size = comm.size
        self.rank_in_generation = comm.rank
        self.agent = worker.Agent(worker.client_from_env())
        self.agent.follow(self.generation, comm.rank, comm.size)
        self.pid = os.getpid()
        atexit.register(self._report_exit)

    def slot(self, timeout=30.0):
        """(host, index): where the driver placed this worker in the current
        membership (waits for the registration, None after `timeout`)."""
        self.communicator()
        return self.agent.wait_slot(self.generation, timeout)

    # ---------------------------------------------------------- re-forming
    def reform(self):
        """Re-forms the job after a failure or a change of hosts; every
        member calls it (the coordinator shut down). Returns the new
        communicator. Raises JobStoppedError when the driver stops the job."""
        with self._lock:
            last = None
            for _ in range(REFORM_ATTEMPTS):
                try:
                    started = time.perf_counter()
                    self._reform_once()
                    self.last_reform_seconds = time.perf_counter() - started
                    self.resets += 1
                    return self.comm
                except _mpi().Exception as exc:  # a rank failed meanwhile: agree again
                    last = exc
                    log.warning("rank %d: re-forming the job failed (%s); trying again",
                                self.comm.rank if self.comm else -1, exc)
                    self._revoke()
            raise HorovodInternalError(f"could not re-form the job after {REFORM_ATTEMPTS} "
                                       f"attempts: {last}")

    def _revoke(self):
        """Interrupts whoever still waits on the job's communicator (ULFM),
        so that every member comes back to agree again."""
        try:
            self.comm.Revoke()
        except _mpi().Exception:
            pass

    def _reform_once(self):
        MPI = _mpi()
        before = self.generation_size
        comm = self.comm.Shrink()  # fault tolerant: only the living take part
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        # From here on a failure revokes this communicator, which every
        # member now waits on.
        self.comm = comm
        survivors = comm.allgather(self.rank_in_generation)
        failure = len(survivors) < before
        self.failures += failure
        plan = self._ask_driver(comm, survivors, failure)
        if plan.action == plan.STOP:
            self.agent.stop()
            raise JobStoppedError(f"the elastic driver stopped the job: {plan.reason}")
        if plan.leave:
            self.departures += len(plan.leave)
            leaving = comm.rank in plan.leave
            rest = comm.Split(MPI.UNDEFINED if leaving else 0, comm.rank)
            if leaving:
                self._leave(plan)
            comm = rest
            comm.Set_errhandler(MPI.ERRORS_RETURN)
            self.comm = comm
        if plan.spawn:
            comm = self._spawn(comm, plan)
            self.comm = comm
        self.added_last = len(plan.spawn)
        self.generation = plan.generation
        self.generation_size = comm.size
        self.rank_in_generation = comm.rank
        self.hosts_version = plan.hosts_version
        self.agent.follow(self.generation, comm.rank, comm.size)
        if comm.rank == 0:
            log.warning("the job re-formed: membership %d of %d workers (%d lost, %d left, "
                        "%d new)", self.generation, comm.size, before - len(survivors),
                        len(plan.leave), len(plan.spawn))

    def _ask_driver(self, comm, survivors, failure):
        from coordinator._wire import driver_pb2 as dpb

        payload = None
        if comm.rank == 0:
            try:
                plan = self.agent.client.reform(self.generation, survivors, failure)
            except Exception as exc:  # the driver is gone: nothing can go on
                plan = dpb.ReformReply(action=dpb.ReformReply.STOP,
                                       reason=f"the driver cannot be reached: {exc}")
            payload = plan.SerializeToString()
        return dpb.ReformReply.FromString(comm.bcast(payload, root=0))

    def _spawn(self, comm, plan):
        MPI = _mpi()
        hosts = [slot.host for slot in plan.spawn]
        counts = {}
        for host in hosts:
            counts[host] = counts.get(host, 0) + 1
        info = MPI.Info.Create()
        info.Set("host", ",".join(hosts))
        # Hosts the job has not used yet join PRRTE's virtual machine (it
        # starts its daemon there); for known hosts this adds nothing.
        info.Set("PMIX_ADD_HOST", ",".join(f"{h}:{n}" for h, n in counts.items()))
        # A daemon on another host does not have what coordrun exported to
        # the first ranks. The spawn passes what reaches the driver (an info
        # value holds at most MPI_MAX_INFO_VAL = 256 bytes: not PATH and the
        # rest); `spawned` fetches the rest from the driver, then runs the
        # command. Nothing secret goes on a command line.
        from coordinator.elastic import auth

        info.Set("PMIX_ENVAR", "\n".join(
            f"{n}={os.environ[n]}" for n in (ELASTIC_ENV, EXIT_WITH_LAUNCHER,
                                             auth.ADDRESS_ENV, auth.SECRET_ENV)
            if n in os.environ))
        if plan.workdir:
            info.Set("wdir", plan.workdir)
        command = [sys.executable, "-m", "coordinator.elastic.spawned", "--"] + list(
            plan.command)
        try:
            inter = comm.Spawn(command[0], command[1:], maxprocs=len(hosts), info=info, root=0)
        finally:
            info.Free()
        merged = inter.Merge(high=False)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        merged.bcast((plan.generation, plan.hosts_version), root=0)
        return merged

    def _leave(self, plan):
        """This rank's host left the job: report and end the process (its
        slot is gone; Horovod ends such workers too)."""
        log.warning("rank %d: its host is no longer part of the job; exiting", self.comm.rank)
        self.agent.finish(0)
        self.agent.stop()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def _report_exit(self):
        """At exit: tells the driver how this worker ended. After a lost
        worker, or one that left with its host, the process then ends without
        MPI_Finalize: Open MPI's last fence includes every process the job
        ever had, and with a dead rank on another host it was measured to
        wait for good, as it did here (in 1 run of several) for a worker that
        had left without finalizing; nothing is left to exchange, and under
        ULFM mpirun takes a rank that leaves without finalizing as one that
        finished.

        After an uncaught exception the others may go on without this worker:
        they re-form in MPI_Comm_shrink, which waits for every living
        process, while MPI_Finalize here waited for them, and the job hung
        for good (one rank's ValueError, 2026-11-29). Ending without it is
        not enough: Open MPI saw such an exit only through ULFM's heartbeat
        detector, 30 s later, where a process killed by a signal is known
        failed at once. So this worker, its failure reported to the driver,
        ends by SIGKILL.

        A fork of the worker (os.fork) that exits reports nothing: it is not
        the worker."""
        from coordinator import runtime

        if self.agent is None or runtime.fork_of(self.pid):
            return

        exc = runtime.uncaught()
        uncaught = exc is not None
        self.agent.finish(1 if uncaught else 0)
        self.agent.stop()
        # Unless what it raised says that another rank finished: that one
        # waits in MPI_Finalize for this one, and nobody re-forms.
        leaving = uncaught and not finished_peer(exc)
        if self.failures or self.departures or leaving:
            # What runs after this at exit (handlers registered before init())
            # never will: flush what the logging module holds at least.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            if leaving:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(1 if uncaught else 0)


def _mpi():
    if "mpi4py.MPI" not in sys.modules:
        from coordinator import runtime

        runtime._mpi_defaults(os.environ)  # the settings init() would apply
    from mpi4py import MPI

    return MPI


_membership = None
_membership_lock = threading.Lock()


def current():
    """The process's membership in an elastic job, or None outside one."""
    global _membership
    if not elastic_job():
        return None
    with _membership_lock:
        if _membership is None:
            _membership = Membership()
            from coordinator import runtime

            runtime._chain_excepthook()
        return _membership


def default_comm():
    """The communicator `init()` uses when given none: the elastic job's
    current one, or None (COMM_WORLD) outside an elastic job."""
    m = current()
    return None if m is None else m.communicator()
