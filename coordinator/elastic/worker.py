"""A worker's side of the driver: registration, heartbeats, host changes.

coordrun's elastic mode sets $COORDINATOR_ELASTIC=1 and gives every worker
the driver's address and the job's secret in its environment. One daemon
thread per worker (`Agent`) registers the worker in each membership and
sends a heartbeat every HEARTBEAT_PERIOD (and ends, on this machine, a
silent worker the reply names: see driver.py); on rank 0 a second thread holds
the driver's stream of host changes and hands each to the
`notification_manager`, which passes it to the registered states (their
next `commit()` or `check_host_updates()` raises HostsUpdatedInterrupt on
every rank at once, as in Horovod, where the driver also notifies rank 0).
Nothing here is on the training path: the threads sleep between calls.
"""

import logging
import os
import threading

from coordinator import liveness

log = logging.getLogger("coordinator.elastic")

HEARTBEAT_PERIOD = 2.0


def client_from_env(environ=None):
    from coordinator.elastic import auth  # gRPC is imported only in an elastic job
    from coordinator.elastic.service import DriverClient

    environ = os.environ if environ is None else environ
    address = environ.get(auth.ADDRESS_ENV, "")
    if not address:
        raise RuntimeError(f"${auth.ADDRESS_ENV} is not set: run elastic jobs with coordrun "
                           "--min-np/--host-discovery-script")
    return DriverClient(address, auth.secret_from_env(environ))


class WorkerNotificationManager:
    """Passes the driver's notices of host changes to the states listening
    (Horovod's name and methods)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._listeners = set()

    def init(self):
        from coordinator.elastic import membership

        m = membership.current()
        if m is not None:
            m.communicator()

    def register_listener(self, listener):
        with self._lock:
            self._listeners.add(listener)

    def remove_listener(self, listener):
        with self._lock:
            self._listeners.discard(listener)

    def handle_hosts_updated(self, timestamp, update_res):
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener.on_hosts_updated(timestamp, update_res)


notification_manager = WorkerNotificationManager()


class Agent:
    """The worker's threads that talk to the driver."""

    def __init__(self, client):
        self.client = client
        self._cond = threading.Condition()
        self._current = None  # (generation, rank, size)
        self._stopped = False
        self._watch_call = None
        self._finished = False
        self.slot = None  # (host, index) the driver placed this worker on
        self._registered_for = None  # the membership `slot` belongs to
        self.identity = liveness.host_identity()
        self.start = liveness.process_start(os.getpid()) or 0
        self._ended = set()  # (host identity, pid, start time) of those asked for
        self._thread = threading.Thread(target=self._beat, daemon=True,
                                        name="coordinator-elastic-agent")
        self._thread.start()

    def follow(self, generation, rank, size):
        """This worker is now `rank` of membership `generation`."""
        with self._cond:
            self._current = (generation, rank, size)
            call, self._watch_call = self._watch_call, None
            self._cond.notify_all()
        if call is not None:
            call.cancel()
        if rank == 0:
            threading.Thread(target=self._watch, args=(generation,), daemon=True,
                             name="coordinator-elastic-watch").start()

    def _beat(self):
        registered = None
        while True:
            with self._cond:
                if self._stopped:
                    return
                current = self._current
            try:
                if current is not None and current != registered:
                    slot = self.client.register(current[0], current[1], current[2],
                                                os.getpid(), self.identity, self.start)
                    with self._cond:
                        self.slot = slot
                        self._registered_for = current[0]
                        registered = current
                        self._cond.notify_all()
                elif current is not None:
                    reply = self.client.heartbeat(current[0], current[1],
                                                  timeout=HEARTBEAT_PERIOD)
                    for process in reply.end:
                        self._end(process)
            except Exception as exc:  # the driver may be busy or gone; try again later
                log.debug("elastic agent: %s", exc)
            with self._cond:
                if not self._stopped and self._current == current:
                    self._cond.wait(HEARTBEAT_PERIOD)

    def _end(self, process):
        """Ends a silent worker the driver named, if it runs on this machine
        (in this PID namespace); once."""
        key = (process.host_identity, process.pid, process.start_time)
        if key in self._ended:
            return
        self._ended.add(key)
        if liveness.end_process(*key):
            log.warning("elastic: ended pid %d (rank %d of membership %d), which the driver "
                        "has not heard from for too long (stopped, or hung)", process.pid,
                        process.rank, process.generation)

    def wait_slot(self, generation, timeout=30.0):
        """(host, index) of this worker in membership `generation`, once
        registered (None after `timeout` seconds)."""
        with self._cond:
            self._cond.wait_for(lambda: self._registered_for == generation, timeout)
            return self.slot if self._registered_for == generation else None

    def _watch(self, generation):
        try:
            call = self.client.watch(generation, 0)
            with self._cond:
                if self._current is None or self._current[0] != generation or self._stopped:
                    call.cancel()
                    return
                self._watch_call = call
            for update in call:
                log.info("driver: hosts changed (version %d)", update.timestamp)
                notification_manager.handle_hosts_updated(update.timestamp, update.result)
        except Exception as exc:  # cancelled at the next membership, or the driver left
            log.debug("elastic watch ended: %s", exc)

    def finish(self, exit_code, result=b"", error=""):
        with self._cond:
            if self._finished or self._current is None:
                return
            self._finished = True
            generation, rank, _ = self._current
        try:
            self.client.finish(generation, rank, exit_code, result, error)
        except Exception as exc:
            log.debug("elastic agent: cannot report the exit: %s", exc)

    def stop(self):
        with self._cond:
            self._stopped = True
            call, self._watch_call = self._watch_call, None
            self._cond.notify_all()
        if call is not None:
            call.cancel()
