"""The differentiable blocking collectives: allreduce, allgather, broadcast,
alltoall, reducescatter and their grouped forms.

One autograd Function (`_Collective`) runs a "rule": the rule's forward is a
collective from mpi_ops, its backward is Horovod's gradient for it:

* allreduce (Sum, Average, Adasum): allreduce the gradient with the same op
  and scale factors. Min and Max, where Horovod's rule does not give a
  gradient, route the summed gradient to the ranks that held the extreme
  value (split evenly on ties); Product gives each rank the summed gradient
  times the product of the other ranks' values. Those three are defined for
  prescale = postscale = 1.
* allgather: average the gradient over the set, keep this rank's rows.
* broadcast: average the gradient over the set on the root, zero elsewhere.
* alltoall: send the gradient back with the received splits.
* reducescatter: scale the gradient (by the set size for Sum, and by the
  scale factors), then allgather it.
"""

import torch

from coordinator.collectives import handle_average_backwards_compatibility
from coordinator.process_sets import global_process_set
from frontends.torch import mpi_ops
from frontends.torch.compression import Compression
from frontends.torch.mpi_ops import Adasum, Average, Max, Min, Product, Sum, synchronize


class _Collective(torch.autograd.Function):
    """Runs `rule.forward` and, in backward, `rule.backward`."""

    @staticmethod
    def forward(ctx, rule, *tensors):
        ctx.rule = rule
        return tuple(rule.forward(ctx, tensors))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.rule.backward(ctx, [g.contiguous() for g in grads]))


def _run(impl, tensors, *args, grouped, **kwargs):
    result = synchronize(impl(list(tensors), *args, grouped=grouped, inplace=False, **kwargs))
    return result if grouped else (result,)


class _Allreduce:
    def __init__(self, grouped, name, op, prescale, postscale, process_set):
        self.grouped = grouped
        self.name = name
        self.op = op
        self.prescale = prescale
        self.postscale = postscale
        self.process_set = process_set

    def forward(self, ctx, tensors):
        outs = _run(mpi_ops._allreduce, tensors, None, self.name, self.op, self.prescale,
                    self.postscale, self.process_set, grouped=self.grouped)
        if self.op in (Min, Max, Product):
            ctx.save_for_backward(*tensors, *outs)
        return outs

    def backward(self, ctx, grads):
        if self.op in (Sum, Average, Adasum):
            return _run(mpi_ops._allreduce, grads, None, None, self.op, self.prescale,
                        self.postscale, self.process_set, grouped=self.grouped)
        if self.prescale != 1.0 or self.postscale != 1.0:
            raise NotImplementedError("the gradient of a Min/Max/Product allreduce with "
                                      "prescale or postscale factors is not defined here")
        saved = ctx.saved_tensors
        n = len(grads)
        inputs, outputs = saved[:n], saved[n:]
        total = _run(mpi_ops._allreduce, grads, None, None, Sum, 1.0, 1.0, self.process_set,
                     grouped=self.grouped)
        if self.op == Product:
            gathered = _run(mpi_ops._allgather, [x.unsqueeze(0) for x in inputs], None,
                            self.process_set, grouped=self.grouped)
            me = self.process_set.rank()
            return [s * _product_of_others(g, me) for s, g in zip(total, gathered)]
        holders = [(x == y).to(x.dtype) for x, y in zip(inputs, outputs)]
        counts = _run(mpi_ops._allreduce, holders, None, None, Sum, 1.0, 1.0,
                      self.process_set, grouped=self.grouped)
        return [s * h / c for s, h, c in zip(total, holders, counts)]


def _product_of_others(gathered, me):
    others = torch.cat([gathered[:me], gathered[me + 1:]])
    return others.prod(dim=0)


class _Allgather:
    def __init__(self, grouped, name, process_set):
        self.grouped = grouped
        self.name = name
        self.process_set = process_set

    def forward(self, ctx, tensors):
        outs = _run(mpi_ops._allgather, tensors, self.name, self.process_set,
                    grouped=self.grouped)
        ctx.rows = [t.shape[0] for t in tensors]
        return outs

    def backward(self, ctx, grads):
        reduced = _run(mpi_ops._allreduce, grads, None, None, Average, 1.0, 1.0,
                       self.process_set, grouped=self.grouped)
        # Every rank's row counts, one row per rank: [rows of tensor 0, tensor 1, ...].
        rows = mpi_ops._allgather([torch.tensor([ctx.rows], dtype=torch.int64)], None,
                                  self.process_set, grouped=False)
        rows = synchronize(rows)
        me = self.process_set.rank()
        offsets = rows[:me].sum(dim=0).tolist()
        return [g.narrow(0, off, n) for g, off, n in zip(reduced, offsets, ctx.rows)]


class _Broadcast:
    def __init__(self, root_rank, name, process_set):
        self.root_rank = root_rank
        self.name = name
        self.process_set = process_set

    def forward(self, ctx, tensors):
        return _run(mpi_ops._broadcast, tensors, self.root_rank, self.name, self.process_set,
                    grouped=False)

    def backward(self, ctx, grads):
        (reduced,) = _run(mpi_ops._allreduce, grads, None, None, Average, 1.0, 1.0,
                          self.process_set, grouped=False)
        if mpi_ops.rank() != self.root_rank:
            reduced = torch.zeros_like(reduced)
        return [reduced]


class _Alltoall:
    def __init__(self, splits, name, process_set):
        self.splits = splits
        self.name = name
        self.process_set = process_set

    def forward(self, ctx, tensors):
        (output, received), = _run(mpi_ops._alltoall, tensors, self.splits, self.name,
                                   self.process_set, grouped=False)
        ctx.received = received
        if self.splits is None:
            return (output,)
        ctx.mark_non_differentiable(received)
        return output, received

    def backward(self, ctx, grads):
        (back, _), = _run(mpi_ops._alltoall, grads[:1], ctx.received, None, self.process_set,
                          grouped=False)
        return [back]


class _Reducescatter:
    def __init__(self, grouped, name, op, prescale, postscale, process_set):
        self.grouped = grouped
        self.name = name
        self.op = op
        self.prescale = prescale
        self.postscale = postscale
        self.process_set = process_set

    def forward(self, ctx, tensors):
        return _run(mpi_ops._reducescatter, tensors, self.name, self.op, self.process_set,
                    self.prescale, self.postscale, grouped=self.grouped)

    def backward(self, ctx, grads):
        scale = self.prescale * self.postscale
        if self.op == Sum:
            scale *= self.process_set.size()
        if scale != 1.0:
            grads = [g * scale for g in grads]
        return _run(mpi_ops._allgather, grads, None, self.process_set, grouped=self.grouped)


# ------------------------------------------- Horovod's named Functions
# horovod.torch.mpi_ops defines one autograd Function per collective, public
# by name, and some programs call them directly (`HorovodAllreduce.apply(
# tensor, average, name, op, prescale_factor, postscale_factor,
# process_set)`). These take the same `apply` arguments and run the rules
# above; backward gives None for every argument that is not a tensor.
def _apply_forward(ctx, rule, tensors):
    ctx.rule = rule
    return tuple(rule.forward(ctx, tensors))


def _apply_backward(ctx, grads, before, after):
    back = ctx.rule.backward(ctx, [g.contiguous() for g in grads])
    return (None,) * before + tuple(back) + (None,) * after


class HorovodAllreduce(torch.autograd.Function):
    """apply(tensor, average, name, op, prescale_factor, postscale_factor, process_set)"""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        op = handle_average_backwards_compatibility(op, average)
        rule = _Allreduce(False, name, op, prescale_factor, postscale_factor, process_set)
        return _apply_forward(ctx, rule, (tensor,))[0]

    @staticmethod
    def backward(ctx, grad_output):
        return _apply_backward(ctx, [grad_output], 0, 6)


class HorovodGroupedAllreduce(torch.autograd.Function):
    """apply(average, name, op, prescale_factor, postscale_factor, process_set, *tensors)"""

    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set,
                *tensors):
        op = handle_average_backwards_compatibility(op, average)
        rule = _Allreduce(True, name, op, prescale_factor, postscale_factor, process_set)
        return _apply_forward(ctx, rule, tensors)

    @staticmethod
    def backward(ctx, *grad_outputs):
        return _apply_backward(ctx, grad_outputs, 6, 0)


class HorovodAllgather(torch.autograd.Function):
    """apply(tensor, name, process_set)"""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        return _apply_forward(ctx, _Allgather(False, name, process_set), (tensor,))[0]

    @staticmethod
    def backward(ctx, grad_output):
        return _apply_backward(ctx, [grad_output], 0, 2)


class HorovodGroupedAllgather(torch.autograd.Function):
    """apply(name, process_set, *tensors)"""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        return _apply_forward(ctx, _Allgather(True, name, process_set), tensors)

    @staticmethod
    def backward(ctx, *grad_outputs):
        return _apply_backward(ctx, grad_outputs, 2, 0)


class HorovodBroadcast(torch.autograd.Function):
    """apply(tensor, root_rank, name, process_set)"""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        return _apply_forward(ctx, _Broadcast(root_rank, name, process_set), (tensor,))[0]

    @staticmethod
    def backward(ctx, grad_output):
        return _apply_backward(ctx, [grad_output], 0, 3)


class HorovodAlltoall(torch.autograd.Function):
    """apply(tensor, splits, name, process_set): the output, or (output,
    received_splits) when splits is given, as Horovod's."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        outs = _apply_forward(ctx, _Alltoall(splits, name, process_set), (tensor,))
        return outs[0] if splits is None else outs

    @staticmethod
    def backward(ctx, grad_output, *dead_gradients):
        return _apply_backward(ctx, [grad_output], 0, 3)


class HorovodReducescatter(torch.autograd.Function):
    """apply(tensor, name, op, process_set, prescale_factor, postscale_factor)"""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        rule = _Reducescatter(False, name, op, prescale_factor, postscale_factor, process_set)
        return _apply_forward(ctx, rule, (tensor,))[0]

    @staticmethod
    def backward(ctx, grad_output):
        return _apply_backward(ctx, [grad_output], 0, 5)


class HorovodGroupedReducescatter(torch.autograd.Function):
    """apply(name, op, process_set, prescale_factor, postscale_factor, *tensors)"""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        rule = _Reducescatter(True, name, op, prescale_factor, postscale_factor, process_set)
        return _apply_forward(ctx, rule, tensors)

    @staticmethod
    def backward(ctx, *grad_outputs):
        return _apply_backward(ctx, grad_outputs, 5, 0)


# ------------------------------------------------------------ public forms
def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduces `tensor` over the process set and returns a new tensor;
    differentiable. op: Average (default), Sum, Min, Max, Product, Adasum."""
    op = handle_average_backwards_compatibility(op, average)
    compressed, ctx = compression.compress(tensor)
    rule = _Allreduce(False, name, op, prescale_factor, postscale_factor, process_set)
    (out,) = _Collective.apply(rule, compressed)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """Reduces a list of tensors as one unit; returns a list; differentiable."""
    op = handle_average_backwards_compatibility(op, average)
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    rule = _Allreduce(True, name, op, prescale_factor, postscale_factor, process_set)
    outs = _Collective.apply(rule, *compressed)
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenates every rank's `tensor` along dimension 0 (sizes may differ);
    differentiable."""
    (out,) = _Collective.apply(_Allgather(False, name, process_set), tensor)
    return out


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Gathers a list of tensors as one unit; returns a tuple; differentiable."""
    return _Collective.apply(_Allgather(True, name, process_set), *tensors)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Returns `tensor` as held by `root_rank` (a global rank); differentiable."""
    (out,) = _Collective.apply(_Broadcast(root_rank, name, process_set), tensor)
    return out


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Sends splits[i] rows of `tensor` to rank i of the set (even split when
    None). Returns the output, or (output, received_splits) when splits is
    given; differentiable."""
    outs = _Collective.apply(_Alltoall(splits, name, process_set), tensor)
    return outs[0] if splits is None else outs


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces `tensor` (Sum or Average) and returns this rank's share of
    dimension 0; differentiable."""
    compressed, ctx = compression.compress(tensor)
    rule = _Reducescatter(False, name, op, prescale_factor, postscale_factor, process_set)
    (out,) = _Collective.apply(rule, compressed)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """A reducescatter of a list of tensors as one unit; returns a list."""
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    rule = _Reducescatter(True, name, op, prescale_factor, postscale_factor, process_set)
    outs = _Collective.apply(rule, *compressed)
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]
