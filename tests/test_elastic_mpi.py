"""Elastic jobs under coordrun: workers lost (SIGKILL) and added, hosts
blacklisted, the reset limit and --min-np, and coordinator.run.

The "hosts" are names this machine answers to (localhost, 127.0.0.1, its
hostname): Open MPI places every rank here, while the driver keeps them
apart, blacklists them and places workers on them as on separate machines.
The jobs are tests/scripts/elastic_{torch,keras,numpy}.py.
"""

import os
import random
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from coordinator.elastic import service
from mpi_harness import ROOT, launcher_failed, mpi_env

SCRIPTS = os.path.join(ROOT, "tests", "scripts")
HOSTS = ["localhost", "127.0.0.1", socket.gethostname()]
pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.fixture(autouse=True)
def local_hosts():
    if len(set(HOSTS)) < 3 or not all(service.is_local(h) for h in HOSTS):
        pytest.skip(f"needs three names for this machine, has {HOSTS}")


def discovery(tmp_path, hosts):
    """A discovery script printing the lines of a file the test can change;
    returns (script path, function that sets the hosts)."""
    listing = tmp_path / "hosts.txt"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)

    def set_hosts(names):
        tmp = tmp_path / "hosts.tmp"
        tmp.write_text("".join(f"{h}:1\n" for h in names))
        os.replace(tmp, listing)

    set_hosts(hosts)
    return str(script), set_hosts


def coordrun(flags, script, env=None, timeout=240, on_line=None):
    """Runs coordrun flags... python <script>; returns (rc, stdout, stderr).
    `on_line(line)` sees each line of stdout as it comes. Launched once more
    when Open MPI's launcher failed to start before any rank printed
    (mpi_harness.launcher_failed): nothing of the test's ran then."""
    for attempt in (1, 2):
        rc, out, err = _coordrun_once(flags, script, env, timeout, on_line)
        if rc == 0 or attempt == 2 or out or not launcher_failed(err):
            return rc, out, err
        print(f"the MPI launcher failed to start; trying once more:\n{err[-1500:]}")


def _coordrun_once(flags, script, env, timeout, on_line):
    cmd = [sys.executable, "-m", "coordinator.run"] + flags + [
        sys.executable, os.path.join(SCRIPTS, script)]
    extra = {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    extra.update(env or {})
    proc = subprocess.Popen(cmd, env=mpi_env(extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    err = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    out = []
    deadline = time.monotonic() + timeout
    # A job that hangs without printing must still end the test at the deadline.
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    try:
        for line in proc.stdout:
            out.append(line)
            if on_line is not None:
                on_line(line)
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(cmd, timeout)
        proc.wait(max(1, deadline - time.monotonic()))
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(cmd, timeout)
    finally:
        killer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    return proc.returncode, "".join(out), "".join(err)


def steps(out):
    """[(time, size)] of every step line."""
    return [(float(m.group(2)), int(m.group(1)))
            for m in re.finditer(r"^step \d+ .*?size (\d+).*?t=([\d.]+)", out, re.MULTILINE)]


def finals(out):
    """{rank: (size, checksum text)} from the final lines."""
    return {int(m.group(1)): (int(m.group(2)), m.group(3))
            for m in re.finditer(r"^final rank (\d+) size (\d+) .*?checksum (.+)$", out,
                                 re.MULTILINE)}


def recovery_seconds(out):
    killed = float(re.search(r"^killing .*t=([\d.]+)", out, re.MULTILINE).group(1))
    after = [t for t, size in steps(out) if size == 2 and t > killed]
    return min(after) - killed


def outcomes(folder, error):
    """{rank: (exception type, text)} from the lines elastic_numpy.py's
    ranks wrote to `folder` (OUTCOMES) as they raised `error` (a regex)."""
    found = {}
    for path in folder.glob("rank*"):
        m = re.match(rf"rank (\d) raised ({error}): (.*)$", path.read_text().strip(), re.DOTALL)
        if m:
            found[m.group(1)] = (m.group(2), m.group(3))
    return found


def check_lost_worker(rc, out, err):
    assert rc == 0, err[-3000:]
    assert "driver: lost the worker on" in err and "membership 1: 2 kept" in err
    done = finals(out)
    assert sorted(done) == [0, 1], out[-2000:]
    assert {size for size, _ in done.values()} == {2}
    assert len({checksum for _, checksum in done.values()}) == 1, done  # identical weights
    assert recovery_seconds(out) <= 10


def test_torch_job_goes_on_after_losing_one_of_three_workers(tmp_path):
    script, _ = discovery(tmp_path, HOSTS)
    rc, out, err = coordrun(["-np", "3", "--min-np", "2", "--host-discovery-script", script],
                            "elastic_torch.py", env={"KILL_AT": "25:1", "EPOCHS": "2"})
    check_lost_worker(rc, out, err)
    assert [size for _, size in steps(out)][:3] == [3, 3, 3]


def test_keras_job_goes_on_after_losing_one_of_three_workers(tmp_path):
    script, _ = discovery(tmp_path, HOSTS)
    rc, out, err = coordrun(["-np", "3", "--min-np", "2", "--host-discovery-script", script],
                            "elastic_keras.py", env={"KILL_AT": "20:2", "EPOCHS": "2"})
    check_lost_worker(rc, out, err)


def test_a_new_host_brings_a_worker_that_receives_the_state(tmp_path):
    script, set_hosts = discovery(tmp_path, HOSTS[:2])
    added = []

    def add_host_once_training(line):
        if not added and line.startswith("step 10 "):
            added.append(time.monotonic())
            set_hosts(HOSTS)

    rc, out, err = coordrun(["-np", "2", "--min-np", "2", "--max-np", "3",
                             "--host-discovery-script", script],
                            "elastic_torch.py", env={"EPOCHS": "3", "STEP_SLEEP": "0.05"},
                            on_line=add_host_once_training)
    assert rc == 0, err[-3000:]
    assert "membership 1: 2 kept, 0 leave, 1 new" in err
    sizes = [size for _, size in steps(out)]
    assert sizes[0] == 2 and sizes[-1] == 3
    done = finals(out)
    assert sorted(done) == [0, 1, 2] and {s for s, _ in done.values()} == {3}
    assert len({checksum for _, checksum in done.values()}) == 1, done


def test_a_process_set_is_added_again_after_each_reset_and_by_a_spawned_worker(tmp_path):
    """The pair [0, 1] of a dynamic-set job: a worker is lost (4 -> 3),
    then a host gains a slot (3 -> 4, a spawned worker). The shutdown of
    each reset releases the set, the reset callback adds the same object
    again (dynamic sets stay on), the spawned worker adds it at the top,
    and the pair's allreduce is right in every membership. It used to fail
    at the first reset: the reset's init() turned dynamic sets off, and the
    set kept its old id, so it could not be added again."""
    script, _ = discovery(tmp_path, [])
    listing = tmp_path / "hosts.txt"

    def slots(spec):
        tmp = tmp_path / "hosts.tmp"
        tmp.write_text("".join(f"{h}:{n}\n" for h, n in spec))
        os.replace(tmp, listing)

    slots([(HOSTS[0], 2), (HOSTS[1], 1), (HOSTS[2], 1)])
    grown = []

    def grow_after_the_reset(line):
        if not grown and line.startswith("reset: "):
            grown.append(line)
            slots([(HOSTS[0], 3), (HOSTS[1], 1)])

    rc, out, err = coordrun(["-np", "4", "--min-np", "2", "--max-np", "4",
                             "--host-discovery-script", script],
                            "elastic_sets.py", env={"KILL_AT": "8:3", "STEPS": "40"},
                            on_line=grow_after_the_reset)
    assert rc == 0, err[-3000:] + out[-2000:]
    assert "membership 1: 3 kept" in err and "membership 2: 3 kept, 0 leave, 1 new" in err, err
    resets = re.findall(r"^reset: rank (\d) of (\d) .*the pair was (\w+)", out, re.MULTILINE)
    assert sorted(resets) == [("0", "3", "released"), ("0", "4", "released"),
                              ("1", "3", "released"), ("1", "4", "released"),
                              ("2", "3", "released"), ("2", "4", "released")], out[-3000:]
    pairs = re.findall(r"^step \d+ rank (\d) size (\d) pair (\S+)", out, re.MULTILINE)
    sizes = {size for _, size, _ in pairs}
    assert sizes == {"4", "3"}, sizes
    assert {got for rank, _, got in pairs if rank in "01"} == {"3.0"}
    assert {got for rank, _, got in pairs if rank in "23"} == {"None"}
    done = re.findall(r"^done rank (\d) size (\d) step 40 total (\S+)", out, re.MULTILINE)
    assert sorted(r for r, _, _ in done) == ["0", "1", "2", "3"], out[-3000:]
    assert len({total for _, _, total in done}) == 1, done


def test_a_host_that_keeps_failing_is_blacklisted_and_the_job_finishes(tmp_path):
    bad = HOSTS[1]
    script, _ = discovery(tmp_path, HOSTS)
    rc, out, err = coordrun(["-np", "2", "--min-np", "2", "--max-np", "3",
                             "--blacklist-cooldown-range", "1", "2",
                             "--host-discovery-script", script],
                            "elastic_numpy.py",
                            env={"FAIL_HOST": bad, "STEPS": "100", "STEP_SLEEP": "0.05"})
    assert rc == 0, err[-3000:]
    assert f"blacklisted host {bad} after a worker on it failed (failure 1)" in err
    assert f"blacklisted host {bad} after a worker on it failed (failure 2)" in err
    assert f"host {bad} is back from the blacklist" in err
    for other in (HOSTS[0], HOSTS[2]):
        assert f"blacklisted host {other}" not in err
    done = re.findall(r"^done rank \d+ size (\d+) step 100 total ([\d.]+)", out, re.MULTILINE)
    assert len(done) >= 2 and len(set(done)) == 1, out[-2000:]


def test_workers_on_a_removed_host_leave_and_the_rest_go_on(tmp_path):
    script, set_hosts = discovery(tmp_path, HOSTS)
    removed = []

    def remove_host_once_training(line):
        if not removed and line.startswith("step 20 "):
            removed.append(True)
            set_hosts([HOSTS[0], HOSTS[2]])

    rc, out, err = coordrun(["-np", "3", "--min-np", "1", "--host-discovery-script", script],
                            "elastic_numpy.py", env={"STEPS": "80", "STEP_SLEEP": "0.05"},
                            on_line=remove_host_once_training)
    assert rc == 0, err[-3000:]
    assert "membership 1: 2 kept, 1 leave, 0 new" in err
    assert "its host is no longer part of the job; exiting" in err
    done = re.findall(r"^done rank \d+ size (\d+) step 80 total ([\d.]+)", out, re.MULTILINE)
    assert len(done) == 2 and len(set(done)) == 1 and done[0][0] == "2", out[-2000:]


def test_a_rank_that_fails_its_part_of_a_collective_resets_the_job_with_every_worker(
        tmp_path):
    """Rank 1's backend raises in a collective every rank agreed to run: all
    three raise HorovodInternalError naming it and the cause, so elastic
    training restores the last commit, re-forms with the same three workers
    and finishes in step. (Before 43ca950 the job recovered too, once rank
    1's reset shut its coordinator down and so failed the others' wait,
    but they never learned the cause.)"""
    script, _ = discovery(tmp_path, HOSTS)
    rc, out, err = coordrun(["-np", "3", "--min-np", "1", "--host-discovery-script", script],
                            "elastic_numpy.py", env={"FAIL_OP_AT": "10:1", "STEPS": "30"})
    assert rc == 0, err[-3000:]
    assert "failed: MemoryError: injected" in err and "without rank 1" in err, err[-3000:]
    assert "membership 1: 3 kept, 0 leave, 0 new" in err, err[-3000:]
    resets = re.findall(r"^reset: rank (\d) of 3", out, re.MULTILINE)
    assert sorted(resets) == ["0", "1", "2"], out[-2000:]
    done = re.findall(r"^done rank (\d) size 3 step 30 total (\S+)$", out, re.MULTILINE)
    assert sorted(done) == [("0", "90.0"), ("1", "90.0"), ("2", "90.0")], out[-2000:]


def test_a_failure_no_reset_repairs_stops_the_job_after_three_attempts(tmp_path):
    """Rank 1's backend fails the same operation in every membership: the
    first two failures reset the job (it might have been passing), the
    third, met again at the same commit, stops it on every rank, saying
    why. Horovod reset for ever, unless --reset-limit said otherwise (so did
    this project, about 20 times a second here)."""
    script, _ = discovery(tmp_path, HOSTS)
    rc, out, err = coordrun(["-np", "3", "--min-np", "1", "--host-discovery-script", script],
                            "elastic_numpy.py", timeout=120,
                            env={"FAIL_OP_AT": "10:1", "FAIL_OP_ALWAYS": "1", "STEPS": "30",
                                 "OUTCOMES": str(tmp_path), "OUTCOMES_AWAIT": "3"})
    assert rc != 0
    resets = re.findall(r"^reset: rank (\d) of 3", out, re.MULTILINE)
    # Two resets; three when the first attempt's failure hit another of rank
    # 1's operations (the commit's check of hosts), whose text differs.
    per_rank = {resets.count(rank) for rank in "012"}
    assert per_rank in ({2}, {3}), out[-3000:] + err[-3000:]
    raised = outcomes(tmp_path, "HorovodInternalError")
    assert sorted(raised) == ["0", "1", "2"], out[-3000:] + err[-3000:]
    for _, text in raised.values():
        assert "failed: MemoryError: injected" in text, text
        assert "this failure came back on 3 attempts in a row, with no commit" in text, text


@pytest.mark.parametrize("kind, error, says", [
    ("mismatch", "TensorMismatchError", "Mismatched shape for allreduce of tensor 'mistake'"),
    ("deadlock", "DeadlockError", "Deadlocked allreduce of tensor 'mistake"),
])
def test_the_programs_own_mistake_stops_an_elastic_job_on_every_rank(tmp_path, kind, error,
                                                                      says):
    """Mismatched tensors and ranks waiting on each other (like input a
    rank refuses) happen again after any reset (Horovod's job reset on a mismatch about 70
    times a second, for ever): every rank raises the error out of
    elastic.run, saying why it did not reset, and coordrun fails."""
    script, _ = discovery(tmp_path, HOSTS)
    rc, out, err = coordrun(["-np", "3", "--min-np", "2", "--host-discovery-script", script],
                            "elastic_numpy.py", timeout=120,
                            env={"MISTAKE_AT": f"7:{kind}", "STEPS": "30",
                                 "COORDINATOR_DEADLOCK_SECONDS": "2",
                                 "OUTCOMES": str(tmp_path), "OUTCOMES_AWAIT": "3"})
    assert rc != 0
    assert "reset:" not in out, out[-3000:]
    raised = outcomes(tmp_path, error)
    assert sorted(raised) == ["0", "1", "2"], out[-3000:] + err[-3000:]
    for _, text in raised.values():
        assert re.search(says, text), text
        assert "did not reset the job for this error" in text, text


def test_a_worker_whose_training_returns_early_stops_the_job_on_every_rank(tmp_path):
    """Rank 1's training function returns while the others are still in
    theirs (its data ran out): no reset brings it back, so, as in Horovod, a
    worker that finishes ends the job; the others raise, saying so. It used
    to hang for good: rank 1 waited in MPI_Finalize for the others, who
    waited for it in MPI_Comm_shrink."""
    script, _ = discovery(tmp_path, HOSTS)
    started = time.monotonic()
    rc, out, err = coordrun(["-np", "3", "--min-np", "2", "--host-discovery-script", script],
                            "elastic_numpy.py", timeout=120,
                            env={"FINISH_AT": "12:1", "STEPS": "30", "OUTCOMES": str(tmp_path),
                                 "OUTCOMES_AWAIT": "2"})
    assert rc != 0 and time.monotonic() - started < 60
    assert "rank 1 returns early at step 12" in out and "reset:" not in out, out[-3000:]
    raised = outcomes(tmp_path, "ShutdownError")
    assert sorted(raised) == ["0", "2"], out[-3000:] + err[-3000:]
    for _, text in raised.values():
        assert "(rank 1 called shutdown(); its program is done)" in text, text
        assert "a worker that finishes ends the job" in text, text


def test_a_worker_whose_training_raises_leaves_and_the_others_finish_without_it(tmp_path):
    """Rank 1's own code raises: it leaves the job (its host blacklisted, as
    in Horovod) and the others, told why, re-form without it within
    seconds and finish. It used to hang for good: its MPI_Finalize waited
    for the others, who waited for it in MPI_Comm_shrink; and ending
    without finalizing was seen only by ULFM's detector, 30 s later."""
    script, _ = discovery(tmp_path, HOSTS)
    rc, out, err = coordrun(["-np", "3", "--min-np", "2", "--host-discovery-script", script],
                            "elastic_numpy.py", timeout=120,
                            env={"RAISE_AT": "12:1", "STEPS": "30", "LEDGER": "1"})
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "RuntimeError: a bug in rank 1's training at step 12" in err, err[-3000:]
    assert "membership 1: 2 kept" in err, err[-3000:]
    done = re.findall(r"^done rank (\d) size 2 step 30 total (\S+) ledger (\S+) steps 30$",
                      out, re.MULTILINE)
    assert sorted(rank for rank, _, _ in done) == ["0", "1"], out[-3000:]
    assert all(total == ledger for _, total, ledger in done), done
    raised = float(re.search(r"^reset: rank 0 of 2 .*t=([\d.]+)", out, re.MULTILINE).group(1))
    last_old = max(t for t, size in steps(out) if size == 3)
    assert raised - last_old < 10, (raised, last_old)


def test_the_job_stops_after_reset_limit_resets(tmp_path):
    script, _ = discovery(tmp_path, HOSTS)
    rc, out, err = coordrun(["-np", "3", "--min-np", "1", "--reset-limit", "1",
                             "--host-discovery-script", script], "elastic_numpy.py",
                            env={"KILL_AT": "10:2:0,20:1:1", "STEPS": "60"})
    assert rc != 0
    assert "membership 1: 2 kept" in err
    assert re.search(r"coordrun: the elastic driver stopped the job: the job has been re-formed "
                     r"1 time, its --reset-limit; a lost worker would need one more", err), err


def test_too_few_workers_after_the_elastic_timeout_fail_the_job_clearly(tmp_path):
    script, _ = discovery(tmp_path, HOSTS)
    started = time.monotonic()
    rc, out, err = coordrun(["-np", "3", "--min-np", "3", "--elastic-timeout", "2",
                             "--host-discovery-script", script], "elastic_numpy.py",
                            env={"KILL_AT": "10:2", "STEPS": "60"})
    assert rc != 0 and time.monotonic() - started < 60
    assert re.search(r"coordrun: the elastic driver stopped the job: only 2 worker slots are "
                     r"available, fewer than the 3 needed to go on \(--min-np\), after waiting "
                     r"2 s \(--elastic-timeout\)", err), err


def test_a_stopped_worker_is_taken_for_lost_and_the_job_finishes_without_it(tmp_path):
    """SIGSTOPped (hung, its machine silent): ULFM's heartbeat detector
    declares it failed (here after 10 s), the others re-form without it and
    finish, and coordrun ends the stopped process, which kept mpirun
    waiting. Before, the others waited for it in MPI_Comm_shrink for ever."""
    script, _ = discovery(tmp_path, HOSTS)
    rc, out, err = coordrun(["-np", "3", "--min-np", "1", "--host-discovery-script", script],
                            "elastic_numpy.py",
                            env={"STOP_AT": "15:1", "STEPS": "60",
                                 "OMPI_MCA_mpi_ft_detector_timeout": "10"}, timeout=150)
    assert rc == 0, err[-3000:]
    assert "stopping rank 1 (step 15)" in out and "membership 1: 2 kept" in err, err[-3000:]
    done = re.findall(r"^done rank (\d) size 2 step 60 total (\S+)$", out, re.MULTILINE)
    assert len(done) == 2 and len({total for _, total in done}) == 1, out[-2000:]
    # ULFM's detector took it for failed (the driver would have ended it
    # SILENCE_MARGIN later): coordrun ends it at the end.
    assert "yet mpirun still waits for processes of earlier memberships" in err, err[-3000:]
    assert "has sent no heartbeat" not in err, err[-3000:]


def test_a_stopped_worker_spawned_later_is_ended_and_the_job_finishes_without_it(tmp_path):
    """ULFM's detector watches only the ranks mpirun started: a worker spawned
    later (here into membership 2, after a loss) that is SIGSTOPped goes
    silent to the driver instead, which ends it (it runs on the driver's
    machine) a few heartbeats after ULFM's detector timeout, and the other
    finishes without it. Before, the other waited for it for ever."""
    script, _ = discovery(tmp_path, HOSTS)
    started = time.monotonic()
    rc, out, err = coordrun(["-np", "2", "--min-np", "1", "--max-np", "2",
                             "--host-discovery-script", script], "elastic_numpy.py",
                            env={"KILL_AT": "10:1:0", "STOP_AT": "60:1:2", "STEPS": "150",
                                 "OMPI_MCA_mpi_ft_detector_timeout": "8"}, timeout=150)
    assert rc == 0, err[-3000:]
    assert "membership 2: 1 kept, 0 leave, 1 new" in err, err[-3000:]
    assert "stopping rank 1 (step 60)" in out, out[-2000:]
    assert re.search(r"driver: rank 1 \(\S+\[0\]\) has sent no heartbeat for \d+ s \(stopped, "
                     r"or hung\): ending it, so that the others re-form without it", err), \
        err[-3000:]
    assert "membership 3: 1 kept" in err, err[-3000:]
    assert re.findall(r"^done rank (\d) size (\d) step 150", out, re.MULTILINE) == [("0", "1")], \
        out[-2000:]
    assert time.monotonic() - started < 120


def test_when_the_last_worker_is_lost_the_job_ends_saying_so(tmp_path):
    """Each loss leaves one worker fewer (a failure adds none above
    --min-np); when the last one is SIGKILLed no one is left to re-form
    the job. It used to end with status 1 and no word of why."""
    script, _ = discovery(tmp_path, HOSTS[:2])
    rc, out, err = coordrun(["-np", "2", "--min-np", "1", "--host-discovery-script", script],
                            "elastic_numpy.py", env={"KILL_AT": "10:1:0,20:0:1", "STEPS": "60"})
    assert rc != 0 and "membership 1: 1 kept" in err, err[-3000:]
    assert re.search(r"coordrun: the job ended: in membership 1 of 1 workers, rank 0 \((\S+)\[0\]\) "
                     r"ended without reporting to the driver \(killed, or its machine lost\); no "
                     r"worker of it was left to carry the job's state on", err), err[-3000:]


@pytest.mark.parametrize("seed, min_np", [(3, 1), (21, 1), (103, 2)])
def test_random_losses_and_host_changes_keep_the_state_whole(tmp_path, seed, min_np):
    """Workers SIGKILLed at random steps of random memberships, hosts
    removed and added at random, blacklisted hosts coming back after 1-2 s:
    every rank that finishes has run every step once, in the committed
    history every rank restored (tests/scripts/elastic_numpy.py LEDGER: each
    step adds the sum of rank + 1 over its membership, and records the
    membership's size). Or the job stops clearly, where no worker is left
    that could carry the state on, or too few for --min-np. (Seed 103 at
    --min-np 2: hosts removed, then one back before the driver planned; the
    job hung, the old ranks having skipped the sync the new one waited in.)"""
    rng = random.Random(seed)
    script, set_hosts = discovery(tmp_path, HOSTS)
    total_steps = 150
    kills = ",".join(f"{rng.randint(5, total_steps - 10)}:{rng.randint(0, 2)}:{rng.randint(0, 3)}"
                     for _ in range(rng.randint(1, 3)))
    changes = {rng.randint(5, total_steps - 5): rng.sample(HOSTS, rng.randint(1, 3))
               for _ in range(rng.randint(0, 2))}

    def change_hosts(line):
        m = re.match(r"step (\d+) ", line)
        if m and int(m.group(1)) in changes:
            set_hosts(changes.pop(int(m.group(1))))

    rc, out, err = coordrun(["-np", "3", "--min-np", str(min_np), "--max-np", "3",
                             "--blacklist-cooldown-range", "1", "2", "--elastic-timeout", "5",
                             "--host-discovery-script", script], "elastic_numpy.py",
                            env={"LEDGER": "1", "STEPS": str(total_steps), "STEP_SLEEP": "0.05",
                                 "KILL_AT": kills}, on_line=change_hosts)
    if rc != 0:
        assert ("no worker of the previous membership is on a host the job may still use"
                in err or "no worker of it was left to carry the job's state on" in err
                or f"fewer than the {min_np} needed to go on (--min-np)" in err), (
            kills, err[-3000:])
        return
    done = re.findall(r"^done rank (\d+) size (\d+) step (\d+) total (\S+) ledger (\S+) "
                      r"steps (\d+)$", out, re.MULTILINE)
    assert done and len(done) == int(done[0][1]), f"kills {kills}:\n{out[-2000:]}"
    for _, _, step, total, ledger, steps in done:
        assert int(step) == int(steps) == total_steps and float(total) == float(ledger), (
            kills, done)
    assert len({d[3] for d in done}) == 1, (kills, done)


def test_coordinator_run_returns_every_ranks_value(monkeypatch):
    import coordinator

    # Defined here, so cloudpickle sends them by value (the ranks cannot
    # import this test module).
    def ranks_report(offset):
        import numpy as np

        import coordinator as hvd

        hvd.init()
        total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="t")
        out = (hvd.rank(), hvd.size(), float(total[0]) + offset)
        hvd.shutdown()
        return out

    def fails_on_rank_one():
        if os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
            raise ZeroDivisionError("rank one cannot")
        return "fine"

    for key, value in mpi_env().items():
        monkeypatch.setenv(key, value)
    assert coordinator.run(ranks_report, args=(10,), np=3) == [
        (0, 3, 16.0), (1, 3, 16.0), (2, 3, 16.0)]
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 raised:.*ZeroDivisionError: rank one"):
        coordinator.run(fails_on_rank_one, np=2)


# --------------------------------------------------------- real hosts

@pytest.fixture
def three_hosts():
    """hosta, hostb, hostc: network namespaces with their own hostnames and
    addresses (examples/multihost/netns.py); skips where they cannot be made."""
    import shutil
    import tempfile

    from netns import netns

    directory = tempfile.mkdtemp(prefix="hosts-")
    cluster = netns.Cluster(directory, ("hosta", "hostb", "hostc"))
    try:
        cluster.start()
    except netns.Unavailable as exc:
        shutil.rmtree(directory, ignore_errors=True)
        pytest.skip(f"cannot make hosts from network namespaces here: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)


# What PRRTE prints when its launcher crashes in a spawn after a failure.
PRRTE_SPAWN_CRASH = "pmix_server_dyn.c"


def test_on_real_hosts_a_lost_worker_is_replaced_on_another_host(three_hosts, tmp_path):
    """coordrun on hosta; the worker on hostb is SIGKILLed; hostb is
    blacklisted and, to keep --min-np 2, a worker is spawned on hostc (its
    PRRTE daemon started with the job), fetches the job's environment from
    the driver, joins with rank 0's state, and the job finishes."""
    cluster = three_hosts
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho hosta:1\necho hostb:1\necho hostc:1\n")
    script.chmod(0o755)
    argv = [os.path.join(os.path.dirname(sys.executable), "coordrun"), "-np", "2",
            "--min-np", "2", "--max-np", "2", "--host-discovery-script", str(script),
            "--verbose", "-x", "STEPS", "-x", "KILL_AT", "-x", "STEP_SLEEP",
            sys.executable, os.path.join(SCRIPTS, "elastic_numpy.py")]
    env = {"PRTE_MCA_plm_ssh_agent": cluster.agent, "PYTHONPATH": ROOT,
           "PYTHONUNBUFFERED": "1", "HOROVOD_LOG_HIDE_TIME": "1", "STEPS": "60",
           "KILL_AT": "20:1", "STEP_SLEEP": "0.05"}

    def run():
        proc = cluster.popen("hosta", argv, env=env, text=True, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            out, _ = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
        return proc.returncode, out

    rc, out = run()
    for _ in range(2):
        if rc == 0 or PRRTE_SPAWN_CRASH not in out:
            break
        # PRRTE 3.0.14's launcher itself crashed while spawning the new
        # worker (in 2 of 11 suite runs here, once twice in a row; 0 of 8
        # runs alone; README, "Elastic training"): not ours to fix, so
        # up to two more tries.
        print(f"prterun crashed during the spawn; trying again:\n{out[-1500:]}")
        rc, out = run()
    assert rc == 0, out[-4000:]
    assert re.search(r"COORDINATOR_DRIVER_ADDRESS=10\.77\.0\.1:\d+", out)  # the hosts' link
    assert "blacklisted host hostb" in out
    assert "membership 1: 1 kept, 0 leave, 1 new: hosta[0], hostc[0]" in out
    done = re.findall(r"^done rank (\d) size 2 step 60 total ([\d.]+)", out, re.MULTILINE)
    assert sorted(r for r, _ in done) == ["0", "1"] and len({t for _, t in done}) == 1, out[-3000:]
