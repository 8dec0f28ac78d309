"""compare_ddp.py --profile: where a step's GPU time went, from the
profiler's trace (examples/torch/step_profile.py)."""

import os
import re
import sys

import pytest

from mpi_harness import mpirun, torch_distributed_env

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "torch"))
import step_profile  # noqa: E402


def _x(name, cat, ts, dur, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}


def _launch(ts, correlation):
    return _x("cudaLaunchKernel", "cuda_runtime", ts, 2, correlation=correlation)


def _kernel(name, ts, dur, correlation):
    return _x(name, "kernel", ts, dur, correlation=correlation)


def _step_trace():
    """One step from t=1000 us on the host: backward launches two compute
    kernels; the background thread launches an NCCL call during backward
    and another after it, around a pack and an unpack kernel; the optimizer
    launches one more compute kernel. Times in microseconds."""
    return {"traceEvents": [
        _x("ours.step0", "user_annotation", 1000, 20000),
        _x("backward", "user_annotation", 1100, 3000),
        _x("optimizer", "user_annotation", 4200, 16000),
        _launch(1200, 1), _kernel("conv_bwd", 2000, 3000, 1),            # 2000-5000
        _launch(1300, 2), _kernel("conv_bwd2", 5000, 2000, 2),           # 5000-7000
        _launch(1400, 3), _kernel("coordinator_pack_float32_float32", 4100, 50, 3),
        _launch(1500, 4), _kernel("ncclDevKernel_AllReduce_Sum_f32", 4200, 4000, 4),  # to 8200
        _launch(4300, 5), _kernel("ncclDevKernel_AllReduce_Sum_f32", 8300, 6000, 5),  # to 14300
        _launch(4400, 6), _kernel("coordinator_unpack_float32_float32", 14300, 100, 6),
        _launch(16000, 7), _kernel("sgd_kernel", 16000, 500, 7),          # to 16500
        # outside the step: ignored
        _launch(30000, 8), _kernel("ncclDevKernel_AllReduce_Sum_f32", 30000, 100, 8),
    ]}


def test_a_steps_kernels_are_sorted_into_compute_comm_and_fusion_on_the_device_clock():
    (step,) = step_profile.summarize(_step_trace(), "ours")
    assert step["host"] == pytest.approx(20.0)
    assert step["bwd_host"] == pytest.approx(3.0)
    assert step["opt_host"] == pytest.approx(16.0)
    assert step["span"] == pytest.approx(14.5)  # 2000 .. 16500
    assert step["bwd_end"] == pytest.approx(5.0)  # conv_bwd2 ends at 7000
    assert step["calls"] == 2
    assert step["comm"] == pytest.approx(10.0)  # 4200-8200 and 8300-14300
    assert step["compute"] == pytest.approx(5.5)  # 2000-7000 and 16000-16500
    assert step["tail"] == pytest.approx(9.5)
    assert step["comm_kernels"] == [pytest.approx((2.2, 4.0)), pytest.approx((6.3, 6.0))]
    assert [k[2] for k in step["fusion_kernels"]] == ["coordinator_pack_float32_float32",
                                                      "coordinator_unpack_float32_float32"]
    lines = step_profile.report("ours", [step])
    assert "2 call(s)" in lines[1] and "tail    9.50" in lines[1], lines
    assert "2.20+4.00, 6.30+6.00" in lines[2], lines
    assert "2.10+0.050p" in lines[3] and "12.30+0.100u" in lines[3], lines


def test_a_cpu_trace_gives_the_host_figures_and_says_there_are_no_kernels():
    trace = {"traceEvents": [e for e in _step_trace()["traceEvents"]
                             if e["cat"] == "user_annotation"]}
    steps = step_profile.summarize(trace, "ours")
    assert steps == [{"host": pytest.approx(20.0), "bwd_host": pytest.approx(3.0),
                      "opt_host": pytest.approx(16.0)}]
    lines = step_profile.report("ours", steps)
    assert "no GPU kernels" in lines[1]


def test_overlapping_kernels_are_counted_once():
    assert step_profile._union([(0, 4), (2, 6), (8, 9)]) == 7


@pytest.mark.mpi
def test_compare_ddp_profiles_each_implementation_and_keeps_the_traces(tmp_path):
    pytest.importorskip("torch")
    proc = mpirun(["examples/torch/compare_ddp.py", "--rounds", "2", "--block", "1",
                   "--warmup", "1", "--batch-size", "16", "--threads", "1", "--profile", "2",
                   "--async-completion",
                   "--profile-dir", str(tmp_path)], np_=2, env=torch_distributed_env(),
                  timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"ratio ours/ddp = [\d.]+", out), out
    assert "threads/rank, async completion" in out or "thread(s)/rank, async completion" in out, out
    for rank in (0, 1):
        assert f"rank {rank}: where the GPU time of a step went" in out, out
        for name in ("ours", "ddp", "local"):
            assert (tmp_path / f"{name}.rank{rank}.json").is_file()
    for name in ("ours", "ddp", "local"):
        hosts = re.findall(rf"  {name}\s+host: step\s+([\d.]+)\s+backward\(\)\s+([\d.]+)\s+"
                           rf"opt\.step\(\)\s+([\d.]+)\s+\(ms, median of 2 steps\)", out)
        assert len(hosts) == 2, out
        assert all(float(v) > 0 for row in hosts for v in row), out
    assert out.count("no GPU kernels in the trace") == 6, out
