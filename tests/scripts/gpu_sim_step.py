"""A data-parallel training step on a simulated GPU (tests/gpu_sim.py): the
coordinator against a DDP-style reference and against no communication,
alternating in one run.

    coordrun -np 2 python tests/scripts/gpu_sim_step.py [--rounds 8]

The model is ResNet-50's 161 gradients (coordinator.bench.resnet50_shapes),
or with `--model resnet18` ResNet-18's 62. Device time: the forward pass
FORWARD ms and the backward BACKWARD ms spread evenly over the layers
(TIMES, per model), the optimizer OPTIMIZER ms, all on the compute
stream; NCCL over sockets (4.5 ms + bytes / 1.8 GB/s). Host time: launching
a layer costs LAUNCH us with the interpreter lock released (C++), as
autograd's does; the backward's gradient hooks run in a thread of their own
(autograd's device thread) while the main thread waits, lock released.

- ours: each hook submits its gradient (`allreduce_async`, Average); the
  step then synchronizes every handle, as DistributedOptimizer.step does.
- ddp: DDP's reducer: gradients go into buckets in the order they arrive
  (the first bucket capped at 1 MiB, the others at 25 MiB); a full bucket is
  one NCCL call on a communication stream that waits for the compute
  stream; the optimizer waits for the last call. Its hooks do a list
  append in Python where DDP's are C++: a little slower than DDP.
- local: no communication.

"ours-async" is ours with the handles completed once their work is queued
(HOROVOD_ENABLE_ASYNC_COMPLETION); `--completion sync` or `async` runs only
one of the two. With `--flush`, "ours-flush" is ours telling the core after
the last hook that no more gradients are coming (coordinator.collectives.
flush), "ours" without it, and "ours-opt" what DistributedOptimizer does:
the flush, and every gradient submitted in stream order (collectives.
in_stream_order: its handle completes once queued). Rank 0 prints each
implementation's median step and the median of the per-round ratios to ddp.
"""

import argparse
import ctypes
import os
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import gpu_sim  # noqa: E402

# Seconds of forward, backward and optimizer per step, batch 32, on the shared H100.
TIMES = {"resnet50": (12e-3, 26e-3, 2e-3), "resnet18": (5e-3, 11e-3, 1e-3)}
LAUNCH = 40e-6
FIRST_BUCKET, BUCKET = 1 << 20, 25 << 20


def _precise_sleep():
    """A sleep without the interpreter lock and without Linux's 50 us timer
    slack (which would make every LAUNCH 50 us longer)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK: 1 ns for this thread
    return lambda seconds: libc.usleep(int(seconds * 1e6))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--completion", choices=["sync", "async", "both"], default="both")
    parser.add_argument("--model", choices=sorted(TIMES), default="resnet50")
    parser.add_argument("--flush", action="store_true")
    args = parser.parse_args()

    from mpi4py import MPI

    from coordinator import gpu
    from coordinator import bench
    from coordinator.collectives import flush as no_more_coming
    from coordinator.collectives import in_stream_order

    world = MPI.COMM_WORLD
    cp, nccl = gpu_sim.sim_cupy(world.size, world.rank)
    gpu._modules["cupy"] = cp
    import coordinator as hvd

    hvd.init()
    shapes = getattr(bench, f"{args.model}_shapes")()
    FORWARD, BACKWARD, OPTIMIZER = TIMES[args.model]
    grads = [gpu_sim.device_array(s) for s in shapes]
    layers = len(grads)
    comm_stream = cp.cuda.Stream(non_blocking=True)
    sleep = _precise_sleep()

    def forward():
        for _ in range(layers):
            sleep(LAUNCH / 2)
            gpu_sim.compute(FORWARD / layers)

    def backward(hook):
        """Autograd's device thread: launch each layer's backward, then run
        its gradient's hook; the main thread waits with the lock released."""
        def engine():
            nap = _precise_sleep()  # the timer slack is per thread
            for i in reversed(range(layers)):
                nap(LAUNCH)
                gpu_sim.compute(BACKWARD / layers)
                hook(i)
        thread = threading.Thread(target=engine)
        thread.start()
        thread.join()

    def optimizer_and_sync():
        gpu_sim.compute(OPTIMIZER)
        gpu_sim.wait_device()

    def step_ours(flush=False, ordered=False):
        handles = {}

        def hook(i):
            if ordered:
                with in_stream_order():
                    handles[i] = hvd.allreduce_async(grads[i], name=f"grad.{i}")
            else:
                handles[i] = hvd.allreduce_async(grads[i], name=f"grad.{i}")
            if flush and len(handles) == layers:
                no_more_coming()
        forward()
        backward(hook)
        for h in handles.values():
            hvd.synchronize(h)
        optimizer_and_sync()

    def step_ddp():
        bucket, state = [], {"cap": FIRST_BUCKET, "bytes": 0}

        def flush():
            event = cp.cuda.Event()
            event.record(gpu_sim.current_stream())
            comm_stream.wait_event(event)
            with comm_stream:
                nccl.called("allReduce", sum(grads[i].size for i in bucket), nccl.NCCL_FLOAT32)
            bucket.clear()
            state["bytes"] = 0
            state["cap"] = BUCKET

        def hook(i):
            bucket.append(i)
            state["bytes"] += grads[i].nbytes
            if state["bytes"] >= state["cap"]:
                flush()
        forward()
        backward(hook)
        if bucket:
            flush()
        done = cp.cuda.Event()
        done.record(comm_stream)
        gpu_sim.current_stream().wait_event(done)
        optimizer_and_sync()

    def step_local():
        forward()
        backward(lambda i: None)
        optimizer_and_sync()

    steps = {"ours": step_ours, "ours-async": step_ours, "ours-flush": lambda: step_ours(True),
             "ours-opt": lambda: step_ours(True, ordered=True), "ddp": step_ddp,
             "local": step_local}
    names = ["ddp", "local"] + {"sync": ["ours"], "async": ["ours-async"],
                                "both": ["ours", "ours-async"]}[args.completion]
    if args.flush:
        names += ["ours-flush", "ours-opt"]

    def timed(name):
        gpu_sim.complete_early(name == "ours-async")
        world.Barrier()
        gpu_sim.wait_device()
        start = time.perf_counter()
        steps[name]()
        return time.perf_counter() - start

    for name in names * 2:  # warm-up: names cached, lanes open
        timed(name)
    times = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(timed(name))
    slow = np.array([times[n] for n in names])
    world.Allreduce(MPI.IN_PLACE, slow, op=MPI.MAX)  # a step is its slowest rank's
    if world.rank == 0:
        print(f"simulated step, {world.size} ranks, {args.model}'s {layers} gradients, forward "
              f"{FORWARD * 1e3:.0f} ms, backward {BACKWARD * 1e3:.0f} ms, optimizer "
              f"{OPTIMIZER * 1e3:.0f} ms, NCCL {gpu_sim.NCCL_LATENCY * 1e3} ms + bytes / "
              f"{gpu_sim.NCCL_BANDWIDTH / 1e9} GB/s, {args.rounds} rounds")
        ddp = slow[names.index("ddp")]
        for name, row in zip(names, slow):
            ratio = statistics.median(row / ddp)
            print(f"  {name:9s} median step {statistics.median(row) * 1e3:7.2f} ms, "
                  f"ratio to ddp {ratio:.3f}")
    gpu_sim.complete_early(False)
    hvd.shutdown()


if __name__ == "__main__":
    main()
