"""Uneven data with join(), at random, checked against NumPy on every rank.

In each of several rounds every rank runs its own random number of steps
(as ranks with different amounts of data do) and then joins. A step is a few
allreduces and grouped allreduces (Sum or Average) of random dtypes and
shapes, drawn from a seed every rank shares and submitted in each rank's
own random order, some with names used in earlier steps (cached) and some
new; a rank may submit its last step and join at once, waiting for that
step's results after join() returns. A rank that has joined takes part
with zeros, and Average divides by the whole job, as in Horovod: so step
s's result is the sum over the ranks still running at step s. join()
returns the same last rank everywhere.
Prints "OK <rank> <rounds>" at the end.

With FAKE_GPU=1 every tensor is a "CUDA" array of the fake CuPy
(tests/gpu_fakes.py), so the NCCL backend's device fusion and its zero
stand-ins for joined ranks run (FAKE_GPU_LATENCY=S keeps the fake's
streams busy S seconds per NCCL call). With SETS=1 some operations go to
two process sets, ranks [0, 1] and the last two, where a joined member
takes part with zeros as in the global set and Average divides by the
set's size. With DYNAMIC_SETS=1 too (and HOROVOD_DYNAMIC_PROCESS_SETS=1),
every round ends by adding a set of random ranks or removing one added
earlier, and the next rounds draw from the sets there are then.

With KILL=RANK,ROUND,STEP that rank kills itself (SIGKILL) as round ROUND's
step STEP begins (just before its join, where it has fewer steps); each
other rank prints what it saw, `RANK r: <ExceptionType>: <message>` (and
leaves it in the file said.<r> of KILL_MARKS, a directory, where given: the
launcher may drop what a process printed last as the job ends), and the job
ends.

Usage: mpirun -n N python random_join.py SEED ROUNDS
"""

import os
import random
import signal
import sys

import numpy as np

import coordinator as hvd

SEED, ROUNDS = int(sys.argv[1]), int(sys.argv[2])
DTYPES = (np.float32, np.float64, np.int32, np.int64, np.float16)
FAKE_GPU = os.environ.get("FAKE_GPU") == "1"
USE_SETS = os.environ.get("SETS") == "1"
DYNAMIC_SETS = USE_SETS and os.environ.get("DYNAMIC_SETS") == "1"
KILL = [int(x) for x in os.environ["KILL"].split(",")] if os.environ.get("KILL") else None

if FAKE_GPU:
    from mpi4py import MPI

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import gpu_fakes

    # FAKE_GPU_LATENCY=S: each NCCL call keeps its stream busy S seconds
    gpu_fakes.install_for_a_job(MPI.COMM_WORLD,
                                float(os.environ.get("FAKE_GPU_LATENCY", "0")) or None)
if USE_SETS:
    from mpi4py import MPI

    _size = MPI.COMM_WORLD.size
    SETS = {"global": hvd.global_process_set, "pair": hvd.ProcessSet([0, 1]),
            "tail": hvd.ProcessSet([_size - 2, _size - 1])}
    hvd.init(process_sets=[SETS["pair"], SETS["tail"]])
else:
    SETS = {"global": hvd.global_process_set}
    hvd.init()
ME, SIZE = hvd.rank(), hvd.size()
if KILL:  # where the survivors say they have had their say
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import peers

    MARKS = os.environ.get("KILL_MARKS") or hvd.broadcast_object(
        tempfile.mkdtemp(prefix="random-kill-") if ME == 0 else None, name="kill.marks")


def members(d):
    return SETS[d["set"]].ranks or list(range(SIZE))


def value(seed, rank, shape, dtype):
    rng = np.random.default_rng([seed, rank])
    return rng.integers(1, 4, size=shape).astype(dtype)


def draw(rng, rnd, step, i):
    kind = rng.choice(("allreduce", "allreduce", "grouped_allreduce"))
    dtype = rng.choice(DTYPES)
    op = rng.choice((hvd.Sum, hvd.Average)) if np.dtype(dtype).kind == "f" else hvd.Sum
    # Reused names (cached after their first step) and fresh ones; a name's
    # dtype, shape and op stay the same for the whole run.
    fresh = rng.random() < 0.3
    name = f"r{rnd}.s{step}.{i}" if fresh else f"kept.{i}.{kind}"
    shape_rng = random.Random(f"{name}.{SEED}" if fresh else i * 31 + len(kind))
    if not fresh:
        dtype = DTYPES[shape_rng.randrange(len(DTYPES))]
        op = hvd.Sum if np.dtype(dtype).kind != "f" or shape_rng.random() < 0.5 else hvd.Average
    shape = tuple(shape_rng.randint(1, 4) for _ in range(shape_rng.randint(0, 2)))
    if DYNAMIC_SETS:
        pset = rng.choice(["global", "global"] + sorted(n for n in SETS if n != "global"))
    else:
        pset = rng.choice(("global", "global", "pair", "tail")) if USE_SETS else "global"
    return dict(name=name, kind=kind, dtype=dtype, op=op, shape=shape, set=pset,
                count=1 + (i % 2 if kind == "grouped_allreduce" else 0),
                seed=rng.randrange(1 << 30))


def submit(d, running):
    """This rank's part of `d`, and the result expected: the sum over the
    set's ranks still running (Average: divided by every rank of the set)."""
    tensors, expected = [], []
    running = [r for r in running if r in members(d)]
    for k in range(d["count"]):
        per_rank = {r: value(d["seed"] + k, r, d["shape"], d["dtype"]) for r in running}
        total = sum(per_rank[r].astype(np.float64) for r in running)
        if d["op"] is hvd.Average:
            total = total / len(members(d))
        tensors.append(gpu_fakes.FakeDeviceArray(per_rank[ME]) if FAKE_GPU else per_rank[ME])
        expected.append(np.asarray(total).astype(d["dtype"]))
    pset = SETS[d["set"]]
    if d["kind"] == "allreduce":
        return hvd.allreduce_async(tensors[0], name=d["name"], op=d["op"],
                                   process_set=pset), expected
    return hvd.grouped_allreduce_async(tensors, name=d["name"], op=d["op"],
                                       process_set=pset), expected


def check(d, result, expected):
    results = result if isinstance(result, list) else [result]
    assert len(results) == len(expected), (d["name"], results, expected)
    for got, want in zip(results, expected):
        got = got.get() if hasattr(got, "get") else np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape, (
            d["name"], got.dtype, got.shape, want.dtype, want.shape)
        tol = 2e-3 if got.dtype == np.float16 else 1e-6
        assert np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                           atol=0), (d["name"], got, want)


def die_at(rnd, step):
    """Where KILL names this rank, round and step, this process dies now."""
    if KILL and (ME, rnd) == tuple(KILL[:2]) and step >= KILL[2]:
        print(f"RANK {ME}: dying", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def run_round(rnd):
    shared = random.Random(SEED * 1_000_003 + rnd)
    steps = {r: shared.randint(0, 6) for r in range(SIZE)}
    defers = {r: random.Random(SEED + rnd * 7 + r).random() < 0.5 for r in range(SIZE)}
    last_to_join = {r for r in steps if steps[r] == max(steps.values())}
    if any(defers[r] for r in last_to_join):
        last_to_join = set(range(SIZE))  # (its join may come before the others')
    deferred = []  # a last step whose results are waited for after join()
    for step in range(steps[ME]):
        die_at(rnd, step)
        running = [r for r in range(SIZE) if steps[r] > step]
        step_rng = random.Random(SEED * 7919 + rnd * 101 + step)
        drawn = [draw(step_rng, rnd, step, i) for i in range(step_rng.randint(1, 4))]
        random.Random(SEED + rnd * 13 + step * 17 + ME).shuffle(drawn)
        pending = [(d,) + submit(d, running) for d in drawn if ME in members(d)]
        if step == steps[ME] - 1 and defers[ME]:
            deferred = pending
            break
        for d, handle, expected in pending:
            check(d, hvd.synchronize(handle), expected)
    die_at(rnd, KILL[2] if KILL else 0)  # (fewer steps than KILL's: at the join)
    last = hvd.join(0 if FAKE_GPU else -1)
    for d, handle, expected in deferred:
        check(d, hvd.synchronize(handle), expected)
    # A rank's last step on the global set needs every other rank's join,
    # so the rank with the most steps joins last; with sets it may need
    # only some of them, and a rank that ran out of steps earlier may still
    # join after it.
    assert last in (last_to_join if not USE_SETS else range(SIZE)), (rnd, last, steps)
    everyone = hvd.allgather(np.array([last], np.int64), name=f"last.{rnd}")
    assert (everyone == last).all(), (rnd, everyone)
    if DYNAMIC_SETS:
        change_sets(shared, rnd)


def change_sets(rng, rnd):
    """Adds a set of random ranks, or removes one added earlier (every
    rank, in the same order)."""
    removable = sorted(n for n in SETS if n.startswith("dyn"))
    if removable and rng.random() < 0.4:
        assert hvd.remove_process_set(SETS.pop(rng.choice(removable)))
    elif rng.random() < 0.7:
        ranks = sorted(rng.sample(range(SIZE), rng.randint(2, SIZE - 1)))
        if all(ps.ranks != ranks for ps in SETS.values()):
            SETS[f"dyn{rnd}"] = hvd.add_process_set(ranks)


try:
    for rnd in range(ROUNDS):
        run_round(rnd)
except hvd.HorovodInternalError as exc:
    if KILL:  # what the survivor saw; the job ends once every survivor has said it
        peers.survivor_says(MARKS, ME, SIZE, KILL[0], exc)
    raise
hvd.shutdown()
print("OK", ME, ROUNDS, flush=True)
