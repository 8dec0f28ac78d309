"""DistributedOptimizer: wraps any torch.optim.Optimizer so that step()
applies gradients averaged (or summed, or Adasum-combined) over the ranks.

A hook on each parameter fires the moment autograd has accumulated its
gradient and submits an in-place allreduce of it, so communication overlaps
the rest of backward; step() (or synchronize()) waits for them and then runs
the wrapped optimizer's own step. With backward_passes_per_step=N the hook
submits on the N-th accumulation only. Parameters that got no gradient on
this rank are reduced as zeros, because other ranks may have one (Horovod's
rule). Parameter groups added later with add_param_group are hooked too.

The returned object is an instance of a subclass of the optimizer's class
(isinstance(opt, torch.optim.SGD) holds) that shares the optimizer's
parameter groups, state and defaults.
"""

import functools
import os
import warnings
import weakref
from contextlib import contextmanager

import torch

from coordinator import collectives as _core_collectives
from coordinator.process_sets import global_process_set
from frontends.torch.compression import Compression
from frontends.torch.functions import broadcast_object
from frontends.torch.mpi_ops import (Adasum, Average, allreduce_async_,
                                     grouped_allreduce_async_, size, sparse_allreduce_async,
                                     synchronize)

_TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate "
                    "gradients locally.")
_ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before "
                   "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                   "cause a race condition.")


def _split_list(items, n):
    """n nearly equal consecutive chunks of items."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


class _HookedOptimizer:
    """What both distributed optimizers share: naming parameters, counting
    backward passes per parameter, and hooking gradient accumulation."""

    def _setup_names(self, named_parameters):
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                                for i, group in enumerate(self.param_groups)
                                for j, v in enumerate(group["params"])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        seen, dups = set(), set()
        for name, _ in named_parameters:
            (dups if name in seen else seen).add(name)
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. Found "
                             f"duplicates: {', '.join(sorted(dups))}")
        named_ids = {id(v) for _, v in named_parameters}
        unnamed = [id(v) for g in self.param_groups for v in g["params"] if id(v) not in named_ids]
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters "
                             "were not named. Python object ids: "
                             f"{', '.join(str(i) for i in unnamed)}")
        self._parameter_names = {v: k for k, v in named_parameters}
        self._allreduce_delay = {v: self.backward_passes_per_step for _, v in named_parameters}

    def _name_new_group(self, group_index, group):
        for j, p in enumerate(group["params"]):
            if p not in self._parameter_names:
                self._parameter_names[p] = f"allreduce.noname.{group_index}.{j}"
            self._allreduce_delay.setdefault(p, self.backward_passes_per_step)

    def _hook(self, p):
        """Hooks p's gradient accumulation. The hook lives on the parameter
        but holds this optimizer weakly, and goes with it: a model wrapped
        again by a new DistributedOptimizer (after the old one is dropped)
        is reduced once, by the new one (as Horovod's hooks, held only by its
        optimizer, go with it)."""
        owner = weakref.ref(self)

        def hook(_):
            opt = owner()
            if opt is not None:
                opt._on_gradient(p)

        self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))
        self._requires_update.add(p)

    def _start_hooks(self):
        """This wrapper's own list of hook handles (not one copied with a
        wrapped DistributedOptimizer's __dict__), emptied when it goes."""
        self._hook_handles = []
        weakref.finalize(self, _remove_hooks, self._hook_handles)

    def _count_pass(self, p):
        """Counts one backward pass of p; True when p's gradient is complete."""
        if self._allreduce_delay[p] <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        self._allreduce_delay[p] -= 1
        return self._allreduce_delay[p] == 0

    def set_backward_passes_per_step(self, passes):
        """Sets how many backward passes accumulate locally before a reduction."""
        self.backward_passes_per_step = passes
        self._complete = 0
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def zero_grad(self, *args, **kwargs):
        if self._handles:
            raise AssertionError(_ZERO_GRAD_RACE)
        return super().zero_grad(*args, **kwargs)

    def _local_step(self):
        """The wrapped optimizer's own step, with no reduction (the step
        broadcast_optimizer_state takes to create a fresh state, which only
        some ranks may take)."""
        return super(_HookedOptimizer, self).step()

    def load_state_dict(self, *args, **kwargs):
        self._handles = {}
        self._complete = 0
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        return super().load_state_dict(*args, **kwargs)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if getattr(self, "_hooks_ready", False):
            index = len(self.param_groups) - 1
            self._name_new_group(index, self.param_groups[index])
            self._hook_group(self.param_groups[index])


class _DistributedOptimizer(_HookedOptimizer):
    def _setup(self, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set):
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self._setup_names(named_parameters)
        self._start_hooks()
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._handles = {}
        self._requires_update = set()
        self._complete = 0  # parameters whose gradient was submitted this step
        self._synchronized = False
        self._should_synchronize = True
        if groups is not None:
            if not (isinstance(groups, list) or groups > 0):
                raise ValueError("groups should be a non-negative integer or a list of list of "
                                 "torch.Tensor.")
            if isinstance(groups, list):
                grouped = set()
                for members in groups:
                    for p in members:
                        if not isinstance(p, torch.Tensor):
                            raise ValueError("groups must consist of torch.Tensor.")
                        if id(p) in grouped:
                            raise ValueError("A parameter can only appear once in groups.")
                        grouped.add(id(p))
        self._groups = groups
        self._p_to_group = {}
        self._group_counts = {}
        self._hooks_ready = False
        if process_set.included() and (size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"):
            self._form_groups()
            for group in self.param_groups:
                self._hook_group(group)
            self._hooks_ready = True

    def _form_groups(self):
        if self._groups is None:
            return
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        # Every rank must form the same groups: order them as rank 0 does.
        names = broadcast_object([self._parameter_names.get(p) for p in params], root_rank=0,
                                 name="DistributedOptimizer.parameter_order",
                                 process_set=self.process_set)
        position = {name: i for i, name in enumerate(names)}
        params.sort(key=lambda p: position[self._parameter_names.get(p)])
        if isinstance(self._groups, list):
            ids = {id(p) for p in params}
            chosen = [[p for p in members if id(p) in ids] for members in self._groups]
            taken = {id(p) for members in chosen for p in members}
            chosen += [[p] for p in params if id(p) not in taken]
        else:
            chosen = _split_list(params, self._groups)
        for members in chosen:
            group = tuple(members)
            for p in group:
                self._p_to_group[p] = group
            self._group_counts[group] = 0

    def _hook_group(self, group):
        for p in group["params"]:
            if p.requires_grad:
                self._hook(p)

    def _scale_factors(self):
        if self.op == Average:
            # The core divides by the set size after the sum; the predivide
            # factor splits that division around it.
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _allreduce_grad_async(self, p):
        if p.grad is None:
            # No gradient here, but other ranks may have one: send zeros.
            p.grad = torch.zeros_like(p)
        name = self._parameter_names.get(p)
        tensor = p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                return sparse_allreduce_async(tensor, name=name, op=self.op,
                                              process_set=self.process_set), None
            tensor = tensor.to_dense()
        compressed, ctx = self._compression.compress(tensor)
        pre, post = self._scale_factors()
        with _core_collectives.in_stream_order():  # (read by step() on torch's stream)
            handle = allreduce_async_(compressed, name=name, op=self.op, prescale_factor=pre,
                                      postscale_factor=post, process_set=self.process_set)
        return handle, ctx

    def _grouped_allreduce_grad_async(self, group):
        for p in group:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        compressed, ctxs = zip(*[self._compression.compress(p.grad) for p in group])
        pre, post = self._scale_factors()
        with _core_collectives.in_stream_order():
            handle = grouped_allreduce_async_(list(compressed),
                                              name=self._parameter_names.get(group[0]),
                                              op=self.op, prescale_factor=pre,
                                              postscale_factor=post, process_set=self.process_set)
        return handle, ctxs

    def _submit_group(self, group):
        self._handles[group] = self._grouped_allreduce_grad_async(group)
        for p in group:
            self._handles.pop(p, None)
        self._group_counts[group] = 0

    def _on_gradient(self, p):
        """p's gradient has been accumulated."""
        if not self._count_pass(p):
            self._handles[p] = (None, None)
            return
        group = self._p_to_group.get(p) if self._groups is not None else None
        if group is None:
            self._handles[p] = self._allreduce_grad_async(p)
        else:
            self._group_counts[group] += 1
            if self._group_counts[group] == len(group):
                self._submit_group(group)
            else:
                self._handles[p] = (None, None)
        self._complete += 1
        if self._complete == len(self._requires_update):
            # The step's last gradient: nothing else is coming to fuse
            # with, so the core need not hold any back.
            _core_collectives.flush()

    def synchronize(self):
        """Waits for every gradient's reduction and writes the results into
        the .grad tensors. Gradients not yet submitted (no backward reached
        them, or fewer than backward_passes_per_step passes ran) are reduced
        now."""
        if not self.process_set.included():
            self._synchronized = True
            return
        done = set()
        for key, (handle, _) in self._handles.items():
            if handle is not None:
                done.update(key if isinstance(key, tuple) else (key,))
        for p in sorted(self._requires_update - done, key=self._parameter_names.get):
            group = self._p_to_group.get(p)
            if group is not None:
                if group not in self._handles:
                    self._submit_group(group)
            else:
                self._handles[p] = self._allreduce_grad_async(p)
        for key, (handle, ctx) in list(self._handles.items()):
            if isinstance(key, tuple):
                outputs = synchronize(handle)
                for p, out, c in zip(key, outputs, ctx):
                    self._allreduce_delay[p] = self.backward_passes_per_step
                    self._write_grad(p, out, c)
                self._group_counts[key] = 0
            else:
                output = handle() if callable(handle) else synchronize(handle)
                self._allreduce_delay[key] = self.backward_passes_per_step
                self._write_grad(key, output, ctx)
        self._handles.clear()
        self._complete = 0
        self._synchronized = True

    def _write_grad(self, p, output, ctx):
        value = self._compression.decompress(output, ctx)
        if p.grad.is_sparse:
            if not value.is_sparse:
                value = value.to_sparse()
            p.grad.zero_().add_(value)
        elif value is not p.grad:
            p.grad.copy_(value)

    @contextmanager
    def skip_synchronize(self):
        """Within this context step() does not synchronize (call
        synchronize() yourself first, e.g. to clip gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        return super().step(closure)


class _DistributedAdasumOptimizer(_HookedOptimizer):
    """Adasum as Horovod applies it to an optimizer: each rank runs the
    wrapped optimizer on its own gradient, and the resulting parameter
    changes (deltas), not the gradients, are combined with Adasum.

    When p's gradient is complete its hook steps the wrapped optimizer for p
    alone from a saved copy of p, leaves the delta in p and starts an
    in-place Adasum allreduce of it; step() adds the combined delta to the
    saved copy and writes that back into p."""

    def _setup(self, named_parameters, compression, backward_passes_per_step):
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self._setup_names(named_parameters)
        self._start_hooks()
        self._handles = {}
        self._requires_update = set()
        self._synchronized = False
        self._should_synchronize = True
        self._starting_models = {}
        for group in self.param_groups:
            self._hook_group(group)
        self._hooks_ready = True

    def _hook_group(self, group):
        for p in group["params"]:
            self._starting_models[p] = torch.zeros_like(p, requires_grad=False)
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                self._hook(p)

    def _allreduce_grad_async(self, p):
        start = self._starting_models[p]
        stashed = [group["params"] for group in self.param_groups]
        for group in self.param_groups:
            group["params"] = [p] if any(p is v for v in group["params"]) else []
        try:
            start.copy_(p.detach())
            super().step()
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        with torch.no_grad():
            p.sub_(start)  # p now holds this rank's delta
        compressed, ctx = self._compression.compress(p.detach())
        handle = allreduce_async_(compressed, name=self._parameter_names.get(p), op=Adasum)
        return handle, ctx

    def _on_gradient(self, p):
        ready = self._count_pass(p)
        self._handles[p] = self._allreduce_grad_async(p) if ready else (None, None)

    def synchronize(self):
        pass

    @contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum "
                             "optimizer.")
        yield  # pragma: no cover

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for p in sorted(self._requires_update - set(self._handles), key=self._parameter_names.get):
            self._handles[p] = self._allreduce_grad_async(p)
        for p, (handle, ctx) in list(self._handles.items()):
            if handle is None:
                handle, ctx = self._allreduce_grad_async(p)
            delta = self._compression.decompress(synchronize(handle), ctx)
            start = self._starting_models[p]
            with torch.no_grad():
                start.add_(delta)
                p.copy_(start)
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        return loss


# The step of a subclass must not be wrapped a second time by torch's
# profiling hook (the wrapped optimizer's own step already is); otherwise the
# optimizer's step pre/post hooks would run twice.
_DistributedOptimizer.step.hooked = True
_DistributedAdasumOptimizer.step.hooked = True

_classes = {}


def _remove_hooks(handles):
    for handle in handles:
        handle.remove()
    handles.clear()


def _wrap(optimizer, mixin):
    """An object of class (mixin, optimizer's class) sharing optimizer's state."""
    base = optimizer.__class__
    cls = _classes.get((mixin, base))
    if cls is None:
        cls = _classes[(mixin, base)] = type(base.__name__, (mixin, base),
                                             {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    _drop_shadowing_methods(wrapped, optimizer, mixin)
    return wrapped


def _drop_shadowing_methods(wrapped, optimizer, mixin):
    """Instance attributes of the optimizer that shadow a method of the
    mixin (step, zero_grad, ...) are bound to the optimizer itself: copied,
    they would bypass the reduction (wrapped.step() running the plain step,
    each rank applying its own gradient). torch's LR schedulers install one
    such `step` on the optimizer they are given, to note that it was called;
    a scheduler made before wrapping gets its note from the wrapper's step."""
    for name in [n for n in vars(wrapped) if callable(getattr(mixin, n, None))]:
        attribute = vars(wrapped).pop(name)
        if name == "step" and getattr(attribute, "_wrapped_by_lr_sched", False):
            wrapped.step = _noting_step(wrapped, optimizer)
        else:
            warnings.warn(f"DistributedOptimizer: the optimizer's own attribute {name!r} "
                          f"replaces the method of its class; the distributed optimizer uses "
                          f"its own {name}() instead.")


def _noting_step(wrapped, optimizer):
    """The wrapper's step, noting for torch's LR schedulers that it ran,
    as the step they installed on `optimizer` did (a scheduler made on the
    optimizer before it was wrapped looks at `optimizer`; one made after,
    at the wrapper). Holds both weakly."""
    refs = (weakref.ref(wrapped), weakref.ref(optimizer))
    step = type(wrapped).step

    @functools.wraps(step)
    def noting_step(*args, **kwargs):
        for ref in refs:
            opt = ref()
            if opt is not None:
                opt._opt_called = True
        return step(refs[0](), *args, **kwargs)

    noting_step._wrapped_by_lr_sched = True
    return noting_step


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wraps `optimizer` so that step() applies gradients reduced over the
    ranks of `process_set`.

    named_parameters: (name, parameter) pairs, usually model.named_parameters(),
        naming the reductions (default: allreduce.noname.<group>.<index>).
    compression: Compression.none or Compression.fp16 for the wire.
    backward_passes_per_step: local accumulation passes before a reduction.
    op: Average (default), Sum or Adasum (Adasum combines optimizer deltas).
    gradient_predivide_factor: with Average, scale by 1/f before the sum and
        f/size after it.
    groups: an int (that many groups of parameters) or lists of parameters
        reduced together as one grouped allreduce.
    sparse_as_dense: reduce sparse gradients as dense tensors.
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == Adasum and size() > 1:
        if process_set is not global_process_set:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        opt = _wrap(optimizer, _DistributedAdasumOptimizer)
        opt._setup(named_parameters, compression, backward_passes_per_step)
        return opt
    opt = _wrap(optimizer, _DistributedOptimizer)
    opt._setup(named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set)
    return opt
