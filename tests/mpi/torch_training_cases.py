"""Multi-rank cases for frontends.torch's training helpers: DistributedOptimizer,
broadcast_parameters / broadcast_optimizer_state / broadcast_object /
allgather_object, and SyncBatchNorm (run by tests/test_torch_mpi.py).

The reference is always single-process training, computed on every rank:
every rank can build every rank's batch (`batch`), so the reference model
trains on the concatenated global batch with the plain torch optimizer, and
the distributed model must end with the same parameters.
"""

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import frontends.torch as hvd

ATOL = 1e-10  # float64 models: the sums differ only in rounding order


def setup(core):
    hvd.init(process_sets="dynamic")


def expect_raises(exc_type, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__}")


class Net(nn.Module):
    """A small conv net on 1x6x6 inputs, float64."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.fc1 = nn.Linear(3 * 4 * 4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(torch.relu(self.conv(x)).flatten(1))))


def make_net(seed=0):
    torch.manual_seed(seed)
    return Net().double()


def batch(rank, step, micro=0, rows=4):
    gen = torch.Generator().manual_seed(10000 * step + 100 * rank + micro)
    x = torch.randn(rows, 1, 6, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (rows,), generator=gen)
    return x, y


def global_batch(step, micro_batches=1):
    parts = [batch(r, step, m) for r in range(hvd.size()) for m in range(micro_batches)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def assert_same_params(model, reference, atol=ATOL, what=""):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=atol, rtol=0,
                                   msg=lambda m: f"{what} {name}: {m}")


def reference_training(make_opt, steps, loss_scale=1.0, micro_batches=1, clip=None):
    ref = make_net()
    opt = make_opt(ref.parameters())
    for step in range(steps):
        opt.zero_grad()
        x, y = global_batch(step, micro_batches)
        (F.cross_entropy(ref(x), y) * loss_scale).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
    return ref


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# ------------------------------------------------------- DistributedOptimizer
def case_distributed_optimizer_equals_single_process_on_the_global_batch(_core):
    model = make_net()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    for step in range(3):
        opt.zero_grad()
        x, y = batch(hvd.rank(), step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert_same_params(model, reference_training(sgd, 3))


def case_an_lr_scheduler_made_before_wrapping_neither_skips_the_reduction_nor_warns(_core):
    # torch's LRScheduler installs an instance attribute `step` on the
    # optimizer it is given, bound to that optimizer: carried over to the
    # wrapper, it ran the plain step, each rank applying its own gradient.
    import warnings

    def sgd_with_schedule(params):
        opt = sgd(params)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    model = make_net()
    plain, schedule = sgd_with_schedule(model.parameters())
    opt = hvd.DistributedOptimizer(plain, named_parameters=model.named_parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not "lr_scheduler.step() before optimizer.step()"
        for step in range(4):
            opt.zero_grad()
            x, y = batch(hvd.rank(), step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            schedule.step()
    ref = make_net()
    ref_opt, ref_schedule = sgd_with_schedule(ref.parameters())
    for step in range(4):
        ref_opt.zero_grad()
        x, y = global_batch(step)
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_schedule.step()
    assert_same_params(model, ref)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.025


def case_a_model_wrapped_again_after_its_optimizer_is_dropped_is_reduced_once(_core):
    # The first optimizer's gradient hooks went on firing after it was
    # dropped: the second optimizer's first backward then submitted every
    # gradient twice under one name ("already in flight").
    import gc

    model = make_net()
    first = hvd.DistributedOptimizer(sgd(model.parameters()),
                                     named_parameters=model.named_parameters())
    first.zero_grad()
    x, y = batch(hvd.rank(), 0)
    F.cross_entropy(model(x), y).backward()
    first.step()
    del first
    gc.collect()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    ref = reference_training(sgd, 1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(1, 3):
        opt.zero_grad()
        x, y = batch(hvd.rank(), step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        x, y = global_batch(step)
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    assert_same_params(model, ref)


def case_a_channels_last_model_trains_as_on_the_global_batch(_core):
    """Its conv weight and gradient are not contiguous (Horovod refuses them,
    horovod/horovod#3491): broadcast_parameters and the optimizer reduce
    contiguous copies and write the results back, keeping the layout; with
    groups and fp16 compression too."""
    cl = torch.channels_last

    def make(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Conv2d(2, 3, 2), nn.Flatten(),
                             nn.Linear(3 * 3 * 3, 3)).double()

    reference = make(0)
    ref_opt = sgd(reference.parameters())
    for step in range(3):
        ref_opt.zero_grad()
        x, y = global_batch(step)
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    for kwargs, atol in (({}, ATOL), ({"groups": 2}, ATOL),
                         ({"compression": hvd.Compression.fp16}, 1e-2)):
        model = make(hvd.rank()).to(memory_format=cl)
        weight = model[2].weight
        assert not weight.is_contiguous()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        assert weight.is_contiguous(memory_format=cl)
        assert_same_params(model, make(0), atol=0, what="broadcast")
        opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                       named_parameters=model.named_parameters(), **kwargs)
        for step in range(3):
            opt.zero_grad()
            x, y = batch(hvd.rank(), step)
            F.cross_entropy(model(x.contiguous(memory_format=cl)), y).backward()
            assert not weight.grad.is_contiguous()
            opt.step()
        assert weight.is_contiguous(memory_format=cl)
        assert_same_params(model, reference, atol=atol, what=str(kwargs))


def case_gradients_are_submitted_during_backward(_core):
    """Each gradient's allreduce starts from its hook, before step()."""
    model = make_net()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    x, y = batch(hvd.rank(), 0)
    F.cross_entropy(model(x), y).backward()
    started = [p for p, (handle, _) in opt._handles.items() if handle is not None]
    assert len(started) == len(list(model.parameters())), started
    exc = expect_raises(AssertionError, opt.zero_grad)
    assert "before optimizer.step()" in str(exc)
    opt.step()
    assert_same_params(model, reference_training(sgd, 1))


def case_the_last_gradient_of_a_step_flushes_the_queue(_core):
    """Once every parameter's gradient of the step is submitted, the optimizer
    tells the core that no more are coming (collectives.flush), once a step,
    only on the pass that submits (backward_passes_per_step=2); the queue
    then says every tensor pushed so far is flushed."""
    from coordinator import collectives, runtime

    queue = runtime.current().queue
    model = make_net()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2)
    flushes = []
    real = collectives.flush

    def counting():
        flushes.append(len(opt._handles))
        real()

    collectives.flush = counting
    try:
        for step in range(2):
            opt.zero_grad()
            for micro in range(2):
                x, y = batch(hvd.rank(), step, micro)
                (F.cross_entropy(model(x), y) / 2).backward()
                if micro == 0:
                    assert len(flushes) == step, flushes
            assert len(flushes) == step + 1, flushes
            assert queue.flushed == queue.pushed
            opt.step()
    finally:
        collectives.flush = real
    n = len(list(model.parameters()))
    assert flushes == [n, n], flushes  # after the last of the n gradients
    assert_same_params(model, reference_training(sgd, 2, micro_batches=2))


def case_the_optimizer_submits_its_gradients_in_stream_order(_core):
    """DistributedOptimizer submits each gradient, one by one or grouped,
    inside collectives.in_stream_order: on a GPU their handles complete once
    their NCCL work is queued, and step() queues the update behind it
    without waiting for the GPU (as DDP's buckets). Other submissions, and
    this thread after the step, are not in stream order."""
    from coordinator import collectives, runtime

    queue = runtime.current().queue
    seen = []
    real = queue.push_all

    def recording(entries):
        seen.append((entries[0].name, getattr(collectives._stream_order, "on", False)))
        return real(entries)

    queue.push_all = recording
    try:
        for groups in (None, 2):
            model = make_net()
            opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                           named_parameters=model.named_parameters(),
                                           groups=groups)
            opt.zero_grad()
            x, y = batch(hvd.rank(), 0, 0)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        hvd.allreduce(torch.ones(1), name="plain")
    finally:
        queue.push_all = real
    gradients = [on for name, on in seen
                 if name.startswith(("allreduce.", "grouped_allreduce.")) and "plain" not in name]
    assert len(gradients) > 2 and all(gradients), seen
    others = [on for name, on in seen if name.startswith("broadcast.") or "plain" in name]
    assert others and not any(others), seen  # (the groups' parameter order, "plain")


def case_backward_passes_per_step_accumulates_locally(_core):
    model = make_net()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2)
    for step in range(3):
        opt.zero_grad()
        for micro in range(2):
            x, y = batch(hvd.rank(), step, micro)
            (F.cross_entropy(model(x), y) / 2).backward()
            if micro == 0:
                assert all(h is None for h, _ in opt._handles.values()), "reduced too early"
        opt.step()
    assert_same_params(model, reference_training(sgd, 3, micro_batches=2))
    # Three passes where two are expected is an error, as in Horovod.
    opt.zero_grad()
    for micro in range(2):
        x, y = batch(hvd.rank(), 9, micro)
        F.cross_entropy(model(x), y).backward()
    x, y = batch(hvd.rank(), 9, 2)
    expect_raises(AssertionError, F.cross_entropy(model(x), y).backward)
    opt.synchronize()


def case_set_backward_passes_per_step_changes_the_count(_core):
    model = make_net()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    opt.set_backward_passes_per_step(2)
    assert opt.backward_passes_per_step == 2
    for step in range(2):
        opt.zero_grad()
        for micro in range(2):
            x, y = batch(hvd.rank(), step, micro)
            (F.cross_entropy(model(x), y) / 2).backward()
        opt.step()
    assert_same_params(model, reference_training(sgd, 2, micro_batches=2))


def case_fp16_compression_within_fp16_tolerance(_core):
    model = make_net().float()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16)
    for step in range(3):
        opt.zero_grad()
        x, y = batch(hvd.rank(), step)
        F.cross_entropy(model(x.float()), y).backward()
        opt.step()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    ref = reference_training(lambda ps: torch.optim.SGD(ps, lr=0.1), 3)
    assert_same_params(model.double(), ref, atol=2e-3, what="fp16")


def case_predivide_factor_and_sum_op(_core):
    n = hvd.size()
    model = make_net()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   gradient_predivide_factor=4.0)
    for step in range(2):
        opt.zero_grad()
        x, y = batch(hvd.rank(), step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert_same_params(model, reference_training(sgd, 2), what="predivide")
    model = make_net()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters(), op=hvd.Sum)
    for step in range(2):
        opt.zero_grad()
        x, y = batch(hvd.rank(), step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    # Summing per-rank mean losses is n times the global mean loss.
    assert_same_params(model, reference_training(sgd, 2, loss_scale=n), what="Sum")
    expect_raises(ValueError, hvd.DistributedOptimizer, sgd(make_net().parameters()),
                  op=hvd.Sum, gradient_predivide_factor=2.0)
    expect_raises(ValueError, hvd.DistributedOptimizer, sgd(make_net().parameters()),
                  backward_passes_per_step=0)


def case_groups_by_count_and_by_lists(_core):
    for groups in (2, "lists"):
        model = make_net()
        if groups == "lists":
            groups = [[model.conv.weight, model.conv.bias], [model.fc2.weight, model.fc1.bias]]
        opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                       named_parameters=model.named_parameters(), groups=groups)
        for step in range(2):
            opt.zero_grad()
            x, y = batch(hvd.rank(), step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        assert_same_params(model, reference_training(sgd, 2), what=f"groups={groups}")
    model = make_net()
    expect_raises(ValueError, hvd.DistributedOptimizer, sgd(model.parameters()),
                  groups=[[model.conv.weight, model.conv.weight]])


def case_parameters_without_gradient_are_reduced_as_zeros(_core):
    """Rank 0 never uses fc2's second branch; the others do. The average over
    ranks (zeros from rank 0) is the gradient of the mean of the ranks'
    losses."""
    n, me = hvd.size(), hvd.rank()

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.a = nn.Linear(4, 2)
            self.b = nn.Linear(4, 2)

        def forward(self, x, rank):
            h = torch.tanh(self.body(x))
            return self.a(h) if rank == 0 else self.a(h) + self.b(h)

    def data(r):
        gen = torch.Generator().manual_seed(77 + r)
        return torch.randn(3, 4, generator=gen, dtype=torch.float64)

    torch.manual_seed(5)
    model = TwoHeads().double()
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters())
    opt.zero_grad()
    model(data(me), me).pow(2).mean().backward()
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    (sum(ref(data(r), r).pow(2).mean() for r in range(n)) / n).backward()
    ref_opt.step()
    assert_same_params(model, ref, what="unused parameters")


def case_synchronize_then_clip_inside_skip_synchronize(_core):
    model = make_net()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    for step in range(2):
        opt.zero_grad()
        x, y = batch(hvd.rank(), step)
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with opt.skip_synchronize():
            opt.step()
    assert_same_params(model, reference_training(sgd, 2, clip=0.05))


def case_param_group_added_after_wrapping_is_reduced(_core):
    model = make_net()
    model.fc2.requires_grad_(False)
    base = sgd([p for p in model.parameters() if p.requires_grad])
    opt = hvd.DistributedOptimizer(base, named_parameters=[
        (n, p) for n, p in model.named_parameters() if p.requires_grad])
    model.fc2.requires_grad_(True)
    opt.add_param_group({"params": list(model.fc2.parameters()), "lr": 0.05})
    ref = make_net()
    ref_opt = sgd([ref.conv.weight, ref.conv.bias, ref.fc1.weight, ref.fc1.bias])
    ref_opt.add_param_group({"params": list(ref.fc2.parameters()), "lr": 0.05})
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = batch(hvd.rank(), step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        gx, gy = global_batch(step)
        F.cross_entropy(ref(gx), gy).backward()
        ref_opt.step()
    assert_same_params(model, ref, what="added group")


def case_adam_and_default_names(_core):
    model = make_net()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    for step in range(3):
        opt.zero_grad()
        x, y = batch(hvd.rank(), step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    ref = reference_training(lambda ps: torch.optim.Adam(ps, lr=0.01), 3)
    assert_same_params(model, ref, what="Adam")


def case_sparse_gradients_reduce_like_dense(_core):
    n, me = hvd.size(), hvd.rank()

    def ids(r, step):
        gen = torch.Generator().manual_seed(300 + 10 * step + r)
        return torch.randint(0, 10, (5,), generator=gen)

    for sparse_as_dense in (False, True):
        torch.manual_seed(3)
        emb = nn.Embedding(10, 4, sparse=True).double()
        ref = nn.Embedding(10, 4).double()
        ref.load_state_dict(emb.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=sparse_as_dense)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        for step in range(2):
            opt.zero_grad()
            emb(ids(me, step)).pow(2).sum().backward()
            opt.step()
            ref_opt.zero_grad()
            (sum(ref(ids(r, step)).pow(2).sum() for r in range(n)) / n).backward()
            ref_opt.step()
        torch.testing.assert_close(emb.weight.detach(), ref.weight.detach(), atol=ATOL, rtol=0)


def _adasum_pair(a, b):
    dot, na, nb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - dot / (2 * na) if na > 0 else 1.0
    cb = 1.0 - dot / (2 * nb) if nb > 0 else 1.0
    return ca * a + cb * b


def _adasum(vectors):
    """The published Adasum tree: ranks past the largest power of two fold
    into their partner first, then recursive doubling (lower rank as 'a')."""
    size = len(vectors)
    p2 = 1
    while p2 * 2 <= size:
        p2 *= 2
    vecs = list(vectors[:p2])
    for r in range(p2, size):
        vecs[r - p2] = _adasum_pair(vecs[r - p2], vectors[r])
    distance = 1
    while distance < p2:
        vecs = [_adasum_pair(vecs[min(r, r ^ distance)], vecs[max(r, r ^ distance)])
                for r in range(p2)]
        distance *= 2
    return vecs[0]


def case_adasum_optimizer_combines_each_ranks_update(_core):
    """op=Adasum: each rank steps the wrapped optimizer on its own gradient and
    the parameter deltas, layer by layer, are combined with Adasum."""
    n, me = hvd.size(), hvd.rank()
    lr = 0.1
    model = make_net()
    start = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    x, y = batch(me, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    deltas = []
    for r in range(n):
        local = copy.deepcopy(start)
        xr, yr = batch(r, 0)
        F.cross_entropy(local(xr), yr).backward()
        deltas.append([-lr * p.grad.detach().reshape(-1).numpy() for p in local.parameters()])
    for i, (p, p0) in enumerate(zip(model.parameters(), start.parameters())):
        combined = _adasum([d[i] for d in deltas])
        expected = p0.detach().reshape(-1).numpy() + combined
        np.testing.assert_allclose(p.detach().reshape(-1).numpy(), expected, atol=1e-9)
    exc = expect_raises(AssertionError, lambda: opt.skip_synchronize().__enter__())
    assert "Adasum" in str(exc)


def case_uneven_batches_with_join_train_as_the_running_ranks_average(_core):
    """Horovod's recipe for uneven data: each rank steps through its own
    number of batches, then joins. While a rank has joined it takes part
    in the others' gradient allreduces with zeros, and Average still
    divides by every rank, so step s's gradient is the sum over the ranks
    still running, over the job's size. Each rank ends with the reference's
    parameters after as many steps as it ran, and join() names rank 0,
    which runs longest."""
    n, me = hvd.size(), hvd.rank()
    steps = [3, 1, 2, 2][:n]
    model = make_net()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    for step in range(steps[me]):
        opt.zero_grad()
        x, y = batch(me, step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert hvd.join() == 0
    ref = make_net()
    ref_opt = sgd(ref.parameters())
    for step in range(steps[me]):
        ref_opt.zero_grad()
        running = [r for r in range(n) if steps[r] > step]
        loss = sum(F.cross_entropy(ref(batch(r, step)[0]), batch(r, step)[1]) for r in running)
        (loss / n).backward()
        ref_opt.step()
    assert_same_params(model, ref, what=f"rank {me} after {steps[me]} steps")
    # The job goes on in step afterwards, every rank again.
    out = hvd.allreduce(torch.full((2,), float(me)), op=hvd.Sum, name="after.join")
    torch.testing.assert_close(out, torch.full((2,), float(sum(range(n))), dtype=out.dtype))


def case_distributed_optimizer_on_a_process_set(_core):
    n, me = hvd.size(), hvd.rank()
    members = [0, 1]
    ps = hvd.add_process_set(members) if n > 2 else hvd.global_process_set
    model = make_net()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters(), process_set=ps)
    for step in range(2):
        opt.zero_grad()
        x, y = batch(me, step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    ref = make_net()
    ref_opt = sgd(ref.parameters())
    for step in range(2):
        ref_opt.zero_grad()
        ranks = members if me in members else [me]
        parts = [batch(r, step) for r in ranks]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    assert_same_params(model, ref, what=f"set {members}")
    hvd.barrier()
    if ps is not hvd.global_process_set:
        assert hvd.remove_process_set(ps)


def case_distributed_optimizers_on_two_disjoint_sets_use_the_same_names(_core):
    """Two halves train apart, each with its DistributedOptimizer on its own
    set: the parameter names are the same in both sets, which are two
    tensors each (names are per process set, as in Horovod)."""
    n, me = hvd.size(), hvd.rank()
    halves = [list(range(0, (n + 1) // 2)), list(range((n + 1) // 2, n))]
    sets = [hvd.add_process_set(h) for h in halves]
    mine = 0 if me in halves[0] else 1
    model = make_net()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   process_set=sets[mine])
    for step in range(3):
        opt.zero_grad()
        x, y = batch(me, step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    ref = make_net()
    ref_opt = sgd(ref.parameters())
    for step in range(3):
        ref_opt.zero_grad()
        parts = [batch(r, step) for r in halves[mine]]
        F.cross_entropy(ref(torch.cat([p[0] for p in parts])),
                        torch.cat([p[1] for p in parts])).backward()
        ref_opt.step()
    assert_same_params(model, ref, what=f"set {halves[mine]}")
    hvd.barrier()
    for ps in sets:
        assert hvd.remove_process_set(ps)


# --------------------------------------------------------- broadcast helpers
def _all_equal_to_root(tensors, what):
    """Every rank's tensors equal rank 0's (compared on every rank)."""
    mine = [t.detach().clone() for t in tensors]
    roots = hvd.broadcast_object(mine, root_rank=0, name=f"check.{what}")
    for a, b in zip(mine, roots):
        assert torch.equal(a, b), f"{what}: rank {hvd.rank()} differs from rank 0"


def case_broadcast_parameters_from_dicts_and_lists(_core):
    me = hvd.rank()
    model = make_net(seed=me)  # different on every rank
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    _all_equal_to_root(list(model.state_dict().values()), "state_dict")
    assert_same_params(model, make_net(seed=0), atol=0, what="root's init")
    model = make_net(seed=me)
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=hvd.size() - 1)
    assert_same_params(model, make_net(seed=hvd.size() - 1), atol=0, what="named list")
    model = make_net(seed=me)
    hvd.broadcast_parameters(list(model.parameters()), root_rank=0)
    assert_same_params(model, make_net(seed=0), atol=0, what="plain list")
    expect_raises(ValueError, hvd.broadcast_parameters, model.parameters(), 0)


def case_broadcast_optimizer_state_restores_root_state_everywhere(_core):
    me = hvd.rank()
    for make in (lambda ps: torch.optim.Adam(ps, lr=0.01 * (me + 1)),
                 lambda ps: torch.optim.SGD(ps, lr=0.1 * (me + 1), momentum=0.9)):
        model = make_net(seed=me)
        opt = make(model.parameters())
        for step in range(me + 1):  # a different state on every rank
            opt.zero_grad()
            x, y = batch(me, step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        state = opt.state_dict()
        tensors = [v for s in state["state"].values() for v in s.values()
                   if isinstance(v, torch.Tensor)]
        assert tensors, "the optimizer has state to compare"
        _all_equal_to_root(tensors, type(opt).__name__)
        root_groups = hvd.broadcast_object(state["param_groups"], 0)
        assert state["param_groups"] == root_groups
        # From identical states, identical steps keep every rank identical.
        opt.zero_grad()
        x, y = batch(0, 50)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        _all_equal_to_root(list(model.parameters()), f"{type(opt).__name__}.after")


def case_broadcast_optimizer_state_of_a_wrapped_fresh_optimizer(_core):
    model = make_net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1 * (hvd.rank() + 1)),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.1  # sent although plain SGD keeps no state
    assert len(opt.state_dict()["state"]) == 0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    for step in range(2):
        opt.zero_grad()
        x, y = batch(hvd.rank(), step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert_same_params(model, reference_training(lambda ps: torch.optim.SGD(ps, lr=0.1), 2))


def case_broadcast_and_allgather_objects(_core):
    n, me = hvd.size(), hvd.rank()
    obj = {"rank": me, "items": list(range(me + 1)), "f": lambda v: v + me}
    got = hvd.broadcast_object(obj, root_rank=n - 1)
    assert got["rank"] == n - 1 and got["items"] == list(range(n)) and got["f"](1) == n
    assert hvd.allgather_object({"r": me, "s": "x" * me}) == [{"r": r, "s": "x" * r}
                                                              for r in range(n)]


# ------------------------------------------------------------- SyncBatchNorm
def case_sync_batch_norm_equals_batch_norm_on_the_global_batch(_core):
    n, me = hvd.size(), hvd.rank()
    torch.manual_seed(11)
    sync = hvd.SyncBatchNorm(3).double()
    plain = nn.BatchNorm2d(3).double()
    with torch.no_grad():
        sync.weight.uniform_(0.5, 1.5)
        sync.bias.uniform_(-0.5, 0.5)
    plain.load_state_dict(sync.state_dict())

    def x_of(r):
        gen = torch.Generator().manual_seed(500 + r)
        return torch.randn(2 + r, 3, 4, 4, generator=gen, dtype=torch.float64) * (r + 1) + r

    xs = [x_of(r) for r in range(n)]
    weights = [torch.randn(x.shape, generator=torch.Generator().manual_seed(600 + r),
                           dtype=torch.float64) for r, x in enumerate(xs)]
    x = xs[me].clone().requires_grad_()
    y = sync(x)
    (y * weights[me]).sum().backward()
    xg = torch.cat(xs).requires_grad_()
    yg = plain(xg)
    (yg * torch.cat(weights)).sum().backward()
    start = sum(v.shape[0] for v in xs[:me])
    rows = slice(start, start + xs[me].shape[0])
    torch.testing.assert_close(y, yg[rows], atol=1e-10, rtol=0)
    torch.testing.assert_close(x.grad, xg.grad[rows], atol=1e-10, rtol=0)
    torch.testing.assert_close(sync.running_mean, plain.running_mean, atol=1e-10, rtol=0)
    torch.testing.assert_close(sync.running_var, plain.running_var, atol=1e-10, rtol=0)
    # Weight and bias gradients are local; their sum over ranks is the global one.
    total_w = hvd.allreduce(sync.weight.grad, op=hvd.Sum)
    torch.testing.assert_close(total_w, plain.weight.grad, atol=1e-10, rtol=0)
    total_b = hvd.allreduce(sync.bias.grad, op=hvd.Sum)
    torch.testing.assert_close(total_b, plain.bias.grad, atol=1e-10, rtol=0)
    sync.eval()
    plain.eval()
    torch.testing.assert_close(sync(xs[me]), plain(xs[me]), atol=1e-12, rtol=0)


def case_sync_batch_norm_with_an_empty_batch_on_one_rank_uses_the_others(_core):
    """Rank 0's batch is empty (an uneven last batch): the statistics are
    the other ranks', as BatchNorm's over their rows. var_mean of no rows
    is NaN, which reached every rank's output and running statistics. Empty
    everywhere, every rank raises ValueError."""
    n, me = hvd.size(), hvd.rank()
    sync = hvd.SyncBatchNorm(3).double()
    plain = nn.BatchNorm1d(3).double()
    xs = [torch.arange(12.0, dtype=torch.float64).reshape(4, 3) * (r + 1) if r else
          torch.zeros(0, 3, dtype=torch.float64) for r in range(n)]
    x = xs[me].clone().requires_grad_()
    y = sync(x)
    y.sum().backward()
    xg = torch.cat(xs).requires_grad_()
    yg = plain(xg)
    yg.sum().backward()
    start = sum(v.shape[0] for v in xs[:me])
    torch.testing.assert_close(y, yg[start:start + xs[me].shape[0]], atol=1e-10, rtol=0)
    torch.testing.assert_close(x.grad, xg.grad[start:start + xs[me].shape[0]], atol=1e-10,
                               rtol=0)
    torch.testing.assert_close(sync.running_mean, plain.running_mean, atol=1e-10, rtol=0)
    torch.testing.assert_close(sync.running_var, plain.running_var, atol=1e-10, rtol=0)
    try:
        sync(torch.zeros(0, 3, dtype=torch.float64))
    except ValueError as exc:
        assert "empty on every rank" in str(exc), exc
    else:
        raise AssertionError("an empty batch everywhere did not raise")
