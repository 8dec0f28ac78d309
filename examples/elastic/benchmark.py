"""The two elastic targets, measured with train_digits_elastic.py.

    python examples/elastic/benchmark.py overhead [--runs 7] [--np 2]
    python examples/elastic/benchmark.py recovery [--runs 5]

overhead: the job with no elastic event against the same job without
elastic, in alternating runs (the order swapped every other run, so the
machine's background load hits both alike). Baseline: `coordrun -np N
train_digits_elastic.py --no-elastic` (no state, no commits). Elastic:
`coordrun -np N --min-np N -H ...` (ULFM, the driver and its gRPC agent in
every rank, a TorchState committed every --batches-per-commit batches and a
check for host changes at each commit). Each run reports rank 0's mean time
per step after the first epoch, commits included; the script prints the
median over runs of each and their ratio.

recovery: `coordrun -np 3 --min-np 2` with a discovery script naming three
hosts of this machine; rank 1 is SIGKILLed at step 20; the time from the
kill to the first completed step of the shrunk job (rank 0's step lines),
per run, and their median and maximum.
"""

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "train_digits_elastic.py")


def environment():
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", "")})
    return env


def coordrun(flags, script_args, timeout=600):
    cmd = [sys.executable, "-m", "coordinator.run"] + flags + [sys.executable, SCRIPT] + \
        script_args
    out = subprocess.run(cmd, env=environment(), capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout


def mean_step(stdout):
    """Rank 0's mean time per step after the first epoch, commits included."""
    return float(re.search(r"mean step ([\d.]+) ms", stdout).group(1))


def overhead(args):
    hosts = ",".join(f"{h}:1" for h in local_hosts()[:args.np])
    configs = {
        "baseline": (["-np", str(args.np)], ["--no-elastic"]),
        "elastic": (["-np", str(args.np), "--min-np", str(args.np), "-H", hosts],
                    ["--batches-per-commit", str(args.batches_per_commit)]),
    }
    if args.ulfm:  # where the cost comes from: ULFM alone, no state, no driver
        configs["ulfm only"] = (["-np", str(args.np), "--mpi-args=--with-ft ulfm"],
                                ["--no-elastic"])
    common = ["--epochs", str(args.epochs)]
    results = {name: [] for name in configs}
    for run in range(args.runs):
        order = list(configs) if run % 2 == 0 else list(reversed(list(configs)))
        for name in order:
            flags, extra = configs[name]
            results[name].append(mean_step(coordrun(flags, common + extra)))
        print(f"run {run + 1}: " + "  ".join(f"{n} {results[n][-1]:.3f} ms" for n in configs),
              flush=True)
    base = statistics.median(results["baseline"])
    elastic = statistics.median(results["elastic"])
    print(f"mean step, median over {args.runs} runs: baseline {base:.3f} ms, elastic "
          f"{elastic:.3f} ms, elastic/baseline {elastic / base:.4f}")
    ratios = [e / b for e, b in zip(results["elastic"], results["baseline"])]
    print(f"per-run ratios: {', '.join(f'{r:.3f}' for r in ratios)}; median "
          f"{statistics.median(ratios):.4f}")


def local_hosts():
    return ["localhost", "127.0.0.1", socket.gethostname()]


def recovery(args):
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "hosts.sh")
        with open(script, "w") as f:
            f.write("#!/bin/sh\n" + "".join(f"echo {h}:1\n" for h in local_hosts()))
        os.chmod(script, 0o755)
        seconds = []
        for run in range(args.runs):
            out = coordrun(["-np", "3", "--min-np", "2", "--host-discovery-script", script],
                           ["--epochs", "2", "--log-steps", "--kill-at", "20:1"])
            killed = float(re.search(r"^killing .* t=([\d.]+)", out, re.MULTILINE).group(1))
            after = [float(t) for t in re.findall(r"^step \d+ size 2 t=([\d.]+)", out,
                                                  re.MULTILINE) if float(t) > killed]
            seconds.append(min(after) - killed)
            print(f"run {run + 1}: SIGKILL to the first step at np=2: {seconds[-1]:.3f} s",
                  flush=True)
    print(f"median {statistics.median(seconds):.3f} s, max {max(seconds):.3f} s over "
          f"{args.runs} runs")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--runs", type=int, default=7)
    o.add_argument("--np", type=int, default=2)
    o.add_argument("--epochs", type=int, default=4)
    o.add_argument("--batches-per-commit", type=int, default=10)
    o.add_argument("--ulfm", action="store_true",
                   help="also run the baseline under mpirun --with-ft ulfm")
    r = sub.add_parser("recovery")
    r.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    overhead(args) if args.what == "overhead" else recovery(args)


if __name__ == "__main__":
    main()
