"""Random steps of collectives, checked against NumPy on every rank.

Each step draws, from a seed every rank shares, a few operations (allreduce
with every reduction, allgather, broadcast, alltoall, reducescatter, their
grouped forms) with random dtypes and shapes, some on the global set, some
on a process set of two ranks, some on one of the last two ranks (with
REUSE, a probability, some under names used step after step, as gradients
are, so that they are cached; the others under new names); each rank
then submits its share in its own random order, asynchronously, and checks
every result against the same computation in NumPy. A wrong value, a lost
handle or a hang is a failure; so is an error at exit (the process's exit
status). Prints "OK <rank> <steps>" at the end.

With BAD_INPUT (a probability), an operation may get bad input on one of
its members: a shape or dtype the others do not send (every member gets a
TensorMismatchError naming the tensor), or input that rank refuses (an
unsupported dtype, an invalid root, bad splits: a ValueError there, at once,
and on every other member a HorovodInternalError saying that rank rejected
it). The step's other operations, and the next steps, go on as if nothing
had happened.

With DYNAMIC_SETS=1 (and HOROVOD_DYNAMIC_PROCESS_SETS=1), steps also add
process sets of random ranks and remove them, while that step's operations
are in flight; later steps use the sets added. Some are added by their own
ranks alone (basics.add_process_set_of_members).

With SCALES (a probability), an allreduce or reducescatter may get a
prescale and a postscale factor (0.5, 2, 3), and integer tensors may be
averaged: integers are scaled in float64 and rounded toward zero, the
average dividing last (coordinator/fusion.py scale_inplace), float16 and
bfloat16 in float32; the expected result follows the same rule.

With THREADS=K, each rank's share of a step is dealt to K threads, which
submit and synchronize theirs at the same time (as a program with a torch
and a TensorFlow model in one process does), so the order of submission
differs from rank to rank and from run to run.

With BLOCKING=1 (and THREADS), the threads call the blocking variants
instead, each of which runs the coordinator's loop on its thread while it
waits; each thread then has the same operations, in the same order, on
every rank (else they would wait for each other), and only how the threads
interleave differs.

With STOP=RANK,STEP,K,RESUME that rank stops (SIGSTOP) after submitting K
of its operations of step STEP, and is continued by the others once each has
printed what stopped it, `RANK r: <ExceptionType>: <message>` (run with
short stall times), or RESUME seconds later at the latest (not after a time
alone: a loaded machine may run the others' stall checks seconds late, and
the stopped rank would then be back before they failed). Every rank stays
until the stopped rank has had its say too, and shuts down.

With KILL=RANK,STEP,K that rank kills itself (SIGKILL) after submitting K
of its operations of step STEP; each other rank prints what its step saw,
`RANK r: <ExceptionType>: <message>` (and leaves it in the file said.<r>
of KILL_MARKS, a directory, where given: the launcher may drop what a
process printed last as the job ends), and the job ends.

With FAKE_GPU=1 every tensor is a "CUDA" array of tests/gpu_fakes.py (host
memory behind `__cuda_array_interface__`), so the operations take the NCCL
backend's path (device fusion with the pack and unpack kernels compiled for
the host, staging where NCCL cannot go), with the fake's NCCL calls run as
MPI calls, which block until every member makes them: so the ranks must
queue the NCCL operations of every set in one order (on every set, as of
this commit; on the global set alone before, where three sets deadlocked
within 40 steps: negotiation.answered_in_rounds).

Usage: mpirun -n N python random_collectives.py SEED STEPS (N >= 3)
"""

import os
import random
import signal
import sys
import tempfile
import threading

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import peers  # noqa: E402

import coordinator as hvd  # noqa: E402
from coordinator import basics  # noqa: E402

SEED, STEPS = int(sys.argv[1]), int(sys.argv[2])
BAD_INPUT = float(os.environ.get("BAD_INPUT", "0"))
DYNAMIC_SETS = os.environ.get("DYNAMIC_SETS") == "1"
REUSE = float(os.environ.get("REUSE", "0"))
SCALES = float(os.environ.get("SCALES", "0"))
THREADS = int(os.environ.get("THREADS", "1"))
BLOCKING = os.environ.get("BLOCKING") == "1"
STOP = [float(x) for x in os.environ["STOP"].split(",")] if os.environ.get("STOP") else None
KILL = [int(x) for x in os.environ["KILL"].split(",")] if os.environ.get("KILL") else None
FAKE_GPU = os.environ.get("FAKE_GPU") == "1"
KINDS = ("allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
         "alltoall", "reducescatter", "grouped_reducescatter")
REDUCTIONS = (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product)
DTYPES = (np.float32, np.float64, np.int32, np.int64, np.float16, np.int8, np.uint8)

SIZE = MPI.COMM_WORLD.size
SETS = {"global": hvd.global_process_set, "pair": hvd.ProcessSet([0, 1]),
        "tail": hvd.ProcessSet([SIZE - 2, SIZE - 1])}
if FAKE_GPU:
    import gpu_fakes

    # FAKE_GPU_LATENCY=S: each NCCL call keeps its stream busy S seconds
    gpu_fakes.install_for_a_job(MPI.COMM_WORLD,
                                float(os.environ.get("FAKE_GPU_LATENCY", "0")) or None)
hvd.init(process_sets=[SETS["pair"], SETS["tail"]])
ME = hvd.rank()
if KILL:  # where the survivors say they have had their say
    MARKS = os.environ.get("KILL_MARKS") or hvd.broadcast_object(
        tempfile.mkdtemp(prefix="random-kill-") if ME == 0 else None, name="kill.marks")
if STOP:  # where the ranks leave marks for each other (the tests give a directory
    # they remove; by hand, one in /tmp), and whom to continue
    MARKS = os.environ.get("STOP_MARKS") or hvd.broadcast_object(
        tempfile.mkdtemp(prefix="random-stop-") if ME == 0 else None, name="stop.marks")
    PIDS = hvd.allgather_object(os.getpid(), name="stop.pids")


def to_device(tensor):
    """With FAKE_GPU, the tensor (or each of a list) as a "CUDA" array."""
    if not FAKE_GPU:
        return tensor
    if isinstance(tensor, list):
        return [to_device(t) for t in tensor]
    return gpu_fakes.FakeDeviceArray(np.ascontiguousarray(tensor))


def to_host(result):
    """A result (or each of a list) as a NumPy array."""
    if isinstance(result, (list, tuple)):
        return type(result)(to_host(r) for r in result)
    return result.get() if hasattr(result, "get") else result


def value(rng_seed, rank, shape, dtype):
    """Rank `rank`'s tensor: small values, so that sums and products stay
    exact in every dtype (products of at most SIZE factors of 1 or 2)."""
    rng = np.random.default_rng([rng_seed, rank])
    return rng.integers(1, 3, size=shape).astype(dtype)


def describe(rng):
    """A tensor's dtype, shape past the first dimension, reduction, group
    size, and (prescale, postscale) factors."""
    dtype = rng.choice(DTYPES)
    inner = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 2)))
    op = rng.choice(REDUCTIONS)
    scales = (1.0, 1.0)
    if SCALES and rng.random() < SCALES:
        # Product's factors stay small enough for int8 (4 ranks: 2 ** 4)
        pre = rng.choice((0.5, 1.0) if op is hvd.Product else (0.5, 1.0, 2.0))
        scales = (pre, rng.choice((0.5, 1.0, 2.0, 3.0)))
    elif op is hvd.Average and np.dtype(dtype).kind != "f":
        op = hvd.Sum
    return dtype, inner, op, rng.randint(1, 3), scales


def draw(rng, step, i):
    kind = rng.choice(KINDS)
    set_name = rng.choice(["global"] + sorted(SETS))
    members = SETS[set_name].ranks
    dtype, inner, op, count, scales = describe(rng)
    name = f"s{step}.{i}.{kind}"
    if rng.random() < REUSE:
        # A name used step after step, as a gradient's is (cached): its
        # description stays.
        name = f"kept.{set_name}.{kind}.{i}"
        dtype, inner, op, count, scales = describe(random.Random(name))
    bad = None
    if rng.random() < BAD_INPUT:
        bad = (rng.choice(("mismatch", "refuse")), rng.choice(members))
    return dict(name=name, index=i, kind=kind, set=set_name, members=members,
                dtype=dtype, inner=inner, op=op, count=count, scales=scales,
                rows={r: rng.randint(0, 4) for r in members},
                root=rng.choice(members), seed=rng.randrange(1 << 30),
                splits={r: [rng.randint(0, 3) for _ in members] for r in members}, bad=bad)


def scaled(array, factor, divisor=1):
    """array * factor / divisor by the core's rule: integers in float64,
    dividing last, rounded toward zero; float16 in float32."""
    if factor == 1.0 and divisor == 1:
        return array
    if array.dtype.kind != "f":
        return (array.astype(np.float64) * factor / divisor).astype(array.dtype)
    if array.dtype == np.float16:
        return (array.astype(np.float32) * np.float32(factor / divisor)).astype(np.float16)
    return array * array.dtype.type(factor / divisor)


def reduce(op, arrays, dtype, scales=(1.0, 1.0)):
    pre, post = scales
    stack = np.stack([scaled(a, pre) for a in arrays])
    if op is hvd.Average and np.dtype(dtype).kind != "f":
        return scaled(stack.sum(axis=0, dtype=dtype), post, len(arrays))
    if op is hvd.Average:
        if (pre, post) == (1.0, 1.0):
            return (stack.astype(np.float64).sum(axis=0) / len(arrays)).astype(dtype)
        return scaled(stack.sum(axis=0, dtype=dtype), post, len(arrays))
    if op is hvd.Sum:
        result = stack.sum(axis=0, dtype=dtype)
    elif op is hvd.Min:
        result = stack.min(axis=0)
    elif op is hvd.Max:
        result = stack.max(axis=0)
    else:
        result = stack.prod(axis=0, dtype=dtype)
    return scaled(result, post)


def spoil(d, tensor):
    """This rank's tensor, spoiled where `d` is bad on this rank."""
    how, rank = d["bad"] or (None, None)
    if rank != ME:
        return tensor
    if how == "refuse":
        if d["kind"] in ("broadcast", "alltoall"):
            return tensor  # refused by its root or splits instead (submit)
        return np.full(tensor.shape, "x")  # a dtype no collective takes
    if d["kind"] == "alltoall":
        other = np.float32 if tensor.dtype != np.float32 else np.float64
        return tensor.astype(other)
    return tensor.reshape(tensor.shape + (1,))  # a shape (or rank) the others do not send


class Done:
    """What a blocking call left: its result or its error."""

    def __init__(self, result=None, error=None):
        self.result, self.error = result, error


def begin(async_fn, *args, **kwargs):
    """Starts an operation; with BLOCKING, runs it to the end with the
    blocking variant (which runs the coordinator's loop on this thread)."""
    args = (to_device(args[0]),) + args[1:]
    if not BLOCKING:
        return async_fn(*args, **kwargs)
    blocking = getattr(hvd, async_fn.__name__[:-len("_async")])
    try:
        return Done(result=blocking(*args, **kwargs))
    except ValueError:
        raise  # refused here, at once, as the _async variant is
    except hvd.HorovodInternalError as exc:
        return Done(error=exc)


def result_of(handle):
    if not isinstance(handle, Done):
        return to_host(hvd.synchronize(handle))
    if handle.error is not None:
        raise handle.error
    return to_host(handle.result)


def submit(d):
    """Starts this rank's part of `d`; returns (handle, expected result), or
    (None, the ValueError) where this rank refuses its input."""
    try:
        return _submit(d)
    except ValueError as exc:
        return None, exc


def _submit(d):
    members, dtype, inner, ps = d["members"], d["dtype"], d["inner"], SETS[d["set"]]
    me_in = members.index(ME)
    kind, n = d["kind"], d["count"]
    if kind in ("allreduce", "grouped_allreduce"):
        shape = (d["rows"][members[0]] + 1,) + inner
        ts = [[value(d["seed"] + k, r, shape, dtype) for r in members] for k in range(n)]
        expected = [reduce(d["op"], t, dtype, d["scales"]) for t in ts]
        mine = [spoil(d, t[me_in]) for t in ts]
        scales = dict(prescale_factor=d["scales"][0], postscale_factor=d["scales"][1])
        if kind == "allreduce":
            return begin(hvd.allreduce_async, mine[0], name=d["name"], op=d["op"],
                                       process_set=ps, **scales), expected[:1]
        return begin(hvd.grouped_allreduce_async, mine, name=d["name"], op=d["op"],
                                           process_set=ps, **scales), expected
    if kind in ("allgather", "grouped_allgather"):
        ts = [[value(d["seed"] + k, r, (d["rows"][r],) + inner, dtype) for r in members]
              for k in range(n)]
        expected = [np.concatenate(t) for t in ts]
        mine = [spoil(d, t[me_in]) for t in ts]
        if kind == "allgather":
            return begin(hvd.allgather_async, mine[0], name=d["name"], process_set=ps), expected[:1]
        return begin(hvd.grouped_allgather_async, mine, name=d["name"], process_set=ps), expected
    if kind == "broadcast":
        shape = (d["rows"][members[0]] + 1,) + inner
        root = value(d["seed"], d["root"], shape, dtype)
        mine = spoil(d, root if ME == d["root"] else np.zeros(shape, dtype))
        root_rank = SIZE + 5 if d["bad"] == ("refuse", ME) else d["root"]
        return begin(hvd.broadcast_async, mine, root_rank=root_rank, name=d["name"],
                                   process_set=ps), [root]
    if kind == "alltoall":
        splits = d["splits"]
        sent = {r: value(d["seed"], r, (sum(splits[r]) + 1,) + inner, dtype) for r in members}
        pieces = []
        for r in members:
            start = sum(splits[r][:me_in])
            pieces.append(sent[r][start:start + splits[r][me_in]])
        expected = (np.concatenate(pieces), [splits[r][me_in] for r in members])
        my_splits = list(splits[ME])
        if d["bad"] == ("refuse", ME):
            my_splits[0] += sent[ME].shape[0] + 1  # more rows than it has
        return begin(hvd.alltoall_async, spoil(d, sent[ME]), splits=my_splits, name=d["name"],
                                  process_set=ps), expected
    # reducescatter: rank i of the set gets its share of the rows
    rows = d["rows"][members[0]] + len(members)
    ts = [[value(d["seed"] + k, r, (rows,) + inner, dtype) for r in members] for k in range(n)]
    base, extra = divmod(rows, len(members))
    start = me_in * base + min(me_in, extra)
    count = base + (1 if me_in < extra else 0)
    if d["op"] not in (hvd.Sum, hvd.Average):
        d["op"] = hvd.Sum
    expected = [reduce(d["op"], t, dtype, d["scales"])[start:start + count] for t in ts]
    mine = [spoil(d, t[me_in]) for t in ts]
    scales = dict(prescale_factor=d["scales"][0], postscale_factor=d["scales"][1])
    if kind == "reducescatter":
        return begin(hvd.reducescatter_async, mine[0], op=d["op"], name=d["name"],
                                       process_set=ps, **scales), expected[:1]
    return begin(hvd.grouped_reducescatter_async, mine, op=d["op"], name=d["name"],
                                           process_set=ps, **scales), expected


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
        if (d["op"] is hvd.Average and got.dtype.kind == "f"
                and d["kind"] not in ("allgather", "grouped_allgather", "broadcast",
                                      "alltoall")):
            # a division, or a multiplication by its inverse: last bits differ
            tol = 1e-3 if got.dtype == np.float16 else 1e-6
            assert np.allclose(got, want, rtol=tol, atol=0), (d["name"], got, want)
        else:
            assert np.array_equal(got, want), (d["name"], got, want)


def check_failed(d, handle, refused):
    """`d` had bad input on one member: every member fails, naming it."""
    how, rank = d["bad"]
    if how == "refuse" and rank == ME:
        assert handle is None and isinstance(refused, ValueError), (d["name"], handle, refused)
        return
    assert handle is not None, (d["name"], refused)
    try:
        result_of(handle)
    except (hvd.StallError, hvd.RankFailedError):
        raise  # not about the bad input: the job stops (STOP)
    except hvd.HorovodInternalError as exc:
        text = str(exc)
        if how == "mismatch":
            assert isinstance(exc, hvd.TensorMismatchError), (d["name"], text)
        else:
            assert f"rank {rank} rejected" in text, (d["name"], text)
        assert d["name"] in text, (d["name"], text)
    else:
        raise AssertionError(f"{d['name']}: bad input on rank {rank} ({how}), yet it ran")


def change_sets(rng, step, drawn):
    """Adds a set of random ranks, or removes one this step does not use
    (every rank, in the same order), while the step's operations run. Or
    the set's own ranks alone add it (basics.add_process_set_of_members,
    as ChainerMN's communicators over part of the job do): the others only
    note its ranks. Such a set is never removed (that needs every rank),
    and adding one whose ranks are a set's already gives that set."""
    used = {d["set"] for d in drawn}
    removable = sorted(n for n in SETS if n.startswith("dyn") and n not in used)
    if removable and rng.random() < 0.3:
        assert hvd.remove_process_set(SETS.pop(rng.choice(removable)))
    elif rng.random() < 0.3:
        ranks = sorted(rng.sample(range(SIZE), rng.randint(2, SIZE - 1)))
        by_members = rng.random() < 0.5
        if by_members and all(ps.ranks != ranks for n, ps in SETS.items() if n.startswith("dyn")):
            ps = hvd.ProcessSet(ranks)
            if ME in ranks:
                assert basics.add_process_set_of_members(ps) is ps
                assert ps.process_set_id is not None and ps.size() == len(ranks)
            SETS[f"own{step}"] = ps
        elif not by_members and all(ps.ranks != ranks for ps in SETS.values()):
            SETS[f"dyn{step}"] = hvd.add_process_set(ranks)


def stop_here(resume):
    """Stops this process now, until the others continue it (once they have
    failed: said_and_continue), or a child `resume` seconds later."""
    print(f"RANK {ME}: stopping", flush=True)
    peers.stop_self(resume)


def die_here():
    """This process dies now, as one killed by the machine (KILL)."""
    print(f"RANK {ME}: dying", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def said_and_continue(victim):
    """This rank has said what stopped it: once every rank but the stopped
    one has, continues it (each does: once is enough), then waits until it
    has had its say too."""
    peers.leave_mark(MARKS, f"said.{ME}")
    peers.marked(MARKS, [f"said.{r}" for r in range(SIZE) if r != victim], STOP[3] + 4)
    os.kill(PIDS[victim], signal.SIGCONT)
    peers.marked(MARKS, ["said.victim"], STOP[3] + 4)


def run_step(step):
    shared = random.Random(SEED * 1_000_003 + step)
    drawn = [draw(shared, step, i) for i in range(shared.randint(1, 6))]
    mine = [d for d in drawn if ME in d["members"]]
    random.Random(SEED * 7919 + step * 31 + ME).shuffle(mine)
    if THREADS > 1:
        run_in_threads(mine)
        if DYNAMIC_SETS:
            change_sets(shared, step, drawn)
        return
    pending = []
    for d in mine:
        if KILL and (ME, step, len(pending)) == tuple(KILL):
            die_here()
        if STOP and (ME, step, len(pending)) == tuple(int(x) for x in STOP[:3]):
            stop_here(STOP[3])
        pending.append((d,) + submit(d))
    if STOP and (ME, step) == tuple(int(x) for x in STOP[:2]) and STOP[2] >= len(pending):
        stop_here(STOP[3])
    if KILL and (ME, step) == tuple(KILL[:2]) and KILL[2] >= len(pending):
        die_here()
    if DYNAMIC_SETS:
        change_sets(shared, step, drawn)
    check_all(pending)


def check_all(pending):
    """Waits for and checks each (operation, handle, expected) of `pending`."""
    for d, handle, expected in pending:
        if d["bad"] is None:
            assert handle is not None, (d["name"], expected)
            check(d, result_of(handle), expected)
        else:
            check_failed(d, handle, expected)


def run_in_threads(mine):
    """Each of THREADS threads submits its share of `mine`, then checks it."""
    failures = []

    def work(share):
        try:
            check_all([(d,) + submit(d) for d in share])
        except BaseException as exc:  # noqa: B036 - reported on the main thread
            failures.append(exc)

    if BLOCKING:  # each thread the same operations everywhere, in draw order
        mine = sorted(mine, key=lambda d: d["index"])
        shares = [[d for d in mine if d["index"] % THREADS == k] for k in range(THREADS)]
    else:
        shares = [mine[k::THREADS] for k in range(THREADS)]
    threads = [threading.Thread(target=work, args=(share,)) for share in shares]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]


try:
    for step in range(STEPS):
        run_step(step)
    hvd.barrier()
except hvd.HorovodInternalError as exc:
    if KILL:  # what the survivor saw; the job ends once every survivor has said it
        peers.survivor_says(MARKS, ME, SIZE, KILL[0], exc)
        raise
    if not STOP:
        raise
    print(f"RANK {ME}: {type(exc).__name__}: {exc}", flush=True)
    if ME != int(STOP[0]):
        said_and_continue(int(STOP[0]))  # the stopped rank, once continued, has its say
    else:
        peers.leave_mark(MARKS, "said.victim")
    hvd.shutdown()
    sys.exit(0)
hvd.shutdown()
print("OK", ME, STEPS, flush=True)
