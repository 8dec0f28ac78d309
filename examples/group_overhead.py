"""The core's cost for one grouped allreduce of a small model's gradients,
against the floor: one concatenation, one MPI_Allreduce, one division.

    coordrun -np 2 python examples/group_overhead.py [--calls 500] [--rounds 8]
    python examples/group_overhead.py --alone   # np=1: the core's Python alone

The tensors are the eight gradients of examples/tensorflow/keras_digits.py's
CNN (53 K float32). Rounds alternate the two, each rank timing `--calls`
calls per round after a barrier; rank 0 prints the medians and the ratio per
round. No framework is imported (README, Performance, "The Keras step").
"""

import argparse
import time

import numpy as np

import coordinator as hvd

SHAPES = [(3, 3, 1, 32), (32,), (3, 3, 32, 64), (64,), (256, 128), (128,), (128, 10), (10,)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500, help="per round")
    parser.add_argument("--rounds", type=int, default=8, help="the first is warm-up")
    parser.add_argument("--alone", action="store_true",
                        help="time the core only (e.g. one process: no MPI floor to compare)")
    args = parser.parse_args()
    hvd.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(hvd.rank())
    grads = [rng.random(shape, dtype=np.float32) for shape in SHAPES]

    def core():
        return hvd.grouped_allreduce(grads, op=hvd.Average, name="group_overhead")

    def floor():
        flat = np.concatenate([g.reshape(-1) for g in grads])
        comm.Allreduce(MPI.IN_PLACE, flat, MPI.SUM)
        flat /= comm.size
        out, at = [], 0
        for g in grads:
            out.append(flat[at:at + g.size].reshape(g.shape))
            at += g.size
        return out

    for ours, floors in zip(core(), floor()):  # the same result
        np.testing.assert_allclose(ours, floors, rtol=1e-6)
    cases = [("core", core)] if args.alone else [("core", core), ("floor", floor)]
    medians = {name: [] for name, _ in cases}
    for r in range(args.rounds):
        for name, fn in (cases if r % 2 == 0 else cases[::-1]):
            comm.Barrier()
            times = []
            for _ in range(args.calls):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            if r or args.rounds == 1:
                medians[name].append(np.median(times))
    if hvd.rank() == 0:
        core_us = np.array(medians["core"]) * 1e6
        ranks = f"{hvd.size()} rank" + ("s" if hvd.size() > 1 else "")
        line = f"{ranks}, {len(SHAPES)} tensors: core {np.median(core_us):.0f} us"
        if not args.alone:
            floor_us = np.array(medians["floor"]) * 1e6
            ratios = core_us / floor_us
            line += (f"  floor {np.median(floor_us):.0f} us  ratio {np.median(ratios):.2f}"
                     f"  (per round {' '.join(f'{x:.2f}' for x in ratios)})")
        print(line, flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
