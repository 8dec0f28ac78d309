"""Multi-rank cases for broadcast_optimizer_state on optimizers with no state
yet (run by tests/test_torch_mpi.py).

Horovod 0.28.1 first creates such a state: a zero .grad for every parameter
that requires grad, then one local optimizer step; then it broadcasts the
state. We do the same but put the parameters back after that step. Every
rank gets different parameters and hyper-parameters, and every rank computes
the state rank 0 must end with (rank 0's net and hyper-parameters, zero
gradients, one plain step) to check its own against.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import frontends.torch as hvd
from torch_training_cases import batch, make_net


def setup(core):
    hvd.init(process_sets="dynamic")


def assert_same(a, b, where="state_dict"):
    """a and b are equal, tensors bit for bit (sparse ones as dense)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b).__name__}"
        kind_a, kind_b = (a.layout, a.dtype, tuple(a.shape)), (b.layout, b.dtype, tuple(b.shape))
        assert kind_a == kind_b, f"{where}: {kind_a} vs {kind_b}"
        if a.is_sparse:
            a, b = a.to_dense(), b.to_dense()
        assert torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def frozen_net(seed):
    """make_net with fc2's bias frozen: it must get no .grad."""
    model = make_net(seed)
    model.fc2.bias.requires_grad_(False)
    return model


def state_after_one_zero_step(make_opt, rank):
    """The state `rank`'s fresh optimizer has after Horovod's creating step,
    computed here with plain torch."""
    model = frozen_net(seed=rank)
    opt = make_opt(model.parameters(), rank)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    return opt.state_dict()


def check_fresh_optimizer_gets_roots_created_state(make_opt, name):
    me = hvd.rank()
    model = frozen_net(seed=me)  # different parameters on every rank
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make_opt(model.parameters(), me)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name}: {n} has no .grad"
            assert torch.equal(p.grad, torch.zeros_like(p)), f"{name}: {n}.grad is not zeros"
        else:
            assert p.grad is None, f"{name}: frozen {n} got a .grad"
        assert torch.equal(p.detach(), before[n]), f"{name}: {n} moved"
    state = opt.state_dict()
    assert_same(state, state_after_one_zero_step(make_opt, 0), f"{name} vs expected")
    assert_same(state, hvd.broadcast_object(state, 0, name=f"check.{name}"), f"{name} vs rank 0")
    # What Horovod code goes on to do with the gradients it now has.
    grads = [(f"grad.{n}", p.grad) for n, p in model.named_parameters() if p.requires_grad]
    hvd.broadcast_parameters(grads, root_rank=0)
    assert all(torch.equal(g, torch.zeros_like(g)) for _, g in grads)


def case_fresh_sgd_with_momentum_and_weight_decay_gets_roots_state_params_unmoved(_core):
    """momentum_buffer = weight_decay * p after the creating step: it differs
    per rank until rank 0's is broadcast."""
    check_fresh_optimizer_gets_roots_created_state(
        lambda ps, r: torch.optim.SGD(ps, lr=0.1 * (r + 1), momentum=0.9 - 0.1 * r,
                                      weight_decay=0.01 * (r + 1)), "SGD")


def case_fresh_adam_with_l2_weight_decay_gets_roots_state_params_unmoved(_core):
    check_fresh_optimizer_gets_roots_created_state(
        lambda ps, r: torch.optim.Adam(ps, lr=0.01 * (r + 1), betas=(0.9 - 0.1 * r, 0.999),
                                       weight_decay=0.05 * (r + 1)), "Adam")


def case_fresh_adamw_gets_roots_state_and_hyperparameters_params_unmoved(_core):
    """Decoupled decay scales p by 1 - lr * wd even on a zero gradient;
    amsgrad differs per rank, so rank 0's state layout must win too."""
    check_fresh_optimizer_gets_roots_created_state(
        lambda ps, r: torch.optim.AdamW(ps, lr=0.01 * (r + 1), weight_decay=0.1 * (r + 1),
                                        amsgrad=r % 2 == 1), "AdamW")


def case_wrapped_fresh_optimizer_creates_state_without_reducing_while_root_has_state(_core):
    """Only ranks other than 0 have an empty state, so only they take the
    creating step: a step that reduced would wait for rank 0 forever."""
    me = hvd.rank()
    model = make_net(seed=me)
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 - 0.1 * me)
    if me == 0:
        x, y = batch(0, 0)
        F.cross_entropy(model(x), y).backward()
        plain.step()
    opt = hvd.DistributedOptimizer(plain, named_parameters=model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    # Checked after the collectives below, so that a failure here does not stall them.
    zero_grads = all(p.grad is not None and not p.grad.any() for p in model.parameters())
    unmoved = all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    state = copy.deepcopy(opt.state_dict())  # training below updates the live state
    root_state = hvd.broadcast_object(state, 0, name="check.wrapped")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(2):
        opt.zero_grad()
        x, y = batch(me, step + 1)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    params = [p.detach() for p in model.parameters()]
    root_params = hvd.broadcast_object(params, 0, name="check.trained")
    if me != 0:
        assert zero_grads, "a fresh rank has no zero .grad"
        assert unmoved, "a fresh rank's parameters moved"
    assert_same(state, root_state, "vs rank 0")
    assert_same(params, root_params, "trained")


def case_sparse_embedding_gets_sparse_zero_grads_and_roots_sparse_state(_core):
    """model= marks sparse nn.Embedding parameters: under SGD they get sparse
    zero gradients, and rank 0's sparse momentum buffer reaches every rank."""
    me = hvd.rank()
    torch.manual_seed(me)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if me == 0:  # rank 0 has a sparse momentum buffer with entries
        model(torch.tensor([1, 3, 3])).sum().backward()
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
    state = opt.state_dict()
    root_state = hvd.broadcast_object(state, 0, name="check.sparse_sgd")
    emb, lin = model[0].weight, model[1].weight
    if me != 0:
        assert emb.grad.is_sparse and not emb.grad.to_dense().any()
        assert not lin.grad.is_sparse and not lin.grad.any()
        assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert state["state"][0]["momentum_buffer"].is_sparse
    assert state["state"][0]["momentum_buffer"].to_dense()[[1, 3]].any()
    assert_same(state, root_state, "vs rank 0")


def case_fresh_sparse_adam_gets_sparse_zero_grads(_core):
    me = hvd.rank()
    torch.manual_seed(me)
    emb = nn.Embedding(10, 4, sparse=True)
    before = emb.weight.detach().clone()
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.01 * (me + 1))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert emb.weight.grad.is_sparse and not emb.weight.grad.to_dense().any()
    assert torch.equal(emb.weight.detach(), before)
    assert opt.param_groups[0]["lr"] == 0.01
    state = opt.state_dict()
    assert_same(state, hvd.broadcast_object(state, 0, name="check.sparse_adam"), "vs rank 0")


def case_lbfgs_state_is_sent_as_it_stands(_core):
    """Horovod refuses L-BFGS; we send it without a creating step (its step
    needs a closure): no gradients appear on the fresh ranks."""
    me = hvd.rank()
    model = make_net(seed=me)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5 * (me + 1), history_size=3)
    x, y = batch(0, 0)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    if me == 0:
        opt.step(closure)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state_dict()
    root_state = hvd.broadcast_object(state, 0, name="check.lbfgs")
    if me != 0:
        assert all(p.grad is None for p in model.parameters())
    assert state["param_groups"][0]["lr"] == 0.5 and state["state"]
    assert_same(state, root_state, "vs rank 0")
