"""ChainerMN's model-parallel MNIST example (an MLP split over 2 ranks with
MultiNodeChainList) learns the digits as well as the same MLP in one
process, in the same number of epochs, and its messages go through the
coordinator."""

import json
import re
import subprocess
import sys

import pytest

from mpi_harness import ROOT, mpi_env, mpirun

SCRIPT = "examples/chainer/train_mnist_model_parallel.py"
EPOCHS = 10  # (0.9723 split and alone, 2026-12-01; 20 took twice as long)
RESULT = re.compile(r"final validation accuracy (\d\.\d+) after (\d+) epochs (.+)")


def _result(out):
    match = RESULT.search(out)
    assert match, out[-4000:]
    return float(match.group(1)), int(match.group(2)), match.group(3).strip()


@pytest.mark.mpi
@pytest.mark.slow
def test_model_parallel_example_matches_the_single_process_model(tmp_path):
    timeline = tmp_path / "timeline.json"
    split = mpirun([SCRIPT, "--epoch", str(EPOCHS), "--out", str(tmp_path / "split")], np_=2,
                   env={"HOROVOD_TIMELINE": str(timeline)}, timeout=400)
    out = split.stdout + split.stderr
    assert split.returncode == 0, out[-4000:]
    single = subprocess.run([sys.executable, SCRIPT, "--single", "--epoch", str(EPOCHS),
                             "--out", str(tmp_path / "single")], cwd=ROOT, env=mpi_env(),
                            capture_output=True, text=True, timeout=400)
    assert single.returncode == 0, (single.stdout + single.stderr)[-4000:]

    split_acc, split_epochs, how = _result(out)
    assert how == "split over 2 processes"
    single_acc, single_epochs, how = _result(single.stdout)
    assert how == "in one process"
    assert split_epochs == single_epochs == EPOCHS
    assert split_acc >= 0.9, out[-4000:]
    assert abs(split_acc - single_acc) <= 0.01, (split_acc, single_acc)

    # Rank 0 alone reports; its log has every epoch.
    log = json.loads((tmp_path / "split" / "log").read_text())
    assert [entry["epoch"] for entry in log] == list(range(1, EPOCHS + 1))

    # Both directions of both messages went through the coordinator: rank 0's
    # activations to rank 1 and the logits back, then the gradients.
    trace = timeline.read_text()
    for name in ("chainermn.0.p2p.tag0.0 [0->1]", "chainermn.0.p2p.tag0.0 [1->0]"):
        assert name in trace, f"{name} not in the timeline"
