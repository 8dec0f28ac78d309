"""Random steps of frontends.chainer (ChainerMN 7.8.1's API), checked against
NumPy and single-process Chainer on every rank.

The communicators, made once at the start on every rank: the whole job's
'naive' (create_communicator), NaiveCommunicator(COMM_WORLD) made directly,
the whole job split with keys that reverse the ranks (comm.split), a
'naive' over an mpi4py COMM_WORLD.Split that reverses them too (so a
communicator's rank order differs from the coordinator's), and groups: a
split of the job by random colors and keys, and communicators over mpi4py
sub-communicators of random groups (each rank wraps its own group's, all at
once). Now and then a step makes a fresh random split of any of them (a
split of a split where that one is grouped), and finalizes it after its
operations.

Each step draws, from a seed every rank shares, a few operations, each on
one of those communicators (on a grouped one, every group runs it at once
on its own members), with dtypes ChainerMN's array methods take (int32,
int64, float16, float32, float64), shapes that may be 0-d, empty or large
(300001 elements) and, where ChainerMN allows it, differ between ranks, and
inputs that are C-contiguous, strided views, Fortran-ordered or read-only:

- arrays: allreduce, bcast (the root gets its own array back), gather,
  allgather, scatter (a tuple, or an array split along its first axis),
  alltoall (a tuple, or an array's rows), send/recv of arrays and tuples
  (a random sequence of messages between pairs, with tags; a list is sent
  as a tuple);
- objects: send_obj/recv_obj (two messages received in the opposite order of
  their tags, a wildcard tag, a status), bcast_obj (small max_buf_len too),
  gather_obj, allreduce_obj (numbers, arrays, lists concatenated in rank
  order);
- models: bcast_data / broadcast_data (every initialised parameter takes
  rank 0's values; uninitialised ones stay so), multi_node_mean_grad or the
  deprecated allreduce_grad (the mean; with zero_fill a gradient that is
  None on some or all ranks takes part as zeros; without it, one None on
  every rank stays None), in float16/32/64, 0-d parameters included;
- create_multi_node_optimizer (plain or double buffering) on a small chain,
  equal to single-process full-batch training (update 1 broadcasts rank 0's
  parameters; with double buffering each later update applies the previous
  iteration's mean gradient);
- scatter_dataset and scatter_index (shuffle or not, any root,
  force_equal_length or not) against ChainerMN's ranges: equal length
  ceil(n / size) from n * i // size, or the first n % size ranks one more;
- chainermn.functions: allgather, alltoall, bcast, gather, scatter, send and
  recv, forward values and the gradients backward sends back (allgather's
  of a 0-d input too: its summed gradient was a NumPy scalar, which Chainer
  refused, as in ChainerMN 7.8.1);
- with BAD (a probability, default 0.1), a call ChainerMN refuses, made
  alike on every rank (wrong lengths, tuples, unsupported or mismatched
  dtypes, a finalized communicator): the error on every rank, and the
  communicator still works after.

Also once at the start: the GPU communicator names refuse to run on CPU
with a RuntimeError, an unknown name and allreduce_grad_dtype on 'naive'
with a ValueError; batched_copy is True from create_communicator, False
for a class made directly; every communicator's topology is one host's.
TRACE=1 writes each operation to stderr before it runs.

Usage: mpirun -n N python random_chainer.py SEED STEPS (N >= 2).
Prints "OK <rank> <steps>" at the end.
"""

import os
import random
import sys
import traceback
import warnings

import numpy as np
from mpi4py import MPI

import frontends.chainer as chainermn  # noqa: I001 (first: makes Chainer importable)

import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402
from frontends.chainer.communicators.naive_communicator import NaiveCommunicator  # noqa: E402

SEED, STEPS = int(sys.argv[1]), int(sys.argv[2])
BAD = float(os.environ.get("BAD", "0.1"))
TRACE = bool(os.environ.get("TRACE"))
WORLD_MPI = MPI.COMM_WORLD
SIZE, ME = WORLD_MPI.size, WORLD_MPI.rank
DTYPES = (np.int32, np.int64, np.float16, np.float32, np.float64)
FLOATS = (np.float16, np.float32, np.float64)
SHAPES = ((), (0,), (1,), (3,), (2, 3), (0, 2), (2, 0), (1, 1, 2))
FUNCS = chainermn.functions


def value(seed, who, shape, dtype):
    """Small integers, so sums (float16 too) are exact."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, who])
    return rng.integers(-3, 4, size=shape).astype(dtype)


def laid(arr, how):
    """`arr` as the caller hands it: C-contiguous, a strided view into a
    larger array, Fortran-ordered, or read-only (ChainerMN copies what is
    not contiguous; nothing it sends is written)."""
    if how == "strided":
        big = np.zeros(arr.shape + (2,), arr.dtype)
        big[..., 1] = arr
        return big[..., 1]
    if how == "fortran" and arr.ndim >= 2:  # (it makes a 0-d array 1-d)
        return np.asfortranarray(arr)
    out = arr.copy()
    if how == "readonly":
        out.flags.writeable = False
    return out


def same(got, want, what):
    assert isinstance(got, np.ndarray), (what, type(got))
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.array_equal(got, want), (what, got, want)


def close(got, want, what, rtol=1e-6):
    assert isinstance(got, np.ndarray), (what, type(got))
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if want.dtype == np.float16:
        rtol = 2e-3
    assert np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                       atol=rtol), (what, got, want)


def total(arrays, dtype):
    acc = np.float64 if np.dtype(dtype).kind == "f" else np.int64
    return np.sum(np.stack([a.astype(acc) for a in arrays]), axis=0).astype(dtype)


# ------------------------------------------------------------ communicators
class Comms:
    """A communicator as seen from every rank: `comm` (this rank's) and
    `members[g]` (the global ranks, in comm-rank order, of the group that
    holds global rank g)."""

    def __init__(self, label, comm, members_of):
        self.label, self.comm, self.members_of = label, comm, members_of
        members = members_of[ME]
        assert comm.size == len(members) and comm.rank == members.index(ME), (
            label, comm.size, comm.rank, members)
        # one host: every rank is intra-node
        topology = (comm.intra_rank, comm.intra_size, comm.inter_rank, comm.inter_size)
        assert topology == (comm.rank, comm.size, 0, 1), (label, topology)

    @property
    def members(self):
        return self.members_of[ME]


def whole(label, comm, order):
    return Comms(label, comm, {g: order for g in range(SIZE)})


def split_members(parent_of, colors, keys):
    """MPI_Comm_split's groups within each group of the parent
    (`parent_of[g]`: the members of global rank g's group, in their rank
    order), by color, ordered by (key, rank in the parent)."""
    out = {}
    for g, group in parent_of.items():
        mine = [(keys[m], i, m) for i, m in enumerate(group) if colors[m] == colors[g]]
        out[g] = [m for _, _, m in sorted(mine)]
    return out


def random_split(rng, parent, label):
    """Every group of `parent` split at once, a grouped one's each on its
    own (a split of a split)."""
    colors = {g: rng.randrange(3) for g in range(SIZE)}
    keys = {g: rng.randrange(-2, 3) for g in range(SIZE)}
    sub = parent.comm.split(colors[ME], keys[ME])
    return Comms(label, sub, split_members(parent.members_of, colors, keys))


def make_comms():
    rng = random.Random(SEED)
    out = {}
    out["world"] = whole("world", chainermn.create_communicator("naive"), list(range(SIZE)))
    out["direct"] = whole("direct", NaiveCommunicator(WORLD_MPI), list(range(SIZE)))
    out["reversed"] = whole("reversed", out["world"].comm.split(0, SIZE - ME),
                            list(range(SIZE))[::-1])
    mpi_rev = WORLD_MPI.Split(0, SIZE - ME)
    out["mpi_reversed"] = whole("mpi_reversed",
                                chainermn.create_communicator("naive", mpi_comm=mpi_rev),
                                list(range(SIZE))[::-1])
    out["split"] = random_split(rng, out[rng.choice(sorted(out))], "split")
    colors = {g: rng.randrange(2) for g in range(SIZE)}
    keys = {g: rng.randrange(-2, 3) for g in range(SIZE)}
    sub = WORLD_MPI.Split(colors[ME], keys[ME])
    out["mpi_group"] = Comms("mpi_group", chainermn.create_communicator("naive", mpi_comm=sub),
                             split_members({g: list(range(SIZE)) for g in range(SIZE)}, colors,
                                           keys))
    return out


def check_names():
    from frontends.chainer.communicators import GPU_COMMUNICATORS

    for name in sorted(GPU_COMMUNICATORS) + ["hierarchical", "two_dimensional",
                                             "single_node", "flat", "pure_nccl"]:
        expect(RuntimeError, chainermn.create_communicator, name)
    expect(RuntimeError, chainermn.create_communicator)
    expect(ValueError, chainermn.create_communicator, "no_such_name")
    expect(ValueError, chainermn.create_communicator, "naive", allreduce_grad_dtype=np.float16)
    comm = chainermn.create_communicator("naive")
    assert comm.get_config("batched_copy") is True  # create_communicator's default
    assert NaiveCommunicator(WORLD_MPI).get_config("batched_copy") is False  # the class's
    expect(ValueError, comm.set_config, "allreduce_grad_dtype", np.float16)
    comm.finalize()


def expect(exc_type, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        return exc
    raise AssertionError(f"{fn} {args} {kwargs} did not raise {exc_type.__name__}")


# --------------------------------------------------------------- operations
def op_allreduce(d, c):
    shape, dtype = d["shape"], d["dtype"]
    x = laid(value(d["seed"], ME, shape, dtype), d["layout"])
    before = x.copy()
    got = c.comm.allreduce(x)
    same(got, total([value(d["seed"], g, shape, dtype) for g in c.members], dtype), d["label"])
    same(x, before, d["label"] + " input kept")


def op_bcast(d, c):
    m, me = c.members, c.comm.rank
    root = d["root"] % len(m)
    dtype, shape = d["dtype"], d["shape"]
    want = value(d["seed"], m[root], shape, dtype)
    if me == root:
        x = laid(want, d["layout"])
    else:
        x = None if d["flip"] else value(d["seed"] + 1, ME, (4,), np.float64)  # ignored
    got = c.comm.bcast(x, root=root)
    same(got, want, d["label"])
    if me == root:
        assert got is x, (d["label"], "the root gets its own array back")


def op_gather(d, c):
    m, me = c.members, c.comm.rank
    root = d["root"] % len(m)
    dtype = d["dtype"]
    x = laid(value(d["seed"], ME, d["shapes"][me], dtype), d["layout"])
    got = c.comm.gather(x, root=root)
    if me != root:
        assert got is None, (d["label"], got)
        return
    assert isinstance(got, tuple) and len(got) == len(m), (d["label"], got)
    for i, g in enumerate(m):
        same(got[i], value(d["seed"], g, d["shapes"][i], dtype), f"{d['label']} from {i}")


def op_allgather(d, c):
    m, me = c.members, c.comm.rank
    dtype = d["dtype"]
    got = c.comm.allgather(laid(value(d["seed"], ME, d["shapes"][me], dtype), d["layout"]))
    assert isinstance(got, tuple) and len(got) == len(m), (d["label"], got)
    for i, g in enumerate(m):
        same(got[i], value(d["seed"], g, d["shapes"][i], dtype), f"{d['label']} from {i}")


def op_scatter(d, c):
    m, me = c.members, c.comm.rank
    n = len(m)
    root = d["root"] % n
    dtype = d["dtype"]
    if d["flip"]:  # an array, split along its first axis
        whole_ = value(d["seed"], m[root], (n,) + d["shape"], dtype)
        parts = list(whole_)
        xs = laid(whole_, d["layout"]) if me == root else None
    else:
        parts = [value(d["seed"] + i, m[root], d["shapes"][i], dtype) for i in range(n)]
        xs = tuple(laid(p, d["layout"]) for p in parts) if me == root else None
    got = c.comm.scatter(xs, root=root)
    same(got, parts[me], d["label"])


def op_alltoall(d, c):
    m, me = c.members, c.comm.rank
    n = len(m)
    dtype = d["dtype"]

    def piece(i, j):  # comm rank i's array for comm rank j
        shape = d["shape"] if d["flip"] else d["table"][i][j]
        return value(d["seed"] + 1000 * j, m[i], shape, dtype)

    xs = [piece(me, j) for j in range(n)]
    got = c.comm.alltoall(laid(np.stack(xs), d["layout"]) if d["flip"]
                          else tuple(laid(x, d["layout"]) for x in xs))
    assert isinstance(got, tuple) and len(got) == n, (d["label"], got)
    for i in range(n):
        same(got[i], piece(i, me), f"{d['label']} from {i}")


def op_sendrecv(d, c):
    m, me = c.members, c.comm.rank
    n = len(m)
    if n < 2:
        return
    for k, (a, b, tag, tup, count, shapes, dtype) in enumerate(d["messages"]):
        a, b = a % n, b % n
        if a == b:
            b = (a + 1) % n
        arrays = [value(d["seed"] + 10 * k + i, m[a], shapes[i], dtype) for i in range(count)]
        sent = [laid(a, d["layout"]) for a in arrays]
        # a list is sent as a tuple is (ChainerMN's _MessageType: any iterable)
        data = (list(sent) if d["flip"] else tuple(sent)) if tup else sent[0]
        if me == a:
            assert c.comm.send(data, b, tag) is None
        elif me == b:
            got = c.comm.recv(a, tag)
            if tup:
                assert isinstance(got, tuple) and len(got) == count, (d["label"], k, got)
                for i in range(count):
                    same(got[i], arrays[i], f"{d['label']} message {k}.{i}")
            else:
                same(got, arrays[0], f"{d['label']} message {k}")


def op_obj_p2p(d, c):
    m, me = c.members, c.comm.rank
    n = len(m)
    if n < 2:
        return
    a, b = d["root"] % n, (d["root"] + 1 + d["other"] % (n - 1)) % n
    t1, t2 = d["tags"]
    # small (MPI sends it eagerly): a large one is received in order of sending
    # or the sender waits for good, in ChainerMN as here
    shape = d["shapes"][0]
    first = {"k": d["seed"], "a": value(d["seed"], m[a], shape, d["dtype"]), "l": [1, "x"]}
    second = ("second", d["seed"], None)
    if me == a:
        c.comm.send_obj(first, b, tag=t1)
        c.comm.send_obj(second, b, tag=t2)
    elif me == b:
        status = MPI.Status()
        if d["flip"]:  # by tag, the second first
            got2 = c.comm.recv_obj(a, status=status, tag=t2)
            assert status.Get_source() == a and status.Get_tag() == t2, (d["label"], status)
            got1 = c.comm.recv_obj(a, tag=t1)
        else:  # any tag: in the order sent
            got1 = c.comm.recv_obj(a, status=status)
            assert status.Get_tag() == t1, (d["label"], status.Get_tag(), t1)
            got2 = c.comm.recv_obj(a)
        assert got2 == second, (d["label"], got2)
        assert got1["k"] == first["k"] and got1["l"] == first["l"], (d["label"], got1)
        same(got1["a"], first["a"], d["label"])


def op_bcast_obj(d, c):
    m, me = c.members, c.comm.rank
    root = d["root"] % len(m)
    obj = {"seed": d["seed"], "root": m[root],
           "arr": value(d["seed"], m[root], (d["big"],), np.float64)}
    got = c.comm.bcast_obj(obj if me == root else None, max_buf_len=d["buf"], root=root)
    assert got["seed"] == d["seed"] and got["root"] == m[root], (d["label"], got)
    same(got["arr"], obj["arr"], d["label"])


def op_gather_obj(d, c):
    m, me = c.members, c.comm.rank
    root = d["root"] % len(m)
    got = c.comm.gather_obj((ME, d["seed"], [ME] * me), root=root)
    if me != root:
        assert got is None, (d["label"], got)
        return
    assert got == [(g, d["seed"], [g] * i) for i, g in enumerate(m)], (d["label"], got)


def op_allreduce_obj(d, c):
    m, kind = c.members, d["obj_kind"]
    if kind == 0:
        mine, want = ME * 7 + 1, sum(g * 7 + 1 for g in m)
        assert c.comm.allreduce_obj(mine) == want
    elif kind == 1:
        got = c.comm.allreduce_obj(value(d["seed"], ME, d["shape"], np.int64))
        same(np.asarray(got), total([value(d["seed"], g, d["shape"], np.int64) for g in m],
                                    np.int64), d["label"])
    else:
        got = c.comm.allreduce_obj([ME, d["seed"] % 5])
        assert got == [v for g in m for v in (g, d["seed"] % 5)], (d["label"], got)


def make_chain(seed, dtype, lazy=True):
    rng = np.random.RandomState(seed)
    model = chainer.Chain()
    with chainer.using_config("dtype", np.dtype(dtype)), model.init_scope():
        model.l1 = L.Linear(3, 2, initialW=rng.randint(-3, 4, (2, 3)).astype(dtype),
                            initial_bias=rng.randint(-3, 4, 2).astype(dtype))
        model.s = chainer.Parameter(np.array(rng.randint(-3, 4), dtype))
        model.u = L.Linear(2, 2, initialW=rng.randint(-3, 4, (2, 2)).astype(dtype),
                           initial_bias=rng.randint(-3, 4, 2).astype(dtype))
        model.p = chainer.Parameter(rng.randint(-3, 4, (2, 2)).astype(dtype))
        if lazy:
            model.lazy = L.Linear(None, 2)  # uninitialised: both methods skip it
    return model


def arrays_of(model):
    return {name: None if p.array is None else p.array.copy()
            for name, p in sorted(model.namedparams())}


def op_bcast_data(d, c):
    m = c.members
    model = make_chain(d["seed"] + ME, d["dtype"])
    if d["layout"] == "fortran":  # not C-contiguous: the values must still land there
        model.p.array = np.asfortranarray(model.p.array)
        model.l1.W.array = np.asfortranarray(model.l1.W.array)
    if d["flip"]:
        c.comm.broadcast_data(model)
    else:
        c.comm.bcast_data(model)
    want = arrays_of(make_chain(d["seed"] + m[0], d["dtype"]))
    for name, arr in arrays_of(model).items():
        if want[name] is None:
            assert arr is None, (d["label"], name)
        else:
            same(arr, want[name], f"{d['label']} {name}")


def op_mean_grad(d, c):
    m = c.members
    dtype, zero_fill = d["dtype"], d["zero_fill"]
    model = make_chain(d["seed"], dtype)
    names = [name for name, p in sorted(model.namedparams()) if p.array is not None]

    def grad(g, name):
        """Rank g's gradient of `name`, or None: /u/* on no rank; /p on some
        (only with zero_fill: without it every rank must skip the same)."""
        if name.startswith("/u/"):
            return None
        if name == "/p" and zero_fill and (g + d["seed"]) % 2 == 0:
            return None
        shape = dict(model.namedparams())[name].array.shape
        return value(d["seed"] + names.index(name), g, shape, dtype)

    params = dict(model.namedparams())
    for name in names:
        g = grad(ME, name)
        if g is not None and d["layout"] == "fortran" and g.ndim >= 2:
            g = np.asfortranarray(g)  # not C-contiguous: averaged all the same
        params[name].grad = g
    if d["flip"]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c.comm.allreduce_grad(model, zero_fill)
        assert any(issubclass(w.category, DeprecationWarning) for w in caught), d["label"]
    else:
        c.comm.multi_node_mean_grad(model, zero_fill=zero_fill)
    for name in names:
        grads = [grad(g, name) for g in m]
        got = params[name].grad
        if all(g is None for g in grads) and not zero_fill:
            assert got is None, (d["label"], name, got)
            continue
        shape = params[name].array.shape
        grads = [np.zeros(shape, dtype) if g is None else g for g in grads]
        want = (total(grads, np.float64) / len(m)).astype(dtype)
        close(got, want, f"{d['label']} {name} zero_fill={zero_fill}")
    assert params["/lazy/W"].array is None


def loss_of(model):
    return lambda x, y: F.mean_squared_error(model.l2(F.tanh(model.l1(x))), y)


def op_optimizer(d, c):
    m, me = c.members, c.comm.rank
    n = len(m)
    rng = np.random.RandomState(d["seed"])
    n_in, hid, batch, steps = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 3), 4
    xs = rng.standard_normal((steps + 1, batch * n, n_in))
    ys = rng.standard_normal((steps + 1, batch * n, 2))

    def model_for(seed):
        r = np.random.RandomState(seed)
        model = chainer.Chain()
        with chainer.using_config("dtype", np.float64), model.init_scope():
            model.l1 = L.Linear(n_in, hid, initialW=r.standard_normal((hid, n_in)),
                                initial_bias=r.standard_normal(hid))
            model.l2 = L.Linear(hid, 2, initialW=r.standard_normal((2, hid)),
                                initial_bias=r.standard_normal(2))
            model.unused = L.Linear(1, 1, initialW=r.standard_normal((1, 1)),
                                    initial_bias=r.standard_normal(1))
        return model

    def inner():
        return (chainer.optimizers.MomentumSGD(lr=0.1) if d["flip"]
                else chainer.optimizers.SGD(lr=0.05))

    model = model_for(d["seed"] + 100 + m[me])
    opt = chainermn.create_multi_node_optimizer(inner(), c.comm,
                                                double_buffering=d["double"],
                                                zero_fill=d["zero_fill"])
    opt.setup(model)
    lo, hi = me * batch, (me + 1) * batch
    for s in range(steps + 1):
        opt.update(loss_of(model), xs[s][lo:hi], ys[s][lo:hi])
    if d["double"]:
        opt.wait()

    ref = model_for(d["seed"] + 100 + m[0])
    ref_opt = inner()
    ref_opt.setup(ref)
    previous = None
    for s in range(1, steps + 1):  # update 0 broadcast rank 0's parameters
        if not d["double"]:
            ref_opt.update(loss_of(ref), xs[s], ys[s])
            continue
        ref.cleargrads()
        loss_of(ref)(xs[s], ys[s]).backward()
        current = {name: None if p.grad is None else p.grad.copy()
                   for name, p in ref.namedparams()}
        if previous is not None:
            for name, p in ref.namedparams():
                p.grad = previous[name]
            ref_opt.update()
        previous = current
    want = arrays_of(ref)
    for name, arr in arrays_of(model).items():
        assert np.allclose(arr, want[name], rtol=1e-9, atol=1e-11), (
            d["label"], name, arr, want[name])


def ranges(n, size, equal):
    if equal:
        length = (n + size - 1) // size
        return [(n * i // size, n * i // size + length) for i in range(size)]
    out, b = [], 0
    for i in range(size):
        e = b + n // size + (1 if i < n % size else 0)
        out.append((b, e))
        b = e
    return out


def op_scatter_dataset(d, c):
    m, me = c.members, c.comm.rank
    size = len(m)
    root = d["root"] % size
    n, shuffle, equal = d["n"], d["shuffle"], d["equal"]
    dataset = np.arange(n) * 3 + 1 if d["flip"] else [(i, str(i)) for i in range(n)]
    mine = dataset if me == root else (None if d["other"] % 2 else dataset[:1])
    sub = chainermn.scatter_dataset(mine, c.comm, root=root, shuffle=shuffle, seed=d["seed"],
                                    max_buf_len=d["buf"], force_equal_length=equal)
    order = (np.random.RandomState(d["seed"]).permutation(n) if shuffle else np.arange(n))
    b, e = ranges(n, size, equal)[me]
    assert len(sub) == e - b, (d["label"], len(sub), b, e)
    got = [sub[i] for i in range(len(sub))]
    want = [dataset[order[i]] for i in range(b, e)]
    if d["flip"]:
        assert [int(v) for v in got] == [int(v) for v in want], (d["label"], got, want)
    else:
        assert got == want, (d["label"], got, want)
    idx = chainermn.scatter_index(n if me == root else None, c.comm, root=root,
                                  force_equal_length=equal)
    assert tuple(idx) == (b, e), (d["label"], idx, (b, e))
    every = c.comm.gather_obj((b, e), root=0)
    if me == 0:
        covered = sorted(i for bb, ee in every for i in range(bb, ee))
        if equal:  # equal lengths, every example at least once
            assert set(covered) == set(range(n)) and len({ee - bb for bb, ee in every}) == 1
        else:  # every example exactly once
            assert covered == list(range(n)), (d["label"], every)


def weight(k, i):
    return k * 3 + i + 1


def op_functions(d, c):
    m, me = c.members, c.comm.rank
    n = len(m)
    dtype, kind, root = d["fdtype"], d["fkind"], d["root"] % n
    shapes = d["shapes"]

    def arr(seed, g, shape):
        return value(seed, g, shape, dtype)

    if kind == "allgather":
        x = chainer.Variable(arr(d["seed"], ME, shapes[me]))
        ys = FUNCS.allgather(c.comm, x)
        for i, g in enumerate(m):
            same(ys[i].array, arr(d["seed"], g, shapes[i]), f"{d['label']} {i}")
        sum(F.sum(y) * weight(me, i) for i, y in enumerate(ys)).backward()
        same(x.grad, np.full(shapes[me], sum(weight(k, me) for k in range(n)), dtype),
             d["label"] + " grad")
    elif kind == "alltoall":
        def piece(i, j):
            return arr(d["seed"] + 100 * j, m[i], d["table"][i][j])
        xs = [chainer.Variable(piece(me, j)) for j in range(n)]
        ys = FUNCS.alltoall(c.comm, xs)
        for i in range(n):
            same(ys[i].array, piece(i, me), f"{d['label']} {i}")
        sum(F.sum(y) * weight(me, i) for i, y in enumerate(ys)).backward()
        for j, x in enumerate(xs):
            same(x.grad, np.full(x.shape, weight(j, me), dtype), f"{d['label']} grad {j}")
    elif kind == "bcast":
        data = arr(d["seed"], m[root], shapes[root])
        x = chainer.Variable(data.copy())
        y = FUNCS.bcast(c.comm, x if me == root else None, root)
        same(y.array, data, d["label"])
        (F.sum(y) * weight(me, root)).backward()
        if me == root:
            same(x.grad, np.full(data.shape, sum(weight(k, root) for k in range(n)), dtype),
                 d["label"] + " grad")
    elif kind == "gather":
        x = chainer.Variable(arr(d["seed"], ME, shapes[me]))
        out = FUNCS.gather(c.comm, x, root)
        if me == root:
            for i, g in enumerate(m):
                same(out[i].array, arr(d["seed"], g, shapes[i]), f"{d['label']} {i}")
            sum(F.sum(y) * weight(root, i) for i, y in enumerate(out)).backward()
        else:
            out.backward()
        same(x.grad, np.full(shapes[me], weight(root, me), dtype), d["label"] + " grad")
    elif kind == "scatter":
        parts = [arr(d["seed"] + i, m[root], shapes[i]) for i in range(n)]
        vs = [chainer.Variable(p.copy()) for p in parts]
        y = FUNCS.scatter(c.comm, vs if me == root else None, root)
        same(y.array, parts[me], d["label"])
        (F.sum(y) * weight(me, root)).backward()
        if me == root:
            for i, v in enumerate(vs):
                same(v.grad, np.full(parts[i].shape, weight(i, root), dtype),
                     f"{d['label']} grad {i}")
    else:  # send/recv: comm rank a sends to b, which sends the gradient back
        if n < 2:
            return
        a, b = root, (root + 1 + d["other"] % (n - 1)) % n
        data = arr(d["seed"], m[a], shapes[0])
        if me == a:
            x = chainer.Variable(data.copy())
            delegate = FUNCS.send(x * 2, c.comm, b, tag=d["tags"][0])
            delegate.backward()
            same(x.grad, np.full(data.shape, 2 * weight(b, a), dtype), d["label"] + " grad")
        elif me == b:
            y = FUNCS.recv(c.comm, a, tag=d["tags"][0])
            same(y.array, (data * 2).astype(dtype), d["label"])
            (F.sum(y) * weight(b, a)).backward()


def op_bad(d, c):
    """A call ChainerMN refuses, made alike on every rank; then the
    communicator must still work."""
    m, me = c.members, c.comm.rank
    n = len(m)
    kind = d["bad"]
    if kind == "alltoall_length":
        expect(ValueError, c.comm.alltoall, tuple(np.ones(1, np.float32) for _ in range(n + 1)))
    elif kind == "allreduce_tuple":
        expect(TypeError, c.comm.allreduce, (np.ones(1), np.ones(1)))
    elif kind == "allreduce_dtype":
        expect(TypeError, c.comm.allreduce, np.ones(2, np.complex64))
    elif kind == "bcast_tuple":
        root = d["root"] % n
        expect(TypeError, c.comm.bcast, (np.ones(1), np.ones(1)) if me == root else None, root)
    elif kind == "scatter_length":
        root = d["root"] % n
        xs = tuple(np.ones(1, np.float32) for _ in range(n + 1))
        expect(ValueError, c.comm.scatter, xs if me == root else None, root)
    elif kind == "alltoall_mixed" and n > 1:
        xs = tuple(np.ones(1, np.float32 if j else np.float64) for j in range(n))
        expect(TypeError, c.comm.alltoall, xs)
    elif kind == "alltoall_rank_dtypes" and n > 1:
        dt = np.float32 if me == 0 else np.float64
        expect(TypeError, c.comm.alltoall, tuple(np.ones(1, dt) for _ in range(n)))
    elif kind == "gather_dtypes" and n > 1:
        x = np.ones(2, np.int32 if me == n - 1 else np.int64)
        expect(TypeError, c.comm.gather, x, d["root"] % n)
    elif kind == "finalized":
        comm = chainermn.create_communicator("naive", mpi_comm=c.comm.mpi_comm)
        comm.finalize()
        expect(RuntimeError, comm.allreduce, np.ones(1))
        expect(RuntimeError, comm.bcast_obj, 1)
    elif kind == "allgather_dtypes" and n > 1:
        x = np.ones(2, np.float32 if me == 0 else np.float64)
        expect(TypeError, c.comm.allgather, x)
    got = c.comm.allreduce(np.array([1], np.int64))
    same(got, np.array([n], np.int64), d["label"] + " after " + kind)


OPS = {
    "allreduce": op_allreduce, "bcast": op_bcast, "gather": op_gather,
    "allgather": op_allgather, "scatter": op_scatter, "alltoall": op_alltoall,
    "sendrecv": op_sendrecv, "obj_p2p": op_obj_p2p, "bcast_obj": op_bcast_obj,
    "gather_obj": op_gather_obj, "allreduce_obj": op_allreduce_obj,
    "bcast_data": op_bcast_data, "mean_grad": op_mean_grad, "optimizer": op_optimizer,
    "scatter_dataset": op_scatter_dataset, "functions": op_functions,
}
WEIGHTS = {"allreduce": 3, "bcast": 3, "gather": 3, "allgather": 3, "scatter": 3,
           "alltoall": 3, "sendrecv": 2, "obj_p2p": 2, "bcast_obj": 2, "gather_obj": 1,
           "allreduce_obj": 1, "bcast_data": 2, "mean_grad": 3, "optimizer": 1,
           "scatter_dataset": 2, "functions": 4}
BADS = ("alltoall_length", "allreduce_tuple", "allreduce_dtype", "bcast_tuple",
        "scatter_length", "alltoall_mixed", "allgather_dtypes", "alltoall_rank_dtypes",
        "gather_dtypes", "finalized")


def draw(rng, step, i, comm_names):
    kind = rng.choices(sorted(OPS), [WEIGHTS[k] for k in sorted(OPS)])[0]
    if rng.random() < BAD:
        kind = "bad"
    shape_of = lambda: rng.choice(SHAPES)  # noqa: E731
    d = dict(
        kind=kind, comm=rng.choice(comm_names), seed=rng.randrange(1 << 30),
        dtype=rng.choice(FLOATS if kind in ("bcast_data", "mean_grad") else DTYPES),
        fdtype=rng.choice((np.float16, np.float32, np.float64)),
        fkind=rng.choice(("allgather", "alltoall", "bcast", "gather", "scatter", "sendrecv")),
        shape=(300_001,) if rng.random() < 0.03 else shape_of(),
        shapes=[shape_of() for _ in range(SIZE)],
        table=[[shape_of() for _ in range(SIZE)] for _ in range(SIZE)],
        root=rng.randrange(SIZE), other=rng.randrange(SIZE), flip=rng.random() < 0.5,
        tags=rng.sample(range(0, 20), 2), big=rng.choice((0, 1, 5, 300)),
        buf=rng.choice((None, 1, 7, 64, 1 << 20)), zero_fill=rng.random() < 0.6,
        double=rng.random() < 0.4, n=rng.randrange(0, 14), shuffle=rng.random() < 0.5,
        equal=rng.random() < 0.5, obj_kind=rng.randrange(3), bad=rng.choice(BADS),
        layout=rng.choice(("c", "c", "strided", "fortran", "readonly")),
        messages=[(rng.randrange(SIZE), rng.randrange(SIZE), rng.randrange(4),
                   rng.random() < 0.5, rng.randint(1, 3),
                   [shape_of() for _ in range(3)], rng.choice(DTYPES))
                  for _ in range(rng.randint(1, 4))])
    if d["buf"] is None:
        d["buf"] = 256 * 1024 * 1024  # ChainerMN's default
    d["label"] = f"step {step}.{i} {kind} on {d['comm']} ({np.dtype(d['dtype']).name})"
    return d


def run_step(step, comms):
    shared = random.Random(SEED * 1_000_003 + step)
    fresh = None
    if shared.random() < 0.2:
        # (a grouped one too, "split" or "mpi_group": a split of a split)
        parent = comms[shared.choice(sorted(comms))]
        fresh = random_split(shared, parent, "fresh")
        comms = dict(comms, fresh=fresh)
    names = sorted(comms)
    for i in range(shared.randint(1, 5)):
        d = draw(shared, step, i, names)
        c = comms[d["comm"]]
        if TRACE:
            sys.stderr.write(f"[{ME}] {d['label']} layout={d['layout']} root={d['root']} "
                             f"members={c.members} flip={d['flip']} bad={d['bad']}\n")
        if d["kind"] == "bad":
            op_bad(d, c)
        else:
            OPS[d["kind"]](d, c)
    if fresh is not None and shared.random() < 0.5:
        fresh.comm.finalize()


def main():
    check_names()
    comms = make_comms()
    for step in range(STEPS):
        run_step(step, comms)
    # every rank is done with every communicator before any exits
    comms["world"].comm.bcast_obj(None)
    print("OK", ME, STEPS, flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        sys.stderr.write(f"FAIL rank {ME} seed {SEED}\n{traceback.format_exc()}")
        sys.stderr.flush()
        WORLD_MPI.Abort(1)
