"""Model and object helpers: broadcast_parameters, broadcast_optimizer_state,
broadcast_object, allgather_object."""

import torch

from coordinator import objects
from coordinator.process_sets import global_process_set
from frontends.torch.mpi_ops import broadcast_async_, rank, synchronize


def broadcast_parameters(params, root_rank):
    """Overwrites tensors on every rank with root_rank's, in place.

    params: a dict (e.g. `model.state_dict()`, processed in sorted key
    order, keys used as names) or a list of tensors or (name, tensor) pairs
    (e.g. `model.named_parameters()` as a list)."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = [broadcast_async_(p, root_rank, name) for name, p in items]
    for handle in handles:
        synchronize(handle)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """root_rank's `obj` (pickled with cloudpickle) on every rank; one
    exchange on the core (coordinator/objects.py). Unlike Horovod's, the
    default name does not depend on `obj`'s type, so the others may pass
    None."""
    return objects.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's `obj` (pickled with cloudpickle), in rank order; one
    exchange on the core."""
    return objects.allgather_object(obj, name, process_set)


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """Makes every rank's optimizer state and hyper-parameters (lr, momentum,
    ...) identical to root_rank's.

    A rank whose optimizer has no state yet first creates it as Horovod
    does: every parameter that requires grad gets a zero `.grad` (sparse for
    SparseAdam, and for SGD on the sparse nn.Embedding modules of `model`)
    and the optimizer takes one local step, with no reduction even when
    wrapped in DistributedOptimizer. Unlike Horovod, the parameters are put
    back after that step, so weight decay on the zero gradient cannot move
    them. L-BFGS, whose step needs a closure, is sent as it stands (Horovod
    refuses it).

    The root then sends the state's structure (nesting, scalars, each
    tensor's shape and dtype) as one pickled object; every state tensor goes
    by in-place broadcast (a sparse one as its indices and values); other
    ranks load the result with load_state_dict. The hyper-parameters are
    sent even when the optimizer keeps no state."""
    if not isinstance(optimizer, torch.optim.LBFGS) and not optimizer.state_dict()["state"]:
        _create_state(optimizer, _sparse_embedding_params(model))
    state_dict = optimizer.state_dict()
    is_root = rank() == root_rank
    tensors = []
    skeleton = _strip_tensors(state_dict, tensors) if is_root else None
    skeleton = broadcast_object(skeleton, root_rank, name="optimizer_state.skeleton")
    if not is_root:
        tensors = []
        state_dict = _rebuild(skeleton, tensors)
    handles = [broadcast_async_(t, root_rank, name=f"optimizer_state.{i}")
               for i, t in enumerate(tensors)]
    for handle in handles:
        synchronize(handle)
    if not is_root:
        optimizer.load_state_dict(_assemble(state_dict))


def _sparse_embedding_params(model):
    """ids of the parameters of model's sparse nn.Embedding modules."""
    if model is None:
        return set()
    return {id(p) for m in model.modules()
            if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}


def _create_state(optimizer, sparse_ids):
    """Horovod's state-creating step on a fresh optimizer (zero gradients,
    one local step), with the parameters restored afterwards."""
    sparse_all = isinstance(optimizer, torch.optim.SparseAdam)
    sparse_sgd = isinstance(optimizer, torch.optim.SGD)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                grad = torch.zeros_like(p)
                sparse = sparse_all or (sparse_sgd and id(p) in sparse_ids)
                p.grad = grad.to_sparse() if sparse else grad
    saved = [(p, p.detach().clone()) for group in optimizer.param_groups
             for p in group["params"] if p.grad is not None]
    # A DistributedOptimizer's own step would reduce, and only some ranks may
    # be here: take the wrapped optimizer's step.
    getattr(optimizer, "_local_step", optimizer.step)()
    with torch.no_grad():
        for p, value in saved:
            p.copy_(value)


class _TensorSlot:
    """Stands for a tensor in the pickled skeleton of a state dict."""

    def __init__(self, tensor):
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype


class _SparseSlot:
    """Stands for a sparse COO tensor: its indices and values go by as two
    dense tensors (`parts`), and it is assembled once they have arrived."""

    def __init__(self, shape, parts):
        self.shape = shape
        self.parts = parts


def _strip_tensors(obj, tensors):
    if isinstance(obj, torch.Tensor) and obj.is_sparse:
        obj = obj.detach().coalesce()
        parts = [_strip_tensors(obj.indices(), tensors), _strip_tensors(obj.values(), tensors)]
        return _SparseSlot(tuple(obj.shape), parts)
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().contiguous() if not obj.is_contiguous() else obj.detach())
        return _TensorSlot(obj)
    return _map_containers(obj, lambda v: _strip_tensors(v, tensors))


def _rebuild(obj, tensors):
    if isinstance(obj, _TensorSlot):
        t = torch.empty(obj.shape, dtype=obj.dtype)
        tensors.append(t)
        return t
    if isinstance(obj, _SparseSlot):
        return _SparseSlot(obj.shape, [_rebuild(part, tensors) for part in obj.parts])
    return _map_containers(obj, lambda v: _rebuild(v, tensors))


def _assemble(obj):
    """Turns the sparse slots _rebuild left (their parts now received) into
    sparse tensors."""
    if isinstance(obj, _SparseSlot):
        return torch.sparse_coo_tensor(*obj.parts, obj.shape, is_coalesced=True)
    return _map_containers(obj, _assemble)


def _map_containers(obj, fn):
    """Applies fn to the items of a dict, list or tuple (in order); other
    objects are returned as they are."""
    if isinstance(obj, dict):
        return {k: fn(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [fn(v) for v in obj]
    if isinstance(obj, tuple):
        items = [fn(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj
