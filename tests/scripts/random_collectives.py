"""Random steps of collectives, checked against NumPy on every rank.

Each step draws, from a seed every rank shares, a few operations (allreduce
with every reduction, allgather, broadcast, alltoall, reducescatter, their
grouped forms) with random dtypes and shapes, some on the global set, some
on a process set of two ranks, some on one of the last two ranks; each rank
then submits its share in its own random order, asynchronously, and checks
every result against the same computation in NumPy. A wrong value, a lost
handle or a hang is a failure; so is an error at exit (the process's exit
status). Prints "OK <rank> <steps>" at the end.

Usage: mpirun -n N python random_collectives.py SEED STEPS (N >= 3)
"""

import random
import sys

import numpy as np
from mpi4py import MPI

import coordinator as hvd

SEED, STEPS = int(sys.argv[1]), int(sys.argv[2])
KINDS = ("allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
         "alltoall", "reducescatter", "grouped_reducescatter")
REDUCTIONS = (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product)
DTYPES = (np.float32, np.float64, np.int32, np.int64, np.float16, np.int8, np.uint8)

SIZE = MPI.COMM_WORLD.size
SETS = {"global": hvd.global_process_set, "pair": hvd.ProcessSet([0, 1]),
        "tail": hvd.ProcessSet([SIZE - 2, SIZE - 1])}
hvd.init(process_sets=[SETS["pair"], SETS["tail"]])
ME = hvd.rank()


def value(rng_seed, rank, shape, dtype):
    """Rank `rank`'s tensor: small values, so that sums and products stay
    exact in every dtype (products of at most SIZE factors of 1 or 2)."""
    rng = np.random.default_rng([rng_seed, rank])
    return rng.integers(1, 3, size=shape).astype(dtype)


def draw(rng, step, i):
    kind = rng.choice(KINDS)
    set_name = rng.choice(("global", "global", "pair", "tail"))
    members = SETS[set_name].ranks
    dtype = rng.choice(DTYPES)
    inner = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 2)))
    op = rng.choice(REDUCTIONS)
    if op is hvd.Average and np.dtype(dtype).kind != "f":
        op = hvd.Sum
    return dict(name=f"s{step}.{i}.{kind}", kind=kind, set=set_name, members=members,
                dtype=dtype, inner=inner, op=op, count=rng.randint(1, 3),
                rows={r: rng.randint(0, 4) for r in members},
                root=rng.choice(members), seed=rng.randrange(1 << 30),
                splits={r: [rng.randint(0, 3) for _ in members] for r in members})


def reduce(op, arrays, dtype):
    stack = np.stack(arrays)
    if op is hvd.Sum:
        return stack.sum(axis=0, dtype=dtype)
    if op is hvd.Average:
        return (stack.astype(np.float64).sum(axis=0) / len(arrays)).astype(dtype)
    if op is hvd.Min:
        return stack.min(axis=0)
    if op is hvd.Max:
        return stack.max(axis=0)
    return stack.prod(axis=0, dtype=dtype)


def submit(d):
    """Starts this rank's part of `d`; returns (handle, expected result)."""
    members, dtype, inner, ps = d["members"], d["dtype"], d["inner"], SETS[d["set"]]
    me_in = members.index(ME)
    kind, n = d["kind"], d["count"]
    if kind in ("allreduce", "grouped_allreduce"):
        shape = (d["rows"][members[0]] + 1,) + inner
        ts = [[value(d["seed"] + k, r, shape, dtype) for r in members] for k in range(n)]
        expected = [reduce(d["op"], t, dtype) for t in ts]
        mine = [t[me_in] for t in ts]
        if kind == "allreduce":
            return hvd.allreduce_async(mine[0], name=d["name"], op=d["op"],
                                       process_set=ps), expected[:1]
        return hvd.grouped_allreduce_async(mine, name=d["name"], op=d["op"],
                                           process_set=ps), expected
    if kind in ("allgather", "grouped_allgather"):
        ts = [[value(d["seed"] + k, r, (d["rows"][r],) + inner, dtype) for r in members]
              for k in range(n)]
        expected = [np.concatenate(t) for t in ts]
        mine = [t[me_in] for t in ts]
        if kind == "allgather":
            return hvd.allgather_async(mine[0], name=d["name"], process_set=ps), expected[:1]
        return hvd.grouped_allgather_async(mine, name=d["name"], process_set=ps), expected
    if kind == "broadcast":
        shape = (d["rows"][members[0]] + 1,) + inner
        root = value(d["seed"], d["root"], shape, dtype)
        mine = root if ME == d["root"] else np.zeros(shape, dtype)
        return hvd.broadcast_async(mine, root_rank=d["root"], name=d["name"],
                                   process_set=ps), [root]
    if kind == "alltoall":
        splits = d["splits"]
        sent = {r: value(d["seed"], r, (sum(splits[r]) + 1,) + inner, dtype) for r in members}
        pieces = []
        for r in members:
            start = sum(splits[r][:me_in])
            pieces.append(sent[r][start:start + splits[r][me_in]])
        expected = (np.concatenate(pieces), [splits[r][me_in] for r in members])
        return hvd.alltoall_async(sent[ME], splits=splits[ME], name=d["name"],
                                  process_set=ps), expected
    # reducescatter: rank i of the set gets its share of the rows
    rows = d["rows"][members[0]] + len(members)
    ts = [[value(d["seed"] + k, r, (rows,) + inner, dtype) for r in members] for k in range(n)]
    base, extra = divmod(rows, len(members))
    start = me_in * base + min(me_in, extra)
    count = base + (1 if me_in < extra else 0)
    expected = [reduce(d["op"], t, dtype)[start:start + count] for t in ts]
    mine = [t[me_in] for t in ts]
    if d["op"] not in (hvd.Sum, hvd.Average):
        d["op"] = hvd.Sum
        expected = [reduce(hvd.Sum, t, dtype)[start:start + count] for t in ts]
    if kind == "reducescatter":
        return hvd.reducescatter_async(mine[0], op=d["op"], name=d["name"],
                                       process_set=ps), expected[:1]
    return hvd.grouped_reducescatter_async(mine, op=d["op"], name=d["name"],
                                           process_set=ps), expected


def check(d, result, expected):
    if d["kind"] == "alltoall":
        output, received = result
        want, want_splits = expected
        assert list(received) == want_splits, (d["name"], list(received), want_splits)
        results, expected = [output], [want]
    else:
        results = result if isinstance(result, list) else [result]
    assert len(results) == len(expected), (d["name"], len(results), len(expected))
    for got, want in zip(results, expected):
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape, (
            d["name"], got.dtype, got.shape, want.dtype, want.shape)
        if d["op"] is hvd.Average and d["kind"] not in ("allgather", "grouped_allgather",
                                                         "broadcast", "alltoall"):
            # a division, or a multiplication by its inverse: last bits differ
            tol = 1e-3 if got.dtype == np.float16 else 1e-6
            assert np.allclose(got, want, rtol=tol, atol=0), (d["name"], got, want)
        else:
            assert np.array_equal(got, want), (d["name"], got, want)


for step in range(STEPS):
    shared = random.Random(SEED * 1_000_003 + step)
    drawn = [draw(shared, step, i) for i in range(shared.randint(1, 6))]
    mine = [d for d in drawn if ME in d["members"]]
    random.Random(SEED * 7919 + step * 31 + ME).shuffle(mine)
    pending = [(d,) + submit(d) for d in mine]
    for d, handle, expected in pending:
        check(d, hvd.synchronize(handle), expected)
hvd.barrier()
hvd.shutdown()
print("OK", ME, STEPS, flush=True)
