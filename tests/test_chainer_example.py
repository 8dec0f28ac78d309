"""ChainerMN's MNIST example, run as the seed runs it (4 processes), learns
the digits, and its gradients travel through the coordinator."""

import json
import re

import pytest

from mpi_harness import mpirun

EPOCHS = 15


@pytest.mark.mpi
@pytest.mark.slow
def test_chainer_mnist_example_reaches_90_percent_at_4_ranks_through_the_coordinator(tmp_path):
    timeline = tmp_path / "timeline.json"
    out_dir = tmp_path / "result"
    proc = mpirun(["examples/chainer/train_mnist.py", "--epoch", str(EPOCHS), "--out",
                   str(out_dir)], np_=4, env={"HOROVOD_TIMELINE": str(timeline)}, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]

    # Rank 0 alone prints: one banner, one report row per epoch, one summary.
    assert out.count("Num process (COMM_WORLD): 4") == 1, out[-4000:]
    match = re.search(r"final validation accuracy (\d\.\d+) after (\d+) epochs on 4 processes",
                      out)
    assert match and int(match.group(2)) == EPOCHS, out[-4000:]
    accuracy = float(match.group(1))
    assert accuracy >= 0.9, out[-4000:]

    # LogReport's log (written by rank 0) has the evaluator's mean over ranks
    # for every epoch, and it agrees with the printed summary.
    log = json.loads((out_dir / "log").read_text())
    assert [entry["epoch"] for entry in log] == list(range(1, EPOCHS + 1))
    assert all("validation/main/accuracy" in entry for entry in log)
    assert abs(log[-1]["validation/main/accuracy"] - accuracy) < 1e-4

    # The coordinator's timeline names the Chainer tensors it moved: the
    # initial parameter broadcast, every gradient, the evaluator's means.
    trace = timeline.read_text()
    for name in ("chainermn.0.data/predictor/l1/W", "chainermn.0.grad/predictor/l1/W",
                 "chainermn.0.grad/predictor/l3/b",
                 "chainermn.0.eval.validation/main/accuracy"):
        assert name in trace, f"{name} not in the timeline"
