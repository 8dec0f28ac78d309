"""Launching a job beside a driver: coordrun's elastic mode and
coordinator.run.

1. The driver waits for enough slots (--min-np, up to --elastic-timeout)
   and places the first ranks.
2. It serves its gRPC service on loopback (every host is this machine) or
   on the address that reaches the hosts, with a fresh secret.
3. mpirun starts the ranks, under ULFM for an elastic job, with the driver's
   address and the secret exported to them (by name: the secret never
   appears on a command line).
4. The job's status: 0 when every rank of the last membership reported a
   clean exit; otherwise what the driver stopped it for, or mpirun's.
"""

import logging
import os
import sys
import threading

from coordinator.config import ELASTIC_ENV
from coordinator.elastic import auth, hosts as hostlib, service, worker
from coordinator.elastic.driver import DEFAULT_ELASTIC_TIMEOUT, ElasticDriver, JobStopped

START_TIMEOUT = 30.0
SILENCE_MARGIN = 3 * worker.HEARTBEAT_PERIOD
log = logging.getLogger("coordinator.elastic")


def elastic_timeout(args):
    if getattr(args, "elastic_timeout", None) is not None:
        return float(args.elastic_timeout)
    return float(os.environ.get("HOROVOD_ELASTIC_TIMEOUT", DEFAULT_ELASTIC_TIMEOUT))


def start_timeout(args):
    if getattr(args, "start_timeout", None) is not None:
        return float(args.start_timeout)
    return float(os.environ.get("HOROVOD_START_TIMEOUT", START_TIMEOUT))


def make_driver(args, command, elastic=True):
    if args.host_discovery_script is not None:
        discovery = hostlib.DiscoveryScript(args.host_discovery_script, args.slots)
    else:
        slots = args.host_slots or [("localhost", args.np)]
        discovery = hostlib.FixedHosts(dict(slots))
    manager = hostlib.HostManager(discovery, args.cooldown_range if elastic else None)
    return ElasticDriver(manager, min_np=args.min_np or args.np,
                         max_np=args.max_np if elastic else args.np,
                         elastic_timeout=elastic_timeout(args),
                         reset_limit=args.reset_limit if elastic else 0,
                         command=command, workdir=os.getcwd())


def launch(args, launcher, environ, driver, command, elastic=True):
    """Runs the job; returns (exit status, message or None)."""
    from coordinator import run as runmod

    try:
        world = driver.start_world(args.np)
    except (JobStopped, RuntimeError) as exc:
        return 1, f"the job cannot start: {exc}"
    counts = []
    for host, _ in world:
        if counts and counts[-1][0] == host:
            counts[-1] = (host, counts[-1][1] + 1)
        else:
            counts.append((host, 1))
    names = sorted({h for h, _ in world} | {h for h, _ in driver.hosts.available()})
    local = all(service.is_local(h) for h in names)
    secret = auth.new_secret()
    bind = service.address_for(names, (args.nics or [None])[0] if not local else None)
    server, address = service.serve(driver, secret, bind)
    exports = {auth.ADDRESS_ENV: address, auth.SECRET_ENV: secret}
    if elastic:
        exports[ELASTIC_ENV] = "1"
    used = {h for h, _ in counts}
    spare = [(h, n) for h, n in driver.hosts.available() if h not in used] if elastic else []
    if not local:
        driver.daemon_hosts = used | {h for h, _ in spare}
    job = runmod.DriverJob(hosts=counts, exports=exports, command=command,
                           elastic=elastic, local=local, spare_hosts=spare)
    try:
        argv, env = runmod.build_command(args, launcher, environ, job=job)
    except ValueError as exc:
        server.stop(0)
        return runmod.USAGE_ERROR, str(exc)
    names = env.get(runmod.EXPORTED_NAMES, "").split(",")
    driver.environment = {n: env[n] for n in names if n in env}
    if elastic:
        # ULFM's detector does not watch workers spawned later: the driver
        # ends a silent one a few heartbeats after the detector would have
        # declared it failed, so that for those mpirun started the detector
        # comes first, as before.
        driver.silence_limit = float(env.get("OMPI_MCA_mpi_ft_detector_timeout",
                                             runmod.DETECTOR_TIMEOUT)) + SILENCE_MARGIN
    if args.verbose:
        runmod.print_command(argv, env, hide=(auth.SECRET_ENV,))
    if elastic:
        driver.start_discovery()
    watcher = _StartWatch(driver, start_timeout(args), address)
    ender = _EndWatch(driver)

    def started(proc):
        watcher.start(proc)
        if elastic:
            ender.start(proc)

    try:
        status = runmod.run_launcher(argv, env, on_start=started, flavor=launcher.flavor)
    finally:
        watcher.done.set()
        ender.done.set()
        driver.stop()
        server.stop(1)
    return _status(driver, status, watcher)


def _status(driver, status, watcher):
    if driver.stop_reason:
        return status or 1, f"the elastic driver stopped the job: {driver.stop_reason}"
    outcomes = driver.final_outcomes()
    world = driver.worlds.get(driver.generation, [])
    if world and len(outcomes) == len(world) and all(o.exit_code == 0
                                                     for o in outcomes.values()):
        return 0, None
    if status == 0 and not driver.registered:
        # No worker ever joined (the program never called init): every
        # process exited 0, which Horovod's elastic driver counts a success.
        return 0, None
    from coordinator import run as runmod

    stopped = runmod.forwarded_signals()
    if stopped:
        return status or 1, f"the job was stopped: coordrun got {', '.join(stopped)}"
    return status or 1, _silent(driver.generation, world, outcomes)


def _silent(generation, world, outcomes):
    """What the job ended with when workers of its last membership ended
    without reporting to the driver (SIGKILLed, or their machine lost), or
    None. When none of them is left, no one could carry the job's state on
    into a new membership (survivors ask for one): that is why it ended."""
    silent = [r for r in range(len(world)) if r not in outcomes]
    if not silent:
        return None  # (a rank that raised says so itself; its status is the job's)
    who = ", ".join(f"rank {r} ({world[r][0]}[{world[r][1]}])" for r in silent)
    text = (f"the job ended: in membership {generation} of {len(world)} workers, {who} ended "
            "without reporting to the driver (killed, or its machine lost)")
    if len(silent) == len(world):
        text += ("; no worker of it was left to carry the job's state on into a new "
                 "membership, so the job could not re-form")
    return text


END_GRACE = 10.0


class _Watch:
    """A thread that watches mpirun's process beside the driver, from its
    start until `done` is set."""

    thread_name = "coordinator-watch"

    def __init__(self, driver):
        self.driver = driver
        self.done = threading.Event()

    def start(self, proc):
        threading.Thread(target=self._watch, args=(proc,), daemon=True,
                         name=self.thread_name).start()

    def _watch(self, proc):
        raise NotImplementedError


class _EndWatch(_Watch):
    """Ends mpirun when every worker of the last membership has reported its
    end and mpirun still runs END_GRACE seconds later: it waits for a worker
    an earlier membership lost that never exited (stopped, or hung, and
    declared failed by ULFM's detector), which would keep the job for ever.
    Likewise END_GRACE seconds after the driver stopped the job: workers
    that wait for a silent one never learn of it."""

    thread_name = "coordinator-end-watch"

    def __init__(self, driver, grace=END_GRACE):
        super().__init__(driver)
        self.grace = grace

    def _finished(self):
        driver = self.driver
        with driver.cond:
            world = driver.worlds.get(driver.generation, ())
            return bool(world) and len(driver.final_outcomes()) == len(world)

    def _watch(self, proc):
        while not (self._finished() or self.driver.stop_reason):
            if self.done.wait(1.0) or proc.poll() is not None:
                return
        if self.done.wait(self.grace) or proc.poll() is not None:
            return
        if self._finished():
            log.warning("driver: every worker of membership %d reported its end %g s ago, yet "
                        "mpirun still waits for processes of earlier memberships (workers lost "
                        "without exiting: stopped or hung); ending them",
                        self.driver.generation, self.grace)
        else:
            log.warning("driver: the job was stopped %g s ago and mpirun still runs; ending "
                        "it", self.grace)
        proc.terminate()


class _StartWatch(_Watch):
    """Warns when the first ranks have not checked in with the driver within
    the start timeout (horovodrun's --start-timeout). Only a warning: a
    rank checks in when its script calls init(), which a slow import (or a
    busy machine) can delay; the job itself runs without the driver until it
    must re-form."""

    thread_name = "coordinator-start-timeout"

    def __init__(self, driver, timeout, address):
        super().__init__(driver)
        self.timeout = timeout
        self.address = address

    def _watch(self, proc):
        if self.driver.wait_registered(0, self.timeout) or self.done.is_set():
            return
        if self.driver.generation != 0 or proc.poll() is not None:
            return
        done = sum(1 for g, _ in self.driver.registered if g == 0)
        log.warning("%d of the %d workers have not checked in with the driver %g s after the "
                    "start (--start-timeout): a worker checks in when its script calls init(); "
                    "one that cannot reach the driver at %s cannot take part in re-forming the "
                    "job", len(self.driver.worlds.get(0, ())) - done,
                    len(self.driver.worlds.get(0, ())), self.timeout, self.address)


def run_elastic(args, launcher, environ):
    """coordrun's elastic mode; returns the exit status."""
    _log_to_stderr(args.verbose)
    driver = make_driver(args, args.command, elastic=True)
    status, message = launch(args, launcher, environ, driver, args.command, elastic=True)
    if message:
        print(f"coordrun: {message}", file=sys.stderr)
    return status


def _log_to_stderr(verbose):
    """The driver's log lines go to coordrun's stderr, marked as its own."""
    logger = logging.getLogger("coordinator.elastic")
    if not any(getattr(h, "_coordrun", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("coordrun: %(message)s"))
        handler._coordrun = True
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
