"""Per-step overhead of keras_digits.py at 2 ranks against the same script
without distribution, measured in alternating runs.

    python examples/tensorflow/compare_overhead.py [--runs 7] [--epochs 6]

Three configurations run in turn, `--runs` times each, interleaved so that
the machine's background load hits them alike:

- distributed: `mpirun -np 2 keras_digits.py` (DistributedOptimizer and the
  Horovod callbacks on the coordinator);
- baseline: `mpirun -np 2 keras_digits.py --no-distribute`: the same two
  processes at the same time, each fitting its shard alone, so the two
  share the cores exactly as the ranks do but exchange nothing;
- alone: one `keras_digits.py --no-distribute` process with the machine to
  itself (for reference: it also shows what two processes on these cores
  cost each other).

Each run reports its median time per training step (rank 0, epochs after the
first); the script prints the median over runs and the overhead of the
distributed run over the baseline.
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
    elif kind == "baseline":
        cmd = launch + [sys.executable, SCRIPT, "--no-distribute", "--world", "2"] + script_args
    else:
        cmd = [sys.executable, SCRIPT, "--no-distribute", "--world", "2"] + script_args
    proc = subprocess.run(cmd, env=environment(), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    found = re.findall(r"median step time ([0-9.]+) ms", out)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{kind} run failed (rc={proc.returncode}):\n{out[-3000:]}")
    return float(found[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=None, help="per rank")
    args = parser.parse_args()
    script_args = ["--epochs", str(args.epochs)]
    if args.batch_size:
        script_args += ["--batch-size", str(args.batch_size)]

    kinds = ["distributed", "baseline", "alone"]
    times = {k: [] for k in kinds}
    for i in range(args.runs):
        order = kinds if i % 2 == 0 else kinds[::-1]
        for kind in order:
            times[kind].append(run(kind, script_args))
        print(f"run {i + 1}: " + "  ".join(f"{k} {times[k][-1]:.3f} ms" for k in kinds),
              flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print("median step time: " + "  ".join(f"{k} {med[k]:.3f} ms" for k in kinds))
    print(f"overhead of distribution (distributed / baseline - 1): "
          f"{100 * (med['distributed'] / med['baseline'] - 1):+.1f}%")
    print(f"distributed against one process alone: "
          f"{100 * (med['distributed'] / med['alone'] - 1):+.1f}%")


if __name__ == "__main__":
    main()
