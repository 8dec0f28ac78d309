"""Settings, read once from the environment into one immutable object.

Names and units follow Horovod's environment variables so existing job scripts
keep working. Nothing else in the package reads `os.environ` for settings: the
`Config` built at `init()` is handed to the objects that need it.
"""

import dataclasses
import math
import os
from typing import Mapping, Optional, Tuple

MIB = 1024 * 1024

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}

# Set by coordrun's elastic mode for every worker (coordinator/elastic).
ELASTIC_ENV = "COORDINATOR_ELASTIC"


def elastic_job(environ=None):
    """Whether this process is a worker of an elastic job. Read where no
    Config is built yet (MPI's settings, the job's communicator), so a
    function of the environment; it costs no import of coordinator.elastic."""
    return (os.environ if environ is None else environ).get(ELASTIC_ENV) == "1"


LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")
# Other names Horovod's users give them (HOROVOD_LOG_LEVEL, --config-file).
LOG_LEVEL_ALIASES = {"warn": "warning"}


def _bool(env, key, default):
    raw = env.get(key)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    try:  # Horovod's rule for numbers: true when above 0 (HOROVOD_X=2 is on)
        return int(value) > 0
    except ValueError:
        pass
    raise ValueError(f"{key}={raw!r} is not a boolean (use 1 or 0)")


def _log_level(raw):
    """HOROVOD_LOG_LEVEL as one of LOG_LEVELS: any case, WARN for warning;
    anything else is warning, as in Horovod, said on stderr."""
    level = raw.strip().lower() or "warning"
    level = LOG_LEVEL_ALIASES.get(level, level)
    if level not in LOG_LEVELS:
        import sys

        print(f"coordinator: HOROVOD_LOG_LEVEL={raw!r} is not one of {', '.join(LOG_LEVELS)}; "
              "logging at warning", file=sys.stderr)
        return "warning"
    return level


def _number(env, key, default, kind, minimum=None):
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        number = float(raw.strip())
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not a number") from None
    if not math.isfinite(number):
        # inf made HOROVOD_CYCLE_TIME wait for ever, nan switched the
        # deadlock limit off, and an infinite size was a bare OverflowError.
        raise ValueError(f"{key}={raw!r} is not a finite number")
    value = number if kind is float else int(number)
    if minimum is not None and value < minimum:
        raise ValueError(f"{key}={raw!r} must be at least {minimum}")
    return value


def parse_cores(text):
    """A comma-separated list of core ids (HOROVOD_THREAD_AFFINITY,
    coordrun --thread-affinity) as a tuple; ValueError saying what is wrong."""
    try:
        cores = tuple(int(item) for item in text.split(","))
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of core ids") from None
    if min(cores) < 0:
        raise ValueError(f"{text!r}: core ids are 0 or more")
    return cores


def _cores(env, key):
    raw = env.get(key, "").strip()
    if not raw:
        return ()
    try:
        return parse_cores(raw)
    except ValueError as exc:
        raise ValueError(f"{key}={exc}") from None


@dataclasses.dataclass(frozen=True)
class Config:
    # Largest fused buffer in bytes; 0 disables fusion.
    fusion_threshold: int = 128 * MIB
    # Extra time (ms) the coordinator may wait to gather more ready tensors
    # into one fused buffer. 0: dispatch as soon as a tensor is ready.
    cycle_time_ms: float = 0.0
    # Response cache entries; 0 disables the cache.
    cache_capacity: int = 1024
    timeline: str = ""
    timeline_mark_cycles: bool = False
    stall_check_disable: bool = False
    stall_check_time: float = 60.0
    stall_shutdown_time: float = 0.0
    # COORDINATOR_SILENT_RANK_SECONDS: a rank whose coordinator leaves rank
    # 0's pings unanswered this long while a collective it is part of is in
    # flight (stopped, or its thread cannot run) fails the job with a
    # StallError on every rank, stall shutdown time or not. 0: only warn.
    silent_rank_time: float = 120.0
    # COORDINATOR_DEADLOCK_SECONDS: when every rank has been blocked this
    # long waiting for results that need a tensor some rank never submitted,
    # with nothing in flight anywhere (no rank can submit it: they called
    # collectives in different orders), those operations fail with a
    # StallError naming each rank's wait. 0: wait (and warn), as Horovod does.
    deadlock_time: float = 120.0
    # HOROVOD_START_TIMEOUT: how long init() waits in MPI_Init for the job's
    # other ranks to start MPI. MPI_Init cannot be interrupted, so past it a
    # watcher process ends the rank, saying which ranks of its host are late
    # (coordinator/mpi_watch.py). Horovod's launcher gives 30 s to start
    # the processes; this also covers a program's work before init(). 0: wait.
    start_time: float = 120.0
    # COORDINATOR_EXIT_AFTER_ERROR_SECONDS: a rank leaving after an uncaught
    # exception ends itself (SIGALRM) if exiting takes longer than this:
    # MPI_Finalize waits for every rank, and one blocked in an MPI call of
    # its own, outside the coordinator, would hold it (and the job) for good.
    # 0: wait, as Horovod does.
    exit_after_error_time: float = 30.0
    log_level: str = "warning"
    log_hide_time: bool = False
    hierarchical_allreduce: bool = False
    torus_allreduce: bool = False
    autotune: bool = False
    autotune_log: str = ""
    # Samples discarded before tuning starts, and training steps per sample
    # (HOROVOD_AUTOTUNE_WARMUP_SAMPLES, HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE).
    autotune_warmup_samples: int = 1
    autotune_steps_per_sample: int = 5
    # The knobs the user set (HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME):
    # the autotuner holds them, as Horovod's does.
    autotune_fixed: Tuple[str, ...] = ()
    # HOROVOD_THREAD_AFFINITY: cores, one per local rank (comma-separated),
    # to pin each rank's background thread to; empty: not pinned.
    thread_affinity: Tuple[int, ...] = ()
    dynamic_process_sets: bool = False
    # HOROVOD_ENABLE_ASYNC_COMPLETION: a GPU operation's handles complete
    # once its work is queued on the device, not once it has run; the
    # caller's stream waits for it in synchronize (Background._complete_queued).
    async_completion: bool = False
    # Allreduces larger than this run as a sequence of MPI calls of this many
    # bytes (0: one call). Open MPI's large-message allreduce is several times
    # slower than the same bytes in 4 MiB pieces on shared memory.
    segment_bytes: int = 4 * MIB
    # Fused allreduce tensors of at least this many bytes are reduced in place
    # rather than copied through the fusion buffer (0: copy all).
    pack_limit: int = 128 * 1024
    # Bytes of tiny tensors' data each negotiation cycle may carry itself,
    # saving their own collective (negotiation.py, riders; 0: none). Every
    # rank must use the same value (a difference stops the job at its first
    # cycle, as a slot disagreement).
    cycle_payload_bytes: int = 2048
    # Fixes the number of ranks per simulated host (0: ask MPI).
    local_size_override: int = 0
    # How often an idle background thread wakes to look for control
    # messages, liveness and stalls (seconds).
    idle_poll_interval: float = 0.05
    # How long a thread blocked in a collective (hvd.allreduce, not _async)
    # runs the background loop itself while the background thread sleeps
    # (Background.drive; seconds, 0: never).
    drive_seconds: float = 200e-6
    # While GPU work is in flight, the interpreter's switch interval
    # (sys.setswitchinterval) is at most this (seconds; 0: left as it is):
    # about how long a frontend thread waits for the interpreter lock while
    # the background thread polls (pacing.SwitchInterval).
    switch_interval: float = 100e-6
    # End this rank when the process that launched it (prterun/prted) dies;
    # coordrun sets it for every rank (launcher_watch.py).
    exit_with_launcher: bool = False

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Config":
        env = os.environ if env is None else env
        level = _log_level(env.get("HOROVOD_LOG_LEVEL", "warning"))
        return cls(
            fusion_threshold=_number(env, "HOROVOD_FUSION_THRESHOLD", cls.fusion_threshold, int, 0),
            cycle_time_ms=_number(env, "HOROVOD_CYCLE_TIME", cls.cycle_time_ms, float, 0.0),
            cache_capacity=_number(env, "HOROVOD_CACHE_CAPACITY", cls.cache_capacity, int, 0),
            timeline=env.get("HOROVOD_TIMELINE", ""),
            timeline_mark_cycles=_bool(env, "HOROVOD_TIMELINE_MARK_CYCLES", False),
            stall_check_disable=_bool(env, "HOROVOD_STALL_CHECK_DISABLE", False),
            stall_check_time=_number(env, "HOROVOD_STALL_CHECK_TIME_SECONDS",
                                     cls.stall_check_time, float, 0.0),
            stall_shutdown_time=_number(env, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                                        cls.stall_shutdown_time, float, 0.0),
            silent_rank_time=_number(env, "COORDINATOR_SILENT_RANK_SECONDS",
                                     cls.silent_rank_time, float, 0.0),
            deadlock_time=_number(env, "COORDINATOR_DEADLOCK_SECONDS",
                                  cls.deadlock_time, float, 0.0),
            start_time=_number(env, "HOROVOD_START_TIMEOUT", cls.start_time, float, 0.0),
            exit_after_error_time=_number(env, "COORDINATOR_EXIT_AFTER_ERROR_SECONDS",
                                          cls.exit_after_error_time, float, 0.0),
            log_level=level,
            log_hide_time=_bool(env, "HOROVOD_LOG_HIDE_TIME", False),
            hierarchical_allreduce=_bool(env, "HOROVOD_HIERARCHICAL_ALLREDUCE", False),
            torus_allreduce=_bool(env, "HOROVOD_TORUS_ALLREDUCE", False),
            autotune=_bool(env, "HOROVOD_AUTOTUNE", False),
            autotune_log=env.get("HOROVOD_AUTOTUNE_LOG", ""),
            autotune_warmup_samples=_number(env, "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
                                            cls.autotune_warmup_samples, int, 0),
            autotune_steps_per_sample=_number(env, "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
                                              cls.autotune_steps_per_sample, int, 1),
            autotune_fixed=tuple(knob for knob, key in (
                ("fusion_threshold", "HOROVOD_FUSION_THRESHOLD"),
                ("cycle_time", "HOROVOD_CYCLE_TIME")) if env.get(key, "").strip()),
            thread_affinity=_cores(env, "HOROVOD_THREAD_AFFINITY"),
            dynamic_process_sets=_bool(env, "HOROVOD_DYNAMIC_PROCESS_SETS", False),
            async_completion=_bool(env, "HOROVOD_ENABLE_ASYNC_COMPLETION", False),
            segment_bytes=_number(env, "COORDINATOR_SEGMENT_BYTES", cls.segment_bytes, int, 0),
            pack_limit=_number(env, "COORDINATOR_PACK_LIMIT", cls.pack_limit, int, 0),
            cycle_payload_bytes=_number(env, "COORDINATOR_CYCLE_PAYLOAD_BYTES",
                                        cls.cycle_payload_bytes, int, 0),
            local_size_override=_number(env, "COORDINATOR_SIMULATED_LOCAL_SIZE", 0, int, 0),
            idle_poll_interval=_number(env, "COORDINATOR_IDLE_POLL_SECONDS",
                                       cls.idle_poll_interval, float, 0.001),
            exit_with_launcher=_bool(env, "COORDINATOR_EXIT_WITH_LAUNCHER", False),
            drive_seconds=_number(env, "COORDINATOR_DRIVE_SECONDS", cls.drive_seconds, float,
                                  0.0),
            switch_interval=_number(env, "COORDINATOR_SWITCH_INTERVAL", cls.switch_interval,
                                    float, 0.0),
        )
