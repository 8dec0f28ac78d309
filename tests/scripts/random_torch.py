"""Random steps of frontends.torch's collectives, checked against torch on
every rank.

Each step draws, from a seed every rank shares, a few operations: every
variant (`_async`, in place `_async_`, grouped, grouped in place) of
allreduce, allgather, broadcast, alltoall and reducescatter, in every torch
dtype the frontend takes (bfloat16 and bool included), with prescale and
postscale factors, on the global set or a process set, named or unnamed.
Input tensors are often views into a larger tensor (a slice, so with a
storage offset; a 0-d element; every other element, or a transposed view,
which are not contiguous): an in-place result must land in the view and
leave the rest of the storage as it was. Each rank submits its share in
its own random order (unnamed operations keep their order within a set, as
Horovod requires), then synchronizes and checks every result.

With BAD (a probability) an operation gets, on one member, a tensor the
frontend refuses (a dtype it cannot move, or an in-place target whose
elements share memory): a ValueError there at once, and a HorovodInternalError naming that
rank on every other member; the rest of the step goes on.

Usage: mpirun -n N python random_torch.py SEED STEPS (N >= 3).
Prints "OK <rank> <steps>" at the end.
"""

import os
import random
import sys

import torch
from mpi4py import MPI

import frontends.torch as hvd

SEED, STEPS = int(sys.argv[1]), int(sys.argv[2])
BAD = float(os.environ.get("BAD", "0"))
SIZE = MPI.COMM_WORLD.size
SETS = {"global": hvd.global_process_set, "pair": hvd.ProcessSet([0, 1]),
        "tail": hvd.ProcessSet([SIZE - 2, SIZE - 1])}
hvd.init(process_sets=[SETS["pair"], SETS["tail"]])
ME = hvd.rank()

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
REDUCTIONS = (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product)


def value(seed, rank, shape, dtype):
    """Rank `rank`'s tensor: values 1 and 2, so sums and products stay exact."""
    g = torch.Generator().manual_seed(seed * 131 + rank)
    t = torch.randint(1, 3, shape, generator=g)
    return t.bool() if dtype is torch.bool else t.to(dtype)


def scaled(t, factor, divisor=1):
    """t * factor / divisor by the core's rule: integers in float64, dividing
    last, rounded toward zero; 16-bit floats in float32."""
    if factor == 1.0 and divisor == 1:
        return t
    if not t.dtype.is_floating_point:
        return (t.double() * factor / divisor).to(t.dtype)
    if t.dtype in (torch.float16, torch.bfloat16):
        return (t.float() * torch.tensor(factor / divisor, dtype=torch.float32)).to(t.dtype)
    return t * torch.tensor(factor / divisor, dtype=t.dtype)


def reduce(op, tensors, scales):
    pre, post = scales
    stack = torch.stack([scaled(t, pre) for t in tensors])
    if op is hvd.Min:
        result = stack.min(dim=0).values
    elif op is hvd.Max:
        result = stack.max(dim=0).values
    elif op is hvd.Product:
        result = stack.double().prod(dim=0).to(stack.dtype)
    else:
        result = stack.double().sum(dim=0).to(stack.dtype)
    return scaled(result, post, len(tensors) if op is hvd.Average else 1)


def placed(tensor, how):
    """`tensor` as the frontend gets it: alone, or as a view into a larger
    tensor (a slice, one element, every other element, a transposed view),
    which is not contiguous for the last two. Returns (input, the larger
    tensor or None, the function taking the view from it)."""
    if how == "element" and tensor.numel() != 1 or how == "transposed" and tensor.dim() < 2:
        how = "slice"
    if how == "alone" or tensor.dim() == 0 and how != "element":
        return tensor.clone(), None, None
    if how == "element":
        big = torch.zeros(3, dtype=tensor.dtype)

        def view(b):
            return b[1].reshape(tensor.shape)
    elif how == "slice":
        big = torch.zeros((tensor.shape[0] + 2,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)

        def view(b):
            return b[1:1 + tensor.shape[0]]
    elif how == "strided":
        big = torch.zeros(2 * tensor.numel(), dtype=tensor.dtype)
        strides = [2 * st for st in tensor.contiguous().stride()]

        def view(b):
            return b.as_strided(tensor.shape, strides)
    else:
        big = torch.zeros(tensor.transpose(-1, -2).shape, dtype=tensor.dtype)

        def view(b):
            return b.transpose(-1, -2)
    view(big).copy_(tensor)
    return view(big), big, view


def draw(rng, step, i):
    kind = rng.choice(KINDS)
    set_name = rng.choice(sorted(SETS))
    members = SETS[set_name].ranks
    if kind in ("allreduce", "reducescatter"):
        dtype = rng.choice(FLOATS + INTS)
    else:
        dtype = rng.choice(FLOATS + INTS + (torch.bool,))
    op = rng.choice(REDUCTIONS if kind == "allreduce" else (hvd.Sum, hvd.Average))
    scales = (1.0, 1.0)
    if rng.random() < 0.5:
        scales = (rng.choice((0.5, 1.0) if op is hvd.Product else (0.5, 1.0, 2.0)),
                  rng.choice((0.5, 1.0, 2.0, 3.0)))
    bad = None
    if rng.random() < BAD:
        bad = (rng.choice(("overlapping", "dtype")), rng.choice(members))
    return dict(
        kind=kind, set=set_name, members=members, dtype=dtype, op=op, scales=scales,
        name=f"s{step}.{i}" if rng.random() < 0.7 else None,
        grouped=kind in ("allreduce", "allgather", "reducescatter") and rng.random() < 0.4,
        inplace=kind in ("allreduce", "broadcast") and rng.random() < 0.5,
        count=rng.randint(1, 3), inner=tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 2))),
        rows={r: rng.randint(0, 3) for r in members}, root=rng.choice(members),
        splits={r: [rng.randint(0, 2) for _ in members] for r in members},
        scalar=kind in ("allreduce", "broadcast") and rng.random() < 0.15,
        place=rng.choice(("alone", "slice", "element", "strided", "transposed")),
        seed=rng.randrange(1 << 30), bad=bad)


def spoil(d, tensor):
    how, rank = d["bad"] or (None, None)
    if rank != ME:
        return tensor
    if how == "overlapping" and d["inplace"] and tensor.numel() > 1:
        # every element in one place: no in-place result can be written there
        return torch.zeros((1,) * tensor.dim(), dtype=tensor.dtype).expand(tensor.shape)
    return torch.zeros(tensor.shape, dtype=torch.complex64)  # no collective takes it


def submit(d):
    """Starts this rank's part of `d`. Returns (handle, check), where check()
    verifies the synchronized result, or (None, the ValueError)."""
    try:
        return _submit(d)
    except ValueError as exc:
        return None, exc


def _submit(d):
    members, dtype, ps, kind = d["members"], d["dtype"], SETS[d["set"]], d["kind"]
    me_in = members.index(ME)
    n = d["count"] if d["grouped"] else 1
    if kind in ("allreduce", "broadcast"):
        shape = () if d["scalar"] else (d["rows"][members[0]] + 1,) + d["inner"]
    if kind == "allreduce":
        ts = [[value(d["seed"] + k, r, shape, dtype) for r in members] for k in range(n)]
        want = [reduce(d["op"], t, d["scales"]) for t in ts]
        args = dict(name=d["name"], op=d["op"], prescale_factor=d["scales"][0],
                    postscale_factor=d["scales"][1], process_set=ps)
        ins = [placed(t[me_in], d["place"]) for t in ts]
        fn = {(False, False): hvd.allreduce_async, (False, True): hvd.allreduce_async_,
              (True, False): hvd.grouped_allreduce_async,
              (True, True): hvd.grouped_allreduce_async_}[(d["grouped"], d["inplace"])]
        tensors = [spoil(d, t) for t, _, _ in ins]
        handle = fn(tensors if d["grouped"] else tensors[0], **args)
        return handle, lambda result: _check_outputs(d, result, want, ins)
    if kind == "allgather":
        ts = [[value(d["seed"] + k, r, (d["rows"][r],) + d["inner"], dtype) for r in members]
              for k in range(n)]
        want = [torch.cat(t) for t in ts]
        mine = [spoil(d, t[me_in]) for t in ts]
        if d["grouped"]:
            handle = hvd.grouped_allgather_async(mine, name=d["name"], process_set=ps)
        else:
            handle = hvd.allgather_async(mine[0], name=d["name"], process_set=ps)
        return handle, lambda result: _check_outputs(d, result, want, None)
    if kind == "broadcast":
        root = value(d["seed"], d["root"], shape, dtype)
        src = root.clone() if ME == d["root"] else torch.zeros(shape, dtype=dtype)
        ins = [placed(src, d["place"])]
        fn = hvd.broadcast_async_ if d["inplace"] else hvd.broadcast_async
        handle = fn(spoil(d, ins[0][0]), d["root"], name=d["name"], process_set=ps)
        return handle, lambda result: _check_outputs(d, result, [root], ins)
    if kind == "alltoall":
        splits = d["splits"]
        sent = {r: value(d["seed"], r, (sum(splits[r]) + 1,) + d["inner"], dtype)
                for r in members}
        pieces = [sent[r][sum(splits[r][:me_in]):sum(splits[r][:me_in + 1])] for r in members]
        want = (torch.cat(pieces), [splits[r][me_in] for r in members])
        handle = hvd.alltoall_async(spoil(d, sent[ME]),
                                    splits=torch.tensor(splits[ME], dtype=torch.int32),
                                    name=d["name"], process_set=ps)
        return handle, lambda result: _check_alltoall(d, result, want)
    rows = d["rows"][members[0]] + len(members)
    ts = [[value(d["seed"] + k, r, (rows,) + d["inner"], dtype) for r in members]
          for k in range(n)]
    base, extra = divmod(rows, len(members))
    start = me_in * base + min(me_in, extra)
    count = base + (1 if me_in < extra else 0)
    want = [reduce(d["op"], t, d["scales"])[start:start + count] for t in ts]
    mine = [spoil(d, t[me_in]) for t in ts]
    args = dict(name=d["name"], op=d["op"], prescale_factor=d["scales"][0],
                postscale_factor=d["scales"][1], process_set=ps)
    if d["grouped"]:
        handle = hvd.grouped_reducescatter_async(mine, **args)
    else:
        handle = hvd.reducescatter_async(mine[0], **args)
    return handle, lambda result: _check_outputs(d, result, want, None)


def _check_outputs(d, result, want, ins):
    label = (d["name"], d["kind"], d["dtype"], d["op"], d["scales"], d["place"])
    got = list(result) if d["grouped"] else [result]
    assert len(got) == len(want), (label, len(got), len(want))
    for k, (g, w) in enumerate(zip(got, want)):
        assert isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape, (
            label, type(g), getattr(g, "dtype", None), getattr(g, "shape", None), w.shape)
        if d["op"] is hvd.Average and w.dtype.is_floating_point and d["kind"] != "broadcast":
            tol = 1e-2 if w.dtype in (torch.float16, torch.bfloat16) else 1e-6
            assert torch.allclose(g.double(), w.double(), rtol=tol, atol=0), (label, g, w)
        else:
            assert torch.equal(g, w), (label, g, w)
        if ins is None:
            continue
        tensor, big, view = ins[k]
        if d["inplace"]:
            assert g is tensor, (label, "an in-place result is not the input tensor")
        if big is not None:
            # the larger tensor: the result in its view (in place); zeros
            # around it, as before
            around = big.clone()
            view(around).zero_()
            assert not around.any(), (label, "an in-place write spilled", big)
            if d["inplace"]:
                assert torch.equal(view(big), w), (label, big, w)


def _check_alltoall(d, result, want):
    output, received = result
    assert received.dtype == torch.int32 and received.tolist() == want[1], (
        d["name"], received, want[1])
    assert output.dtype == want[0].dtype and torch.equal(output, want[0]), (
        d["name"], output, want[0])


def check_failed(d, handle, refused):
    how, rank = d["bad"]
    if rank == ME:
        assert handle is None and isinstance(refused, ValueError), (d, handle, refused)
        return
    assert handle is not None, (d, refused)
    try:
        hvd.synchronize(handle)
    except hvd.HorovodInternalError as exc:
        assert f"rank {rank}" in str(exc), (d, str(exc))
    else:
        raise AssertionError(f"{d}: bad input on rank {rank} ({how}), yet it ran")


def order(rng, mine):
    """This rank's own order; unnamed operations keep theirs within a set."""
    named = [d for d in mine if d["name"]]
    rng.shuffle(named)
    unnamed = [d for d in mine if not d["name"]]
    slots = sorted(rng.sample(range(len(mine)), len(unnamed)))
    out, u = [], iter(unnamed)
    n = iter(named)
    for i in range(len(mine)):
        out.append(next(u) if i in slots else next(n))
    return out


def run_step(step):
    shared = random.Random(SEED * 1_000_003 + step)
    drawn = [draw(shared, step, i) for i in range(shared.randint(1, 6))]
    mine = order(random.Random(SEED * 7919 + step * 31 + ME),
                 [d for d in drawn if ME in d["members"]])
    pending = [(d,) + submit(d) for d in mine]
    for d, handle, then in pending:
        if d["bad"] is not None:
            check_failed(d, handle, then)
            continue
        assert handle is not None, (d, then)
        result = hvd.synchronize(handle)
        then(result)


for step in range(STEPS):
    run_step(step)
hvd.barrier()
hvd.shutdown()
print("OK", ME, STEPS, flush=True)
