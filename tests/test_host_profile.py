"""compare_ddp.py --host-profile: where a step's host time went, from timed
gradient submissions and sampled thread stacks (examples/torch/host_profile.py)."""

import os
import re
import sys
import threading
import time
import types

import pytest

from mpi_harness import mpirun, torch_distributed_env

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "torch"))
import host_profile  # noqa: E402


def _wait_in_a_known_place(stop):
    while not stop.is_set():
        time.sleep(0.001)


def test_the_sampler_says_where_another_thread_spends_its_time():
    stop = threading.Event()
    worker = threading.Thread(target=_wait_in_a_known_place, args=(stop,), name="known")
    worker.start()
    sampler = host_profile.Sampler(period=1e-3)
    try:
        sampler.on = True
        # Until it has the samples asked for below, not for a fixed time: a
        # loaded machine may run the sampler only a few times in 0.2 s.
        deadline = time.monotonic() + 60
        while _samples_of("known", dict(sampler.counts)) <= 20:
            assert time.monotonic() < deadline, dict(sampler.counts)
            time.sleep(0.01)
        sampler.on = False
        sampler.stop()  # (a sample under way then would land after the take)
        counts = sampler.take()
    finally:
        sampler.stop()
        stop.set()
        worker.join()
    known = {stack: n for (name, stack), n in counts.items() if name == "known"}
    assert sum(known.values()) > 20
    top = max(known, key=known.get)
    assert top.startswith("test_host_profile.py:_wait_in_a_known_place:")
    assert sampler.take() == {}  # a take starts afresh
    lines = host_profile.sample_lines(counts)
    assert any(re.match(r"        known: \d+ samples", line) for line in lines)


def _samples_of(name, counts):
    return sum(n for (thread, _), n in counts.items() if thread == name)


def test_timed_wraps_a_module_function_only_while_on_and_restores_it():
    module = types.SimpleNamespace(f=lambda x: x + 1)
    original = module.f
    timed = host_profile.Timed(module, "f")
    assert module.f(1) == 2 and timed.calls == []
    timed.on = True
    assert module.f(2) == 3
    assert len(timed.calls) == 1 and timed.calls[0] >= 0
    timed.restore()
    assert module.f is original


def test_the_report_gives_phases_submission_quantiles_and_samples():
    steps = [{"backward": 0.060, "optimizer": 0.020}, {"backward": 0.070, "optimizer": 0.010}]
    submissions = [[100e-6] * 9 + [1e-3], [200e-6] * 10]
    lines = host_profile.report("ours", steps, submissions, {("t", "a.py:f:1"): 3})
    assert lines[0] == ("  ours  host: backward()   65.00  opt.step()   15.00  "
                        "(ms, median of 2 steps)")
    # 20 submissions: 9 of 100 us, 10 of 200, one of 1000
    assert lines[1] == ("        10 submissions a step: median 200 us, p90 200, p99 1000, "
                        "1.95 ms a step")
    assert lines[-1] == "          100.0% a.py:f:1"
    assert "no submissions timed" in host_profile.report("ddp", steps, [], {})[1]


@pytest.mark.mpi
def test_compare_ddp_host_profile_reports_each_implementation():
    pytest.importorskip("torch")
    proc = mpirun(["examples/torch/compare_ddp.py", "--rounds", "1", "--block", "1",
                   "--warmup", "1", "--batch-size", "16", "--threads", "1",
                   "--host-profile", "2", "--hold-lead", "1", "--switch-interval", "0",
                   "--host-completion", "--ready-at-launch"],
                  np_=2, env=torch_distributed_env(), timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for rank in (0, 1):
        assert f"rank {rank}: where the host time of a step went" in out, out
    for name in ("ours", "ddp", "local"):
        assert len(re.findall(rf"  {name}\s+host: backward\(\)\s+[\d.]+\s+opt\.step\(\)\s+"
                              r"[\d.]+\s+\(ms, median of 2 steps\)", out)) == 2, out
    # ours: the DistributedOptimizer's hooks submit the small CNN's 10 gradients
    assert len(re.findall(r"10 submissions a step: median \d+ us, p90 \d+, p99 \d+, "
                          r"[\d.]+ ms a step", out)) == 2, out
    assert out.count("no submissions timed") == 4, out
    assert len(re.findall(r"        coordinator-background: \d+ samples", out)) >= 2, out
    # The variants of ours, each in the rotation against DDP (rank 0 prints them).
    for name in ("ours@1", "ours~0", "ours-host", "ours-launch"):
        assert re.search(rf"  {re.escape(name)}\s+median step\s+[\d.]+ ms, ratio to ddp [\d.]+",
                         out), out
