"""How long gradient hooks wait for the interpreter lock while the
background thread waits for GPU work, on a simulated GPU.

    coordrun -np 1 python tests/scripts/gpu_hook_contention.py [--rounds 10]

A backward pass on a GPU calls each gradient's hook from autograd's device
thread, which must take the interpreter lock to run it; a background
thread that spins holds that lock. Here a hook-like thread sleeps GAP
seconds with the lock released (autograd running C++), then submits a small
device tensor, HOOKS times; the time past GAP until it runs again is its
wait for the lock (and for a core). In "busy" rounds a 16 MiB allreduce is
in flight first; in "idle" rounds the hooks' own small operations are.

The device is the fake CuPy of tests/gpu_fakes.py with a timed FakeNccl:
each NCCL call keeps its stream busy for 4.5 ms + bytes / 1.8 GB/s (NCCL
over sockets, as on the GPU machine), so the background thread waits for
events that fire later, as on a GPU. Rounds alternate the background
thread's two ways of waiting for a device: "poll" (sleep DEVICE_POLL
between looks, the default) and "spin" (as for MPI work: spin after
progress, then back off). Rank 0 prints, per case and policy, the medians
over rounds of the per-round median lock wait and of the time until every
hook had submitted, and the ratio spin/poll.
"""

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import gpu_fakes  # noqa: E402
import gpu_sim  # noqa: E402

LATENCY, BANDWIDTH = 4.5e-3, 1.8e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="per case and policy")
    parser.add_argument("--hooks", type=int, default=60)
    parser.add_argument("--gap", type=float, default=150e-6, help="seconds between hooks")
    args = parser.parse_args()

    from mpi4py import MPI

    from coordinator import gpu

    nccl = gpu_fakes.FakeNccl(MPI.COMM_WORLD.Dup(), LATENCY, BANDWIDTH)
    cp = gpu_fakes.fake_cupy(nccl, gpu_fakes.HostKernels(tempfile.mkdtemp()))
    gpu._modules["cupy"] = cp
    import coordinator as hvd

    hvd.init()
    big = gpu_fakes.FakeDeviceArray(np.ones(4 * 1024 * 1024, np.float32))
    small = [gpu_fakes.FakeDeviceArray(np.ones(1000, np.float32)) for _ in range(args.hooks)]

    def hooks(waits, handles):
        for i, tensor in enumerate(small):
            start = time.perf_counter()
            time.sleep(args.gap)
            waits.append(time.perf_counter() - start - args.gap)
            handles.append(hvd.allreduce_async(tensor, name=f"hook.{i}"))

    def one_round(case):
        waits, handles = [], []
        if case == "busy":
            handles.append(hvd.allreduce_async(big, name="big"))
        thread = threading.Thread(target=hooks, args=(waits, handles))
        start = time.perf_counter()
        thread.start()
        thread.join()
        burst = time.perf_counter() - start
        for h in handles:
            hvd.synchronize(h)
        return statistics.median(waits), burst

    results = {}
    for r in range(args.rounds + 1):  # the first round warms up (names get cached)
        for case in ("idle", "busy"):
            for policy in (("poll", "spin") if r % 2 else ("spin", "poll")):
                gpu_sim.use_waiting(policy)
                hvd.allreduce(np.ones(1), name="sync")
                wait, burst = one_round(case)
                if r:
                    results.setdefault((case, policy), []).append((wait, burst))
    gpu_sim.use_waiting("poll")
    if hvd.rank() == 0:
        print(f"{hvd.size()} rank(s), {args.hooks} hooks {args.gap * 1e6:.0f} us apart, "
              f"NCCL {LATENCY * 1e3} ms + bytes / {BANDWIDTH / 1e9} GB/s, {args.rounds} rounds")
        for case in ("idle", "busy"):
            med = {p: [statistics.median(v[i] for v in results[(case, p)]) for i in (0, 1)]
                   for p in ("poll", "spin")}
            print(f"{case}: lock wait per hook poll {med['poll'][0] * 1e6:.0f} us, spin "
                  f"{med['spin'][0] * 1e6:.0f} us; all hooks in: poll {med['poll'][1] * 1e3:.2f} "
                  f"ms, spin {med['spin'][1] * 1e3:.2f} ms; spin/poll "
                  f"{med['spin'][1] / med['poll'][1]:.2f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
