"""Ring, hierarchical and torus allreduce on two real hosts, beside the cost
model's prediction for the alpha and beta measured on the same link.

    python examples/multihost/bench.py [--repeats 9] [--json out.json]

Needs root: it makes hosta and hostb from Linux namespaces (netns.py),
joined by a veth link, and runs four jobs through coordrun on them:

1. ping-pong between one rank on each host (MPI over TCP on the veth link):
   alpha_inter (half the round trip of 8 bytes) and beta_inter (the slope of
   a least-squares fit over 1-64 MiB);
2. the same between two ranks on hosta (MPI over shared memory):
   alpha_intra and beta_intra;
3. and 4. 2 hosts x 2 ranks: allreduces of 64 KiB and 64 MiB of float32,
   - "model's algorithm": exactly what the model prices, in blocking
     point-to-point mpi4py calls (ring over all ranks; reduce in the host,
     ring across hosts, broadcast in the host; ring reduce-scatter in the
     host, ring allreduce across, ring allgather in the host), the three
     alternating in one job;
   - "coordinator": hvd.allreduce with no flag, --hierarchical-allreduce
     and --torus-allreduce (one job each; what a user gets, negotiation
     included).

The model is coordinator/cost_model.py with P=4, L=2 and the measured
alpha and beta. All four ranks share this machine's cores, and the "link"
is the kernel copying memory: see the README for what that does to the
figures.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SIZES = {"64 KiB": 64 << 10, "64 MiB": 64 << 20}
PING_SIZES = [8] + [1 << s for s in (20, 22, 24, 26)]
ALGORITHMS = ("ring", "hierarchical", "torus")


# ------------------------------------------------------------------ jobs

def _median(samples):
    return statistics.median(samples)


def job_pingpong(repeats):
    """Rank 0 and rank 1 bounce buffers; rank 0 prints {size: seconds one way}."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    other = 1 - comm.rank
    result = {}
    for size in PING_SIZES:
        buf = np.zeros(size, np.uint8)
        reps = repeats * (50 if size < 4096 else 1)
        samples = []
        for i in range(reps + 2):
            comm.Barrier()
            start = time.perf_counter()
            if comm.rank == 0:
                comm.Send(buf, other)
                comm.Recv(buf, other)
            else:
                comm.Recv(buf, other)
                comm.Send(buf, other)
            if i >= 2:
                samples.append((time.perf_counter() - start) / 2)
        result[size] = _median(samples)
    if comm.rank == 0:
        a, b = np.ones(16 << 20, np.float32), np.ones(16 << 20, np.float32)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            MPI.SUM.Reduce_local(a, b)
            samples.append(time.perf_counter() - start)
        result["reduce 64 MiB"] = _median(samples)
        print("RESULT " + json.dumps(result), flush=True)


def _ring_reduce_scatter(comm, chunks, scratch):
    """Ring reduce-scatter over `chunks` (P views of one buffer, in place):
    afterwards rank r holds the sum of chunk (r + 1) % P."""
    import numpy as np

    size, rank = comm.size, comm.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        send, recv = chunks[(rank - step) % size], chunks[(rank - step - 1) % size]
        incoming = scratch[:recv.size]
        comm.Sendrecv(send, right, recvbuf=incoming, source=left)
        np.add(recv, incoming, out=recv)


def _ring_allgather(comm, chunks):
    """Ring allgather of `chunks` where rank r starts with chunk (r + 1) % P."""
    size, rank = comm.size, comm.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        comm.Sendrecv(chunks[(rank + 1 - step) % size], right,
                      recvbuf=chunks[(rank - step) % size], source=left)


def _ring_allreduce(comm, buf, scratch):
    import numpy as np

    if comm.size == 1:
        return
    chunks = np.array_split(buf, comm.size)
    _ring_reduce_scatter(comm, chunks, scratch)
    _ring_allgather(comm, chunks)


def _mpi_paths(comm, local, cross):
    """The model's three algorithms, step by step, in blocking mpi4py calls
    on a float32 buffer (reductions in NumPy)."""
    import numpy as np

    scratch = {}

    def space(n):
        if scratch.get("n", -1) < n:
            scratch["n"], scratch["buf"] = n, np.empty(n, np.float32)
        return scratch["buf"]

    def ring(buf):  # flat, over all P ranks, hosts contiguous on the ring
        _ring_allreduce(comm, buf, space(buf.size // comm.size + 1))

    def hierarchical(buf):  # reduce in the host, ring across hosts, broadcast
        if local.rank == 0:
            incoming = space(buf.size)
            for source in range(1, local.size):
                local.Recv(incoming, source)
                np.add(buf, incoming, out=buf)
            _ring_allreduce(cross, buf, space(buf.size))
            for dest in range(1, local.size):
                local.Send(buf, dest)
        else:
            local.Send(buf, 0)
            local.Recv(buf, 0)

    def torus(buf):  # ring reduce-scatter in the host, ring across, ring allgather
        chunks = np.array_split(buf, local.size)
        if local.size > 1:
            _ring_reduce_scatter(local, chunks, space(buf.size // local.size + 1))
        mine = chunks[(local.rank + 1) % local.size]
        _ring_allreduce(cross, mine, space(mine.size // max(cross.size, 1) + 1))
        if local.size > 1:
            _ring_allgather(local, chunks)

    return {"ring": ring, "hierarchical": hierarchical, "torus": torus}


def job_paths(repeats):
    """The MPI data paths, alternating; rank 0 prints {algorithm: {size: s}}."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    cross = comm.Split(local.rank, comm.rank)
    paths = _mpi_paths(comm, local, cross)
    result = {name: {} for name in paths}
    for label, nbytes in SIZES.items():
        n = nbytes // 4
        pattern = (np.arange(n) % 1024).astype(np.float32)  # sums exact in any order
        expected = pattern * comm.size + sum(range(comm.size))
        reps = repeats * (20 if nbytes < (1 << 20) else 1)
        samples = {name: [] for name in paths}
        for i in range(reps + 1):
            for name, fn in paths.items():
                buf = pattern + comm.rank
                comm.Barrier()
                start = time.perf_counter()
                fn(buf)
                elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
                assert np.array_equal(buf, expected), name
                if i:
                    samples[name].append(elapsed)
        for name in paths:
            result[name][label] = _median(samples[name])
    if comm.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def job_coordinator(repeats):
    """hvd.allreduce with whatever algorithm the flags chose; rank 0 prints
    {size: seconds} (the slowest rank's time, median over repeats)."""
    import numpy as np

    import coordinator as hvd

    hvd.init()
    n_ranks = hvd.size()
    result = {}
    for label, nbytes in SIZES.items():
        n = nbytes // 4
        pattern = (np.arange(n) % 1024).astype(np.float32)  # sums exact in any order
        data = pattern + hvd.rank()
        expected = pattern * n_ranks + sum(range(n_ranks))
        reps = repeats * (20 if nbytes < (1 << 20) else 1)
        samples = []
        for i in range(reps + 2):
            hvd.barrier()
            start = time.perf_counter()
            out = hvd.allreduce(data, op=hvd.Sum, name=f"bench.{label}")
            elapsed = time.perf_counter() - start
            slowest = hvd.allreduce(np.array([elapsed]), op=hvd.Max, name="bench.t")[0]
            assert np.array_equal(out, expected)
            if i >= 2:
                samples.append(slowest)
        result[label] = _median(samples)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    hvd.shutdown()


JOBS = {"pingpong": job_pingpong, "paths": job_paths, "coordinator": job_coordinator}


# ---------------------------------------------------------------- driver

def _run(cluster, hosts, flags, job, repeats):
    """Runs `bench.py job ...` under coordrun on hosta; returns its RESULT."""
    env = {"PRTE_MCA_plm_ssh_agent": cluster.agent, "PYTHONPATH": ROOT}
    argv = ([os.path.join(os.path.dirname(sys.executable), "coordrun"), "-H", hosts]
            + flags + [sys.executable, os.path.abspath(__file__), "job", job, str(repeats)])
    out = cluster.run("hosta", argv, env=env, capture_output=True, text=True, timeout=900,
                      cwd=ROOT)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{job} on {hosts} failed:\n{out.stdout}\n{out.stderr}")


def fit(times):
    """alpha (s) and beta (bytes/s) from {size: one-way seconds}: alpha is the
    smallest message's time, beta the inverse slope of a least-squares line
    through the others."""
    points = sorted((int(size), t) for size, t in times.items() if size.isdigit())
    alpha = points[0][1]
    large = points[1:]
    mx = statistics.mean(s for s, _ in large)
    my = statistics.mean(t for _, t in large)
    slope = (sum((s - mx) * (t - my) for s, t in large)
             / sum((s - mx) ** 2 for s, _ in large))
    return alpha, 1 / slope


def predictions(link, host, ranks, local_size):
    sys.path.insert(0, ROOT)
    from coordinator import cost_model

    alpha_inter, beta_inter = link
    alpha_intra, beta_intra = host
    return {name: {label: fn(ranks, local_size, n, beta_inter, alpha_inter=alpha_inter,
                             alpha_intra=alpha_intra, beta_intra=beta_intra)
                   for label, n in SIZES.items()}
            for name, fn in cost_model.ALGORITHMS.items()}


def _load():
    return os.getloadavg()[0]


def measure(repeats):
    sys.path.insert(0, HERE)
    import netns

    load = [_load()]
    with tempfile.TemporaryDirectory(prefix="hosts-") as directory, \
            netns.Cluster(directory) as cluster:
        pings = _run(cluster, "hosta:1,hostb:1", [], "pingpong", repeats)
        link = fit(pings)
        host = fit(_run(cluster, "hosta:2", [], "pingpong", repeats))
        one_each = _run(cluster, "hosta:1,hostb:1", [], "paths", repeats)
        paths = _run(cluster, "hosta:2,hostb:2", [], "paths", repeats)
        flags = {"ring": [], "hierarchical": ["--hierarchical-allreduce"],
                 "torus": ["--torus-allreduce"]}
        ours = {name: _run(cluster, "hosta:2,hostb:2", flags[name], "coordinator", repeats)
                for name in ALGORITHMS}
    load.append(_load())
    return {"load": load, "cores": os.cpu_count(),
            "link": link, "host": host, "reduce_64mib": pings["reduce 64 MiB"],
            "paths": paths, "coordinator": ours, "model": predictions(link, host, 4, 2),
            "paths_2x1": one_each, "model_2x1": predictions(link, host, 2, 1)}


def report(r):
    (a_inter, b_inter), (a_intra, b_intra) = r["link"], r["host"]
    ms = 1e3
    lines = [f"{r['cores']} cores; load average {r['load'][0]:.1f} before, "
             f"{r['load'][1]:.1f} after",
             f"veth link (MPI over TCP, hosta-hostb): alpha {a_inter * 1e6:.1f} us, "
             f"beta {b_inter / 1e9:.2f} GB/s",
             f"inside a host (MPI over shared memory): alpha {a_intra * 1e6:.1f} us, "
             f"beta {b_intra / 1e9:.2f} GB/s",
             f"reducing 64 MiB of float32 (MPI_Reduce_local, one core): "
             f"{r['reduce_64mib'] * ms:.1f} ms", "",
             "2 hosts x 2 ranks, float32 Sum, median ms of the slowest rank "
             "(model: cost_model with these alpha and beta, P=4, L=2)", "",
             "| size | algorithm | model | model's algorithm, run | coordinator |",
             "|---|---|---:|---:|---:|"]
    for label in SIZES:
        for name in ALGORITHMS:
            lines.append(f"| {label} | {name} | {r['model'][name][label] * ms:.2f} | "
                         f"{r['paths'][name][label] * ms:.2f} | "
                         f"{r['coordinator'][name][label] * ms:.2f} |")
    lines += ["", "Control, 2 hosts x 1 rank (a core per rank; P=2, L=1, where the three "
              "algorithms are the same):", "",
              "| size | model | ring, run |", "|---|---:|---:|"]
    for label in SIZES:
        lines.append(f"| {label} | {r['model_2x1']['ring'][label] * ms:.2f} | "
                     f"{r['paths_2x1']['ring'][label] * ms:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        JOBS[argv[1]](int(argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9,
                        help="timed runs of each 64 MiB case (64 KiB and ping-pong: more)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = parser.parse_args(argv)
    results = measure(args.repeats)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
