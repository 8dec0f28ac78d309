"""Random steps of frontends.tensorflow's API, checked against NumPy on every
rank.

Each step draws, from a seed every rank shares, a few operations:

- allreduce (Sum, Average, Min, Max, Product) with prescale and postscale
  factors and Compression.none or fp16, of a tf.Tensor or a tf.Variable, of a
  0-d tensor too; allreduce of a tf.IndexedSlices (Sum, Average: the values
  and indices of every rank, the values divided by the set's size for
  Average); grouped_allreduce of a list (dense tensors of mixed dtypes, with
  IndexedSlices among them);
- allgather and grouped_allgather with a ragged first dimension (0 rows
  included); broadcast from any member (bool too); alltoall with splits
  (a list or an int32 tensor: the rows received and the received splits) or
  without (an even split); reducescatter and grouped_reducescatter (Sum,
  Average, scale factors, fp16 compression) with uneven rows;
- broadcast_variables and broadcast_ of tf.Variables that differ per rank;
  allgather_object and broadcast_object (eagerly: they run at once);
- gradients through allreduce, grouped_allreduce, allgather, broadcast,
  alltoall and reducescatter under a tf.GradientTape, checked against the
  gradients Horovod registers (allreduce: the same allreduce of the incoming
  gradient; allgather: its Average allreduce, then this rank's rows;
  broadcast: its Average allreduce on the root, zeros elsewhere; alltoall:
  sent back along the received splits; reducescatter: the gathered
  gradient, times the set's size for Sum and the scale factors);
- DistributedGradientTape (op Average or Sum, gradient_predivide_factor,
  groups, fp16 compression, sparse_as_dense or not) on a tiny model with an
  embedding lookup (an IndexedSlices gradient): equal to the full-batch
  gradient computed in one process (times the set's size for Sum).

Dtypes: float16, bfloat16, float32, float64, uint8, int8, int16, uint16,
int32, int64 (and bool where nothing is reduced); values 1 and 2 so sums and
products are exact; Average and fp16 compression compared with a tolerance.
Inputs must come out unchanged, and overwriting a tf.Variable input after
the operation must not change its result (no result shares its memory).
Each operation runs on the global set or a process set (one with ranks 0
and 1, one with the last two, registered at init; both are the global set
at N = 2), named or unnamed,
eagerly or inside its own tf.function; some steps run all of a rank's
operations inside one tf.function (all named then: the ranks trace
different programs).

The TensorFlow collectives block until every member has submitted, so a
rank's order is the shared one, except that between two global operations
each rank interleaves its 'pair' and 'tail' operations in its own random
order when those sets share at most one rank (which cannot deadlock: two
ranks that are both in an operation's set agree on its place).

Usage: mpirun -n N python random_tensorflow.py SEED STEPS (N >= 2).
Prints "OK <rank> <steps>" at the end.
"""

import os
import random
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

import frontends.tensorflow as hvd  # noqa: E402
import frontends.tensorflow.keras as hvd_keras  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

SEED, STEPS = int(sys.argv[1]), int(sys.argv[2])
KINDS = os.environ.get("KINDS", "").split(",") if os.environ.get("KINDS") else None
SIZE = MPI.COMM_WORLD.size
if SIZE > 2:
    SETS = {"global": hvd.global_process_set, "pair": hvd.ProcessSet([0, 1]),
            "tail": hvd.ProcessSet([SIZE - 2, SIZE - 1])}
    hvd.init(process_sets=[SETS["pair"], SETS["tail"]])
else:  # both would be the global set, which init() refuses to register twice
    SETS = dict.fromkeys(("global", "pair", "tail"), hvd.global_process_set)
    hvd.init()
ME = hvd.rank()

FLOATS = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
INTS = (tf.uint8, tf.int8, tf.int16, tf.uint16, tf.int32, tf.int64)
REDUCIBLE = FLOATS + INTS
MOVABLE = REDUCIBLE + (tf.bool,)
REDUCTIONS = (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product)
ALL_KINDS = ("allreduce", "sparse", "grouped_allreduce", "allgather", "grouped_allgather",
             "broadcast", "alltoall", "reducescatter", "grouped_reducescatter",
             "broadcast_variables", "objects", "gradient", "tape", "keras", "adasum")
# What may run inside a tf.function with other operations in a rank's own
# order: named, and creating no other collective whose name comes from the graph.
FUSABLE = ("allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
           "alltoall", "reducescatter", "grouped_reducescatter")


def npdt(dtype):
    return dtype.as_numpy_dtype


def value(seed, rank, shape, dtype):
    """Rank `rank`'s array: values 1 and 2, so sums and products stay exact."""
    a = np.random.default_rng(seed * 131 + rank).integers(1, 3, shape)
    return (a == 2) if dtype == tf.bool else a.astype(npdt(dtype))


def scaled(a, factor, divisor=1):
    """a * factor / divisor by the core's rule: integers in float64, dividing
    last, rounded toward zero; 16-bit floats in float32."""
    if factor == 1.0 and divisor == 1:
        return a
    dt = a.dtype
    if not np.issubdtype(dt, np.floating) and dt not in (npdt(tf.bfloat16),):
        return (a.astype(np.float64) * factor / divisor).astype(dt)
    if dt in (np.float16, npdt(tf.bfloat16)):
        return (a.astype(np.float32) * np.float32(factor / divisor)).astype(dt)
    return a * dt.type(factor / divisor)


def reduce(op, arrays, scales):
    pre, post = scales
    stack = np.stack([scaled(a, pre) for a in arrays])
    dt = stack.dtype
    if op is hvd.Min:
        result = stack.astype(np.float64).min(axis=0).astype(dt)
    elif op is hvd.Max:
        result = stack.astype(np.float64).max(axis=0).astype(dt)
    elif op is hvd.Product:
        result = stack.astype(np.float64).prod(axis=0).astype(dt)
    else:
        result = stack.astype(np.float64).sum(axis=0).astype(dt)
    return scaled(result, post, len(arrays) if op is hvd.Average else 1)


def compressed_reduce(op, arrays, scales, compression):
    """reduce() as the frontend runs it: fp16 compression casts floats to
    float16 before and back after."""
    if compression is hvd.Compression.fp16 and tf.as_dtype(arrays[0].dtype).is_floating:
        dt = arrays[0].dtype
        return reduce(op, [a.astype(np.float16) for a in arrays], scales).astype(dt)
    return reduce(op, arrays, scales)


def share(rows, members, me_in):
    base, extra = divmod(rows, len(members))
    start = me_in * base + min(me_in, extra)
    return start, base + (1 if me_in < extra else 0)


def draw(rng, step, i, kinds):
    kind = rng.choice(kinds)
    set_name = "global" if kind == "keras" else rng.choice(sorted(SETS))
    members = SETS[set_name].ranks
    if kind in ("allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter"):
        dtypes = REDUCIBLE
    elif kind == "adasum":
        dtypes = (tf.float16, tf.float32, tf.float64)
    elif kind in ("gradient", "tape", "sparse"):
        dtypes = (tf.float32, tf.float64) if kind != "sparse" else FLOATS
    else:
        dtypes = MOVABLE
    op = rng.choice(REDUCTIONS if kind in ("allreduce", "grouped_allreduce") else
                    (hvd.Sum, hvd.Average))
    scales = (1.0, 1.0)
    if rng.random() < 0.5 and kind not in ("sparse", "tape"):
        scales = (rng.choice((0.5, 1.0) if op is hvd.Product else (0.5, 1.0, 2.0)),
                  rng.choice((0.5, 1.0, 2.0, 3.0)))
    return dict(
        kind=kind, set=set_name, members=members, dtype=rng.choice(dtypes),
        dtypes=[rng.choice(dtypes) for _ in range(3)], op=op, scales=scales,
        name=f"s{step}.{i}" if rng.random() < 0.6 else None,
        mode=rng.choice(("eager", "function")),
        compression=hvd.Compression.fp16 if rng.random() < 0.3 else hvd.Compression.none,
        variable=rng.random() < 0.3, count=rng.randint(1, 3),
        inner=tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 2))),
        rows={r: rng.randint(0, 3) for r in members}, root=rng.choice(members),
        splits={r: [rng.randint(0, 2) for _ in members] for r in members},
        splits_as=rng.choice(("list", "tensor", None)),
        scalar=kind in ("allreduce", "broadcast") and rng.random() < 0.15,
        sparse_mix=rng.random() < 0.3, grad_of=rng.choice(
            ("allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall",
             "reducescatter")),
        tape=dict(sparse_as_dense=rng.random() < 0.5, op=rng.choice((hvd.Average, hvd.Sum)),
                  predivide=rng.choice((1.0, 1.0, 2.0)), groups=rng.choice((None, 1, 2, "list")),
                  batch=rng.randint(1, 3)),
        seed=rng.randrange(1 << 30))


# ------------------------------------------------------------ the operations
# build(d) -> (fn, inputs, check): fn(*inputs) runs this rank's part (eagerly
# or traced) and returns a flat list of tensors; check(arrays) asserts them.

def close(got, want, label, tol):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (
        label, got.dtype, want.dtype, got.shape, want.shape)
    if tol:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=tol, atol=tol, err_msg=str(label))
    else:
        np.testing.assert_array_equal(got.astype(np.float64) if got.dtype != bool else got,
                                      want.astype(np.float64) if want.dtype != bool else want,
                                      err_msg=str(label))


def tolerance(dtype, op, compression=hvd.Compression.none, scales=(1.0, 1.0)):
    dtype = tf.as_dtype(dtype)
    if not dtype.is_floating:
        return 0
    lossy = op is hvd.Average or scales[1] not in (0.5, 1.0, 2.0)
    if compression is hvd.Compression.fp16 or dtype in (tf.float16, tf.bfloat16):
        return 1e-2 if lossy or compression is hvd.Compression.fp16 else 0
    return 1e-6 if lossy else 0


def as_input(d, array, k=0):
    t = tf.constant(array)
    if d["variable"]:
        return tf.Variable(t, name=f"v{k}")
    return t


def build(d):
    kind = d["kind"]
    members, ps = d["members"], SETS[d["set"]]
    me_in = members.index(ME)
    n = len(members)
    label = {key: d[key] for key in ("kind", "set", "name", "mode", "seed")}
    shape = () if d["scalar"] else (d["rows"][members[0]] + 1,) + d["inner"]

    if kind == "allreduce":
        dt = d["dtype"]
        arrays = [value(d["seed"], r, shape, dt) for r in members]
        want = compressed_reduce(d["op"], arrays, d["scales"], d["compression"])
        tol = tolerance(dt, d["op"], d["compression"], d["scales"])

        def fn(x):
            return [hvd.allreduce(x, op=d["op"], prescale_factor=d["scales"][0],
                                  postscale_factor=d["scales"][1], name=d["name"],
                                  compression=d["compression"], process_set=ps)]
        return fn, [as_input(d, arrays[me_in])], lambda got: close(
            got[0], want, (label, dt, d["op"], d["scales"], d["compression"]), tol)

    if kind == "grouped_allreduce":
        dts = d["dtypes"][:d["count"]]
        shapes = [(d["rows"][members[0]] + k,) + d["inner"] for k in range(len(dts))]
        arrays = [[value(d["seed"] + k, r, shapes[k], dt) for r in members]
                  for k, dt in enumerate(dts)]
        want = [compressed_reduce(d["op"], a, d["scales"], d["compression"]) for a in arrays]

        def fn(*xs):
            return hvd.grouped_allreduce(list(xs), op=d["op"], prescale_factor=d["scales"][0],
                                         postscale_factor=d["scales"][1], name=d["name"],
                                         compression=d["compression"], process_set=ps)

        def check(got):
            assert len(got) == len(want), (label, len(got))
            for k, (g, w) in enumerate(zip(got, want)):
                close(g, w, (label, k, dts[k], d["op"], d["scales"], d["compression"]),
                      tolerance(dts[k], d["op"], d["compression"], d["scales"]))
        return fn, [as_input(d, a[me_in], k) for k, a in enumerate(arrays)], check

    if kind == "sparse":
        # IndexedSlices, alone or (grouped) with a dense tensor beside it
        dt = d["dtype"]
        dense_rows = 5
        rows = d["rows"]
        vals = {r: value(d["seed"], r, (rows[r],) + d["inner"], dt) for r in members}
        idx = {r: np.random.default_rng(d["seed"] + r).integers(0, dense_rows, rows[r])
               .astype(np.int64) for r in members}
        want_v = np.concatenate([vals[r] for r in members])
        if d["op"] is hvd.Average:
            want_v = (want_v.astype(np.float64) / n).astype(want_v.dtype)
        want_i = np.concatenate([idx[r] for r in members])
        dense_arrays = [value(d["seed"] + 7, r, (2,), tf.float32) for r in members]
        want_dense = reduce(d["op"], dense_arrays, (1.0, 1.0))
        tol = tolerance(dt, d["op"])
        grouped = d["sparse_mix"]

        def fn(v, i, dense):
            slices = tf.IndexedSlices(v, i, dense_shape=tf.constant(
                (dense_rows,) + d["inner"], tf.int64))
            if grouped:
                out, other = hvd.grouped_allreduce([slices, dense], op=d["op"],
                                                   process_set=ps, name=d["name"])
            else:
                out, other = hvd.allreduce(slices, op=d["op"], process_set=ps,
                                           name=d["name"]), dense
            assert isinstance(out, tf.IndexedSlices), (label, type(out))
            return [out.values, out.indices, tf.convert_to_tensor(out.dense_shape), other]

        def check(got):
            close(got[0], want_v, (label, "values", dt, d["op"]), tol)
            close(got[1], want_i, (label, "indices"), 0)
            assert list(got[2]) == [dense_rows] + list(d["inner"]), (label, got[2])
            if grouped:
                close(got[3], want_dense, (label, "dense beside", d["op"]),
                      tolerance(tf.float32, d["op"]))
        return fn, [tf.constant(vals[ME]), tf.constant(idx[ME]),
                    tf.constant(dense_arrays[me_in])], check

    if kind in ("allgather", "grouped_allgather"):
        dts = [d["dtype"]] if kind == "allgather" else d["dtypes"][:d["count"]]
        arrays = [{r: value(d["seed"] + k, r, (d["rows"][r] + k % 2,) + d["inner"][:1], dt)
                   for r in members} for k, dt in enumerate(dts)]
        want = [np.concatenate([a[r] for r in members]) for a in arrays]

        def fn(*xs):
            if kind == "allgather":
                return [hvd.allgather(xs[0], name=d["name"], process_set=ps)]
            return hvd.grouped_allgather(list(xs), name=d["name"], process_set=ps)

        def check(got):
            assert len(got) == len(want), (label, len(got))
            for k, (g, w) in enumerate(zip(got, want)):
                close(g, w, (label, k, dts[k]), 0)
        return fn, [as_input(d, a[ME], k) for k, a in enumerate(arrays)], check

    if kind == "broadcast":
        dt = d["dtype"]
        mine = value(d["seed"], ME, shape, dt)
        want = value(d["seed"], d["root"], shape, dt)

        def fn(x):
            return [hvd.broadcast(x, d["root"], name=d["name"], process_set=ps)]
        return fn, [as_input(d, mine)], lambda got: close(got[0], want, (label, dt, d["root"]), 0)

    if kind == "alltoall":
        dt = d["dtype"]
        inner = d["inner"][:1]
        if d["splits_as"] is None:
            k = d["rows"][members[0]]
            sent = {r: value(d["seed"], r, (k * n,) + inner, dt) for r in members}
            want = np.concatenate([sent[r][k * me_in:k * (me_in + 1)] for r in members])
            want_rs = None
        else:
            splits = d["splits"]
            sent = {r: value(d["seed"], r, (sum(splits[r]),) + inner, dt) for r in members}
            want = np.concatenate([sent[r][sum(splits[r][:me_in]):sum(splits[r][:me_in + 1])]
                                   for r in members])
            want_rs = np.array([splits[r][me_in] for r in members], np.int32)

        def fn(x):
            if d["splits_as"] is None:
                return [hvd.alltoall(x, name=d["name"], process_set=ps)]
            splits = d["splits"][ME]
            if d["splits_as"] == "tensor":
                splits = tf.constant(splits, tf.int32)
            out, received = hvd.alltoall(x, splits=splits, name=d["name"], process_set=ps)
            return [out, received]

        def check(got):
            close(got[0], want, (label, dt, d["splits_as"]), 0)
            if want_rs is not None:
                close(got[1], want_rs, (label, "received splits"), 0)
        return fn, [as_input(d, sent[ME])], check

    if kind in ("reducescatter", "grouped_reducescatter"):
        dts = [d["dtype"]] if kind == "reducescatter" else d["dtypes"][:d["count"]]
        rows = d["rows"][members[0]] + n
        arrays = [[value(d["seed"] + k, r, (rows + k,) + d["inner"], dt) for r in members]
                  for k, dt in enumerate(dts)]
        want = []
        for k, a in enumerate(arrays):
            start, count = share(rows + k, members, me_in)
            want.append(compressed_reduce(d["op"], a, d["scales"], d["compression"])
                        [start:start + count])
        args = dict(op=d["op"], name=d["name"], process_set=ps, compression=d["compression"],
                    prescale_factor=d["scales"][0], postscale_factor=d["scales"][1])

        def fn(*xs):
            if kind == "reducescatter":
                return [hvd.reducescatter(xs[0], **args)]
            return hvd.grouped_reducescatter(list(xs), **args)

        def check(got):
            assert len(got) == len(want), (label, len(got))
            for k, (g, w) in enumerate(zip(got, want)):
                close(g, w, (label, k, dts[k], d["op"], d["scales"], d["compression"]),
                      tolerance(dts[k], d["op"], d["compression"], d["scales"]))
        return fn, [as_input(d, a[me_in], k) for k, a in enumerate(arrays)], check

    if kind == "broadcast_variables":
        dts = d["dtypes"][:d["count"]]
        shapes = [(d["rows"][members[0]] + 1 + k,) + d["inner"] for k in range(len(dts))]
        vs = [tf.Variable(value(d["seed"] + k, ME, s, dt)) for k, (s, dt) in
              enumerate(zip(shapes, dts))]
        want = [value(d["seed"] + k, d["root"], s, dt) for k, (s, dt) in
                enumerate(zip(shapes, dts))]
        inplace = d["sparse_mix"]  # broadcast_ instead

        def fn():
            if inplace:
                out = hvd.broadcast_(vs, d["root"], name=d["name"], process_set=ps)
                return list(out)
            op = hvd.broadcast_variables(vs, d["root"], process_set=ps)
            if op is None:
                return [tf.convert_to_tensor(v) for v in vs]
            with tf.control_dependencies([op]):
                return [tf.identity(v.read_value()) for v in vs]

        def check(got):
            for k, w in enumerate(want):
                close(vs[k].numpy(), w, (label, "variable", k, dts[k], inplace), 0)
                close(got[k], w, (label, "returned", k, dts[k], inplace), 0)
        return fn, [], check

    if kind == "keras":
        return build_keras(d, label, members, me_in)
    if kind == "adasum":
        return build_adasum(d, label, members, me_in)
    if kind == "gradient":
        return build_gradient(d, label, members, me_in, ps)
    if kind == "tape":
        return build_tape(d, label, members, me_in, ps)
    raise AssertionError(kind)


def build_gradient(d, label, members, me_in, ps):
    """y = op(x); loss = sum(y * w) with w this rank's weights (1 and 2):
    dloss/dy = w, and the expected dx follows Horovod's registered gradient."""
    dt, n, which = d["dtype"], len(members), d["grad_of"]
    ndt = npdt(dt)
    rows = d["rows"]
    inner = d["inner"][:1]
    op = d["op"] if d["op"] in (hvd.Sum, hvd.Average) else hvd.Sum
    pre, post = d["scales"]
    if which == "allreduce" or which == "grouped_allreduce":
        shape = (rows[members[0]] + 1,) + inner
        xs = {r: value(d["seed"], r, shape, dt) for r in members}
        ws = {r: value(d["seed"] + 1, r, shape, dt) for r in members}
        want_y = reduce(op, [xs[r] for r in members], (pre, post))
        want_dx = reduce(op, [ws[r] for r in members], (pre, post))
    elif which == "allgather":
        xs = {r: value(d["seed"], r, (rows[r],) + inner, dt) for r in members}
        total = sum(rows[r] for r in members)
        ws = {r: value(d["seed"] + 1, r, (total,) + inner, dt) for r in members}
        want_y = np.concatenate([xs[r] for r in members])
        avg = reduce(hvd.Average, [ws[r] for r in members], (1.0, 1.0))
        start = sum(rows[r] for r in members[:me_in])
        want_dx = avg[start:start + rows[ME]]
    elif which == "broadcast":
        shape = (rows[members[0]] + 1,) + inner
        xs = {r: value(d["seed"], r, shape, dt) for r in members}
        ws = {r: value(d["seed"] + 1, r, shape, dt) for r in members}
        want_y = xs[d["root"]]
        avg = reduce(hvd.Average, [ws[r] for r in members], (1.0, 1.0))
        want_dx = avg if ME == d["root"] else np.zeros_like(avg)
    elif which == "alltoall":
        splits = d["splits"]
        xs = {r: value(d["seed"], r, (sum(splits[r]),) + inner, dt) for r in members}
        recv = {r: sum(splits[q][members.index(r)] for q in members) for r in members}
        ws = {r: value(d["seed"] + 1, r, (recv[r],) + inner, dt) for r in members}
        want_y = np.concatenate([xs[q][sum(splits[q][:me_in]):sum(splits[q][:me_in + 1])]
                                 for q in members])
        # what I sent to rank r (index j) sits in r's output after the rows
        # r received from the ranks before me
        parts = []
        for j, r in enumerate(members):
            offset = sum(splits[q][j] for q in members[:me_in])
            parts.append(ws[r][offset:offset + splits[ME][j]])
        want_dx = np.concatenate(parts)
    else:  # reducescatter
        total = rows[members[0]] + n
        xs = {r: value(d["seed"], r, (total,) + inner, dt) for r in members}
        start, count = share(total, members, me_in)
        ws = {r: value(d["seed"] + 1, r, (share(total, members, members.index(r))[1],) + inner,
                       dt) for r in members}
        want_y = reduce(op, [xs[r] for r in members], (pre, post))[start:start + count]
        scale = pre * post * (n if op is hvd.Sum else 1)
        want_dx = np.concatenate([ws[r] * ndt(scale) for r in members])

    def fn(x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            if which == "allreduce":
                y = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post,
                                  name=d["name"], process_set=ps)
            elif which == "grouped_allreduce":
                (y,) = hvd.grouped_allreduce([x], op=op, prescale_factor=pre,
                                             postscale_factor=post, name=d["name"],
                                             process_set=ps)
            elif which == "allgather":
                y = hvd.allgather(x, name=d["name"], process_set=ps)
            elif which == "broadcast":
                y = hvd.broadcast(x, d["root"], name=d["name"], process_set=ps)
            elif which == "alltoall":
                y, _ = hvd.alltoall(x, splits=d["splits"][ME], name=d["name"], process_set=ps)
            else:
                y = hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post,
                                      name=d["name"], process_set=ps)
            loss = tf.reduce_sum(y * w)
        dx = tape.gradient(loss, x)
        assert dx is not None, (label, which, "no gradient")
        return [y, tf.convert_to_tensor(dx)]

    tol = 1e-6 if op is hvd.Average or which in ("allgather", "broadcast") else 0

    def check(got):
        close(got[0], want_y, (label, which, dt, op, (pre, post), "forward"), tol)
        close(got[1], want_dx, (label, which, dt, op, (pre, post), "gradient"), tol)
    return fn, [tf.constant(xs[ME]), tf.constant(ws[ME])], check


def build_keras(d, label, members, me_in):
    """frontends.tensorflow.keras's allreduce, allgather, broadcast and
    reducescatter of a NumPy value (global set; op defaults to Average)."""
    which = ("allreduce", "allgather", "broadcast", "reducescatter")[d["seed"] % 4]
    dt = d["dtype"] if which in ("allgather", "broadcast") or d["dtype"] != tf.bool else tf.int32
    n = len(members)
    if which == "allreduce":
        dt = d["dtype"] if d["dtype"] in REDUCIBLE else tf.float32
        shape = (d["rows"][0] + 1,) + d["inner"]
        arrays = [value(d["seed"], r, shape, dt) for r in members]
        op = None if d["op"] is hvd.Average else d["op"]
        want = reduce(d["op"], arrays, d["scales"])
        tol = tolerance(dt, d["op"], scales=d["scales"])

        def fn():
            return [hvd_keras.allreduce(arrays[me_in], name=d["name"], op=op,
                                        prescale_factor=d["scales"][0],
                                        postscale_factor=d["scales"][1])]
    elif which == "allgather":
        arrays = [value(d["seed"], r, (d["rows"][r],) + d["inner"][:1], dt) for r in members]
        want, tol = np.concatenate(arrays), 0

        def fn():
            return [hvd_keras.allgather(arrays[me_in], name=d["name"])]
    elif which == "broadcast":
        shape = (d["rows"][0] + 1,) + d["inner"]
        mine, want, tol = value(d["seed"], ME, shape, dt), value(d["seed"], d["root"], shape, dt), 0

        def fn():
            return [hvd_keras.broadcast(mine, d["root"], name=d["name"])]
    else:
        dt = d["dtype"] if d["dtype"] in REDUCIBLE else tf.float32
        rows = d["rows"][0] + n
        arrays = [value(d["seed"], r, (rows,) + d["inner"], dt) for r in members]
        start, count = share(rows, members, me_in)
        op = d["op"]
        want = reduce(op, arrays, (1.0, 1.0))[start:start + count]
        tol = tolerance(dt, op)

        def fn():
            return [hvd_keras.reducescatter(arrays[me_in], name=d["name"], op=op)]
    label = dict(label, keras=which, dtype=dt)
    return fn, [], lambda got: close(got[0], want, label, tol)


def build_adasum(d, label, members, me_in):
    """Adasum of equal vectors is the vector; of orthogonal ones, their sum.
    (Horovod 0.28.1 on CPU refuses a number of ranks that is not a power of
    2; the coordinator runs it at any number, as its README says.) A process
    set other than the global one is a NotImplementedError, as in Horovod."""
    dt, n = d["dtype"], len(members)
    equal = d["sparse_mix"]
    if equal:
        arrays = [value(d["seed"], 0, (n + 1,), dt) for _ in members]
        want = arrays[0]
    else:
        arrays = []
        for i in range(n):
            a = np.zeros(n + 1, npdt(dt))
            a[i] = i + 1
            arrays.append(a)
        want = np.sum(np.stack(arrays).astype(np.float64), axis=0).astype(npdt(dt))
    if SETS[d["set"]] is not hvd.global_process_set:
        d["expect"] = (NotImplementedError, "Adasum does not support non-global process sets")

    def fn(x):
        return [hvd.allreduce(x, op=hvd.Adasum, name=d["name"], process_set=SETS[d["set"]])]
    return fn, [tf.constant(arrays[me_in])], lambda got: close(
        got[0], want, (label, "adasum", dt, equal), 1e-2 if dt == tf.float16 else 1e-6)


def tape_data(seed, rank, batch, dt):
    rng = np.random.default_rng(seed * 17 + rank)
    x = rng.integers(0, 3, (batch, 3)).astype(npdt(dt))
    ids = rng.integers(0, 4, (batch,)).astype(np.int64)
    y = rng.integers(0, 3, (batch, 1)).astype(npdt(dt))
    return x, ids, y


def tape_loss(w, emb, x, ids, y):
    pred = tf.matmul(x, w) + tf.reduce_sum(tf.gather(emb, ids), axis=1, keepdims=True)
    return tf.reduce_mean((pred - y) ** 2)


def build_tape(d, label, members, me_in, ps):
    """DistributedGradientTape over a linear model with an embedding: with
    equal batches per member, the averaged gradient is the full batch's."""
    dt, n, opts = d["dtype"], len(members), d["tape"]
    rng = np.random.default_rng(d["seed"])
    w0 = (rng.integers(-2, 3, (3, 1)) / 2).astype(npdt(dt))
    e0 = (rng.integers(-2, 3, (4, 2)) / 2).astype(npdt(dt))
    data = {r: tape_data(d["seed"], r, opts["batch"], dt) for r in members}
    full = [np.concatenate([data[r][k] for r in members]) for k in range(3)]
    w_full, e_full = tf.Variable(w0), tf.Variable(e0)
    with tf.GradientTape() as tape:
        loss = tape_loss(w_full, e_full, *[tf.constant(a) for a in full])
    want = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, [w_full, e_full])]
    if opts["op"] is hvd.Sum:
        want = [g * npdt(dt)(n) for g in want]
    w, emb = tf.Variable(w0), tf.Variable(e0)
    groups = opts["groups"]
    if groups == "list":
        groups = [[w]]
    compression = d["compression"]
    predivide = opts["predivide"] if opts["op"] is hvd.Average else 1.0

    def fn(x, ids, y):
        with tf.GradientTape() as tape:
            loss = tape_loss(w, emb, x, ids, y)
        tape = hvd.DistributedGradientTape(
            tape, compression=compression, sparse_as_dense=opts["sparse_as_dense"],
            op=opts["op"], gradient_predivide_factor=predivide, groups=groups, process_set=ps)
        gw, gemb = tape.gradient(loss, [w, emb])
        assert isinstance(gemb, tf.IndexedSlices) != opts["sparse_as_dense"], (
            label, opts, type(gemb))
        return [gw, tf.convert_to_tensor(gemb)]

    tol = 1e-2 if compression is hvd.Compression.fp16 else 1e-5
    if predivide != 1.0 and not opts["sparse_as_dense"]:
        # Horovod 0.28.1: an IndexedSlices takes no pre/postscale factor
        d["expect"] = (NotImplementedError, "Pre/postscale_factor are not supported")

    def check(got):
        for k in range(2):
            close(got[k], want[k], (label, "tape", k, dt, opts, compression), tol)
    return fn, [tf.constant(a) for a in data[ME]], check


def run_objects(d):
    ps, members = SETS[d["set"]], d["members"]
    obj = {"rank": ME, "seed": d["seed"], "pad": "x" * (d["seed"] % 7 + ME)}
    got = hvd.allgather_object(obj, name=d["name"], process_set=ps)
    want = [{"rank": r, "seed": d["seed"], "pad": "x" * (d["seed"] % 7 + r)} for r in members]
    assert got == want, (d["kind"], d["set"], d["name"], got, want)
    got = hvd.broadcast_object(obj if ME == d["root"] else None, root_rank=d["root"],
                               name=d["name"] and d["name"] + "b", process_set=ps)
    assert got == want[members.index(d["root"])], (d["set"], d["root"], got)


TRACE = os.environ.get("TRACE")


def run_one(d):
    if TRACE:
        print(ME, "op", d["kind"], d["set"], d["mode"], d["name"], file=sys.stderr, flush=True)
    if d["kind"] == "objects":
        run_objects(d)
        return
    fn, inputs, check = build(d)
    if d["mode"] == "eager":
        run = fn
    elif d["kind"] == "gradient":
        # The same static shapes on every rank: TensorFlow builds a gradient
        # graph after them (Mul's gradient reshapes or not), and the unnamed
        # collective in the gradient is named after its input tensor, as in
        # Horovod, so rank-specific shapes gave the ranks different names.
        run = tf.function(fn, input_signature=[
            tf.TensorSpec([None] * len(t.shape), t.dtype) for t in inputs])
    else:
        run = tf.function(fn)
    if d.get("expect"):
        kind, text = d["expect"]
        try:
            run(*inputs)
        except kind as exc:
            assert text in str(exc), (d["kind"], d["set"], d["mode"], str(exc))
            return
        raise AssertionError(f"{d['kind']} {d['set']} {d['mode']}: no {kind.__name__}")
    before = [np.array(t.numpy(), copy=True) for t in inputs]
    out = run(*inputs)
    untouched(d, inputs, before)
    check([np.array(t.numpy(), copy=True) for t in out])


def untouched(d, inputs, before):
    """The inputs are as they were; then every tf.Variable input is
    overwritten, which must not change a result (check() reads the results
    after this)."""
    for k, (t, b) in enumerate(zip(inputs, before)):
        close(t.numpy(), b, (d["kind"], d["set"], d["mode"], d["name"], "input changed", k), 0)
        if isinstance(t, tf.Variable):
            t.assign(tf.zeros_like(t))


def run_fused(mine):
    if TRACE:
        print(ME, "fused", [(d["kind"], d["set"]) for d in mine], file=sys.stderr, flush=True)
    built = [build(d) for d in mine]

    @tf.function
    def all_of_them():
        return [fn(*inputs) for fn, inputs, _ in built]
    before = [[np.array(t.numpy(), copy=True) for t in inputs] for _, inputs, _ in built]
    outs = all_of_them()
    for d, (_, inputs, _), b in zip(mine, built, before):
        untouched(d, inputs, b)
    for (_, _, check), out in zip(built, outs):
        check([np.array(t.numpy(), copy=True) for t in out])


def order(rng, mine):
    """This rank's own order: between global operations, 'pair' and 'tail'
    operations interleave at random where those sets share at most a rank."""
    if len(set(SETS["pair"].ranks) & set(SETS["tail"].ranks)) > 1:
        return mine
    out, segment = [], []

    def flush():
        pair = [d for d in segment if d["set"] == "pair"]
        tail = [d for d in segment if d["set"] == "tail"]
        slots = set(rng.sample(range(len(segment)), len(pair)))
        p, t = iter(pair), iter(tail)
        out.extend(next(p) if i in slots else next(t) for i in range(len(segment)))
        segment.clear()
    for d in mine:
        if d["set"] == "global":
            flush()
            out.append(d)
        else:
            segment.append(d)
    flush()
    return out


def run_step(step):
    shared = random.Random(SEED * 1_000_003 + step)
    fused = shared.random() < 0.25
    kinds = KINDS or (FUSABLE if fused else ALL_KINDS)
    if fused:
        kinds = [k for k in kinds if k in FUSABLE] or list(FUSABLE)
    drawn = [draw(shared, step, i, kinds) for i in range(shared.randint(1, 5))]
    if fused:
        for i, d in enumerate(drawn):
            d["name"] = f"f{step}.{i}"
    mine = order(random.Random(SEED * 7919 + step * 31 + ME),
                 [d for d in drawn if ME in d["members"]])
    if fused and mine:
        run_fused(mine)
    else:
        for d in mine:
            run_one(d)


for step in range(STEPS):
    run_step(step)
hvd.barrier()
hvd.shutdown()
print("OK", ME, STEPS, flush=True)
