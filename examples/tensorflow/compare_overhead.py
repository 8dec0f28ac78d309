"""Per-step overhead of keras_digits.py at 2 ranks against the same script
without distribution, measured in alternating runs.

    python examples/tensorflow/compare_overhead.py [--runs 7] [--epochs 8] [--model cnn]

Four configurations run in turn, `--runs` times each, interleaved (the order
reversed every other run) so that the machine's background load hits them
alike:

- distributed: `mpirun -np 2 keras_digits.py` (DistributedOptimizer and the
  Horovod callbacks on the coordinator);
- raw MPI: `mpirun -np 2 keras_digits.py --raw-mpi`: the gradients averaged
  by one bare MPI_Allreduce in the train step, no coordinator. What
  exchanging gradients costs at the least, whoever does it;
- baseline: `mpirun -np 2 keras_digits.py --no-distribute`: the same two
  processes at the same time, each fitting its shard alone, so the two
  share the cores exactly as the ranks do but exchange nothing;
- alone: one `keras_digits.py --no-distribute` process with the machine to
  itself (for reference: it also shows what two processes on these cores
  cost each other).

Each run reports rank 0's median time per training step in the steady state
and per epoch (epochs after the first); the script prints the medians over
runs and the overheads over the baseline.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "keras_digits.py")


def mpirun():
    venv_bin = os.path.dirname(sys.executable)
    candidate = os.path.join(venv_bin, "mpirun")
    return candidate if os.path.exists(candidate) else "mpirun"


def environment():
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_mpi_yield_when_idle": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
                "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", "")})
    return env


def run(kind, script_args):
    launch = [mpirun(), "-n", "2", "--oversubscribe", "--bind-to", "none"]
    if kind == "distributed":
        cmd = launch + [sys.executable, SCRIPT] + script_args
    elif kind == "raw MPI":
        cmd = launch + [sys.executable, SCRIPT, "--raw-mpi"] + script_args
    elif kind == "baseline":
        cmd = launch + [sys.executable, SCRIPT, "--no-distribute", "--world", "2"] + script_args
    else:
        cmd = [sys.executable, SCRIPT, "--no-distribute", "--world", "2"] + script_args
    proc = subprocess.run(cmd, env=environment(), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    step = re.findall(r"median step time ([0-9.]+) ms", out)
    epoch = re.findall(r"median epoch time ([0-9.]+) ms", out)
    if proc.returncode != 0 or not step or not epoch:
        raise RuntimeError(f"{kind} run failed (rc={proc.returncode}):\n{out[-3000:]}")
    return float(step[0]), float(epoch[0])


def _overhead(a, b):
    return f"{100 * (a / b - 1):+.1f}%"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=None, help="per rank")
    parser.add_argument("--model", choices=["cnn", "mlp"], default=None)
    args = parser.parse_args()
    script_args = ["--epochs", str(args.epochs)]
    if args.batch_size:
        script_args += ["--batch-size", str(args.batch_size)]
    if args.model:
        script_args += ["--model", args.model]

    kinds = ["distributed", "raw MPI", "baseline", "alone"]
    steps = {k: [] for k in kinds}
    epochs = {k: [] for k in kinds}
    for i in range(args.runs):
        order = kinds if i % 2 == 0 else kinds[::-1]
        for kind in order:
            step, epoch = run(kind, script_args)
            steps[kind].append(step)
            epochs[kind].append(epoch)
        print(f"run {i + 1}: " + "  ".join(f"{k} {steps[k][-1]:.3f} ms" for k in kinds),
              flush=True)
    step = {k: statistics.median(v) for k, v in steps.items()}
    epoch = {k: statistics.median(v) for k, v in epochs.items()}
    print("median step time: " + "  ".join(f"{k} {step[k]:.3f} ms" for k in kinds))
    print("median epoch time: " + "  ".join(f"{k} {epoch[k]:.1f} ms" for k in kinds))
    print(f"overhead of distribution (distributed / baseline - 1): "
          f"{_overhead(step['distributed'], step['baseline'])} per step, "
          f"{_overhead(epoch['distributed'], epoch['baseline'])} per epoch")
    print(f"floor: raw MPI / baseline - 1: {_overhead(step['raw MPI'], step['baseline'])} "
          f"per step, {_overhead(epoch['raw MPI'], epoch['baseline'])} per epoch")
    print(f"distributed / raw MPI - 1: {_overhead(step['distributed'], step['raw MPI'])} "
          f"per step")
    print(f"distributed against one process alone: "
          f"{_overhead(step['distributed'], step['alone'])} per step")


if __name__ == "__main__":
    main()
