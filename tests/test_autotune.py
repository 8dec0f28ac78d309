"""The autotuner measures candidates, converges, and never keeps a setting
that measured worse than the defaults."""

import csv

from coordinator.autotune import CYCLE_TIMES, MIB, THRESHOLDS, Autotuner
from coordinator.controller import Controller, Plan
from coordinator.wire import pb


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run(tuner, controller, clock, cost, steps=2000):
    """Feeds the tuner training steps whose duration `cost(threshold, cycle)` gives,
    after a one-off broadcast that must not be taken for the step."""
    tuner.observe([Plan(pb.Response(), (0, 1), 100, ["params.broadcast"])])
    for _ in range(steps):
        if tuner.done:
            break
        clock.now += cost(controller.fusion_threshold, controller.cycle_time)
        tuner.observe([Plan(pb.Response(), (0, 1), 10 * MIB, ["grad.1", "grad.0"]),
                       Plan(pb.Response(), (0, 1), 5 * MIB, ["grad.2"])])


def test_converges_to_the_fastest_candidate_and_logs_every_sample(tmp_path):
    clock = Clock()
    ctl = Controller(2)
    log = tmp_path / "autotune.csv"
    tuner = Autotuner(ctl, str(log), steps_per_sample=3, samples=2, clock=clock)

    def cost(threshold, cycle):  # 16 MiB and 0.5 ms are best in this made-up world
        return 0.01 + abs(threshold - 16 * MIB) / MIB * 1e-4 + abs(cycle - 0.0005)

    run(tuner, ctl, clock, cost)
    assert tuner.done
    assert tuner.best == (16 * MIB, 0.0005)
    assert (ctl.fusion_threshold, ctl.cycle_time) == tuner.best
    rows = list(csv.DictReader(log.open()))
    assert rows[-1]["phase"] == "chosen" and rows[-1]["fusion_threshold_bytes"] == str(16 * MIB)
    assert all(int(r["steps"]) == 3 for r in rows[:-1])  # steps recognised by name
    tried = {(int(r["fusion_threshold_bytes"]), float(r["cycle_time_ms"]))
             for r in rows if r["phase"] in ("threshold", "cycle_time")}
    assert {(t, 0.0) for t in THRESHOLDS} <= tried
    assert {(16 * MIB, c * 1e3) for c in CYCLE_TIMES} <= tried


def test_keeps_the_defaults_when_nothing_beats_them():
    clock = Clock()
    ctl = Controller(2)
    defaults = (ctl.fusion_threshold, ctl.cycle_time)
    tuner = Autotuner(ctl, steps_per_sample=2, samples=2, clock=clock)
    run(tuner, ctl, clock, lambda t, c: 0.01 if (t, c) == defaults else 0.02)
    assert tuner.done and tuner.best == defaults


def test_knobs_the_user_set_are_held_as_set(tmp_path):
    """As in Horovod: a fusion threshold or cycle time given explicitly is
    not searched; only the other knob is tuned."""
    from coordinator.config import Config

    cost = lambda t, c: 0.01 + abs(t - 16 * MIB) / MIB * 1e-4 + abs(c - 0.0005)  # noqa: E731
    clock = Clock()
    ctl = Controller(2)
    ctl.fusion_threshold = 32 * MIB
    log = tmp_path / "held.csv"
    tuner = Autotuner(ctl, str(log), steps_per_sample=2, samples=2, clock=clock,
                      fixed=("fusion_threshold",))
    run(tuner, ctl, clock, cost)
    assert tuner.done and tuner.best == (32 * MIB, 0.0005)
    assert {int(r["fusion_threshold_bytes"]) for r in csv.DictReader(log.open())} == {32 * MIB}
    clock, ctl = Clock(), Controller(2)
    ctl.cycle_time = 0.002
    tuner = Autotuner(ctl, steps_per_sample=2, samples=2, clock=clock, fixed=("cycle_time",))
    run(tuner, ctl, clock, cost)
    assert tuner.done and tuner.best == (16 * MIB, 0.002)
    clock, ctl = Clock(), Controller(2)
    tuner = Autotuner(ctl, steps_per_sample=2, samples=2, clock=clock,
                      fixed=("fusion_threshold", "cycle_time"))
    run(tuner, ctl, clock, cost)
    assert tuner.done and tuner.best == (ctl.fusion_threshold, ctl.cycle_time)
    assert Config.from_env({"HOROVOD_FUSION_THRESHOLD": "1048576"}).autotune_fixed == (
        "fusion_threshold",)
    assert Config.from_env({"HOROVOD_CYCLE_TIME": "2"}).autotune_fixed == ("cycle_time",)
    assert Config.from_env({}).autotune_fixed == ()


def test_autotune_runs_in_a_real_job_and_logs(tmp_path):
    from mpi_harness import mpirun

    log = tmp_path / "tune.csv"
    proc = mpirun(["tests/scripts/autotune_job.py", "400"], np_=2,
                  env={"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log)}, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "AUTOTUNE done=True" in out, out
    rows = list(csv.DictReader(log.open()))
    assert rows[-1]["phase"] == "chosen"
    assert sum(r["phase"] in ("threshold", "cycle_time") for r in rows) >= 8 * 3
