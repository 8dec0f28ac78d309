"""PyTorch and TensorFlow in one process: one background thread, correct
results for both, tensors fused together, one timeline."""

import collections
import json
import re

import pytest

from mpi_harness import CaseResults, case_names, mpirun

RESULTS = CaseResults("tests/mpi/mixed_cases.py", timeout=400)


@pytest.mark.mpi
@pytest.mark.parametrize("case", case_names("tests/mpi/mixed_cases.py"))
def test_mixed_frameworks(case):
    RESULTS.check(case, 2)


@pytest.mark.mpi
def test_mixed_example_trains_both_models_into_one_timeline(tmp_path):
    trace = tmp_path / "mixed.json"
    # A 20 ms cycle: TensorFlow's gradients come while PyTorch's wait for it
    # in about two steps of three. With 2 ms it was one fusion in twenty,
    # and under the whole suite's load once none in three epochs.
    proc = mpirun(["examples/mixed/torch_and_tensorflow.py", "--epochs", "3"], np_=2,
                  env={"HOROVOD_TIMELINE": str(trace), "HOROVOD_CYCLE_TIME": "20"},
                  timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "one background thread" in out
    torch_acc, tf_acc = map(float, re.search(r"torch (\d\.\d+), tensorflow (\d\.\d+)",
                                             out).groups())
    assert torch_acc > 0.7 and tf_acc > 0.7, out
    events = json.loads(trace.read_text())
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "process_name"}
    assert any(n.startswith("allreduce.") for n in names.values())  # PyTorch's
    assert any(n.startswith("Horovod") for n in names.values())  # TensorFlow's
    fused = collections.defaultdict(set)
    for e in events:
        if e.get("name") == "MEMCPY_IN_FUSION_BUFFER":
            fused[e["ts"]].add(names[e["pid"]])
    assert any(any(n.startswith("allreduce.") for n in group)
               and any(n.startswith("Horovod") for n in group) for group in fused.values())
