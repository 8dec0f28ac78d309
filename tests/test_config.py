"""Settings come from Horovod's environment variable names, read once."""

import pytest

from coordinator.config import MIB, Config


def test_defaults_match_horovods():
    cfg = Config.from_env({})
    assert cfg.fusion_threshold == 128 * MIB
    assert cfg.cache_capacity == 1024
    assert cfg.stall_check_time == 60 and cfg.stall_shutdown_time == 0
    assert not cfg.stall_check_disable and cfg.log_level == "warning"
    assert cfg.timeline == "" and not cfg.timeline_mark_cycles
    assert not cfg.async_completion
    assert cfg.start_time == 120


def test_horovod_variables_are_honoured():
    cfg = Config.from_env({
        "HOROVOD_FUSION_THRESHOLD": "1048576", "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_TIMELINE": "/tmp/t.json",
        "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_STALL_CHECK_DISABLE": "true",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "9",
        "HOROVOD_LOG_LEVEL": "DEBUG", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "/tmp/a.csv",
        "HOROVOD_DYNAMIC_PROCESS_SETS": "1", "HOROVOD_ENABLE_ASYNC_COMPLETION": "1",
        "HOROVOD_START_TIMEOUT": "45"})
    assert cfg.start_time == 45
    assert cfg.fusion_threshold == MIB and cfg.cycle_time_ms == 2.5
    assert cfg.cache_capacity == 0 and cfg.timeline == "/tmp/t.json"
    assert cfg.timeline_mark_cycles and cfg.stall_check_disable
    assert cfg.stall_check_time == 5 and cfg.stall_shutdown_time == 9
    assert cfg.log_level == "debug" and cfg.hierarchical_allreduce
    assert cfg.autotune and cfg.autotune_log == "/tmp/a.csv" and cfg.dynamic_process_sets
    assert cfg.async_completion


def test_autotune_knobs_and_thread_affinity():
    cfg = Config.from_env({})
    assert cfg.autotune_warmup_samples == 1 and cfg.autotune_steps_per_sample == 5
    assert cfg.thread_affinity == ()
    cfg = Config.from_env({"HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "3",
                           "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "10",
                           "HOROVOD_THREAD_AFFINITY": "3, 1"})
    assert cfg.autotune_warmup_samples == 3 and cfg.autotune_steps_per_sample == 10
    assert cfg.thread_affinity == (3, 1)


def test_the_switch_interval_setting():
    assert Config.from_env({}).switch_interval == 100e-6
    assert Config.from_env({"COORDINATOR_SWITCH_INTERVAL": "5e-5"}).switch_interval == 5e-5
    assert Config.from_env({"COORDINATOR_SWITCH_INTERVAL": "0"}).switch_interval == 0


def test_horovods_lenient_values_work_as_in_horovod(capsys):
    """Numbers are booleans as Horovod reads them (above 0 is on), WARN is
    warning, and a level nobody knows logs at warning, saying so."""
    on = Config.from_env({"HOROVOD_HIERARCHICAL_ALLREDUCE": "2", "HOROVOD_LOG_LEVEL": "WARN",
                          "HOROVOD_STALL_CHECK_DISABLE": "-1"})
    assert on.hierarchical_allreduce is True and on.log_level == "warning"
    assert on.stall_check_disable is False
    assert Config.from_env({"HOROVOD_LOG_LEVEL": "loud"}).log_level == "warning"
    assert "HOROVOD_LOG_LEVEL='loud' is not one of" in capsys.readouterr().err


@pytest.mark.parametrize("key,value,fragment", [
    ("HOROVOD_THREAD_AFFINITY", "0,x", "is not a comma-separated list of core ids"),
    ("HOROVOD_THREAD_AFFINITY", "-2", "core ids are 0 or more"),
    ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "0", "must be at least 1"),
    ("HOROVOD_FUSION_THRESHOLD", "lots", "is not a number"),
    ("HOROVOD_FUSION_THRESHOLD", "-1", "must be at least 0"),
    ("HOROVOD_STALL_CHECK_DISABLE", "maybe", "is not a boolean"),
    ("COORDINATOR_SWITCH_INTERVAL", "-1e-4", "must be at least 0"),
    # inf made the first cycle wait for ever, nan switched the deadlock limit
    # off, and an infinite size was a bare OverflowError naming nothing.
    ("HOROVOD_CYCLE_TIME", "inf", "is not a finite number"),
    ("COORDINATOR_DEADLOCK_SECONDS", "nan", "is not a finite number"),
    ("HOROVOD_START_TIMEOUT", "inf", "is not a finite number"),
    ("HOROVOD_START_TIMEOUT", "-5", "must be at least 0"),
    ("HOROVOD_FUSION_THRESHOLD", "inf", "is not a finite number"),
    ("HOROVOD_CACHE_CAPACITY", "1e400", "is not a finite number"),
])
def test_bad_values_name_the_variable(key, value, fragment):
    with pytest.raises(ValueError) as info:
        Config.from_env({key: value})
    assert key in str(info.value) and fragment in str(info.value)
