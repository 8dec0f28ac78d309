"""Multi-rank cases for ChainerMN's model-parallel parts in frontends.chainer:
the differentiable collectives and send/recv (chainermn.functions),
MultiNodeChainList and the multi-node NStep RNN. Run by
tests/test_chainer_model_parallel_mpi.py at 2 and 3 ranks.

Every rank can build every rank's data and layers from seeds, so each case
also runs the whole model in this one process and checks this rank's
outputs and gradients against that reference (ChainerMN's own tests check
that backward finishes and that gradients exist).
"""

import collections
import time

import numpy as np

import frontends.chainer as chainermn  # makes Chainer importable first

import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402

COMM = None
FUNCS = chainermn.functions


def setup(hvd):
    global COMM
    COMM = chainermn.create_communicator("naive")


def ints(seed, shape, dtype):
    """Small integers, exact in float16 and in their sums."""
    return np.random.RandomState(seed).randint(-3, 4, size=shape).astype(dtype)


def assert_equal(actual, expected, what=""):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    np.testing.assert_array_equal(actual, expected, err_msg=what)


def assert_close(actual, expected, what=""):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    # (gradients summed in another order differ in the last bits)
    tol = 1e-3 if actual.dtype == np.float16 else 1e-5
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol, err_msg=what)


def expect_raises(exc_type, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__}")


def weight(k, i):
    """The factor rank k's loss puts on the piece it got from (or for) rank i."""
    return k * 10 + i + 1


FLOATS = [np.float16, np.float32]


# ------------------------------------------------------------- collectives
def case_allgather_function_gives_every_array_and_returns_gradients_to_their_owner(hvd):
    n, me = COMM.size, COMM.rank
    for dtype in FLOATS:
        xs = [ints(r, (2, r + 1), dtype) for r in range(n)]
        x = chainer.Variable(xs[me].copy())
        ys = FUNCS.allgather(COMM, x)
        assert isinstance(ys, tuple) and len(ys) == n
        for i, y in enumerate(ys):
            assert_equal(y.array, xs[i], f"allgather from rank {i}")
        sum(F.sum(y) * weight(me, i) for i, y in enumerate(ys)).backward()
        expected = sum(weight(k, me) for k in range(n))
        assert_equal(x.grad, np.full(xs[me].shape, expected, dtype), "gradient")
    # A 0-d Variable (a scalar, as a loss is): its summed gradient was a
    # NumPy scalar, which Chainer refuses (TypeError, as in ChainerMN 7.8.1)
    x = chainer.Variable(np.array(me + 1.0, np.float32))
    ys = FUNCS.allgather(COMM, x)
    assert [float(y.array) for y in ys] == [r + 1.0 for r in range(n)]
    sum(y * weight(me, i) for i, y in enumerate(ys)).backward()
    assert isinstance(x.grad, np.ndarray) and x.grad.shape == (), type(x.grad)
    assert float(x.grad) == sum(weight(k, me) for k in range(n)), x.grad


def case_alltoall_function_exchanges_arrays_and_gradients_including_empty_ones(hvd):
    n, me = COMM.size, COMM.rank
    for dtype in FLOATS:
        # Rank r's piece for rank j has r rows: rank 0 sends empty arrays.
        mine = [chainer.Variable(ints(10 * me + j, (me, j + 1), dtype)) for j in range(n)]
        ys = FUNCS.alltoall(COMM, mine)
        assert isinstance(ys, tuple) and len(ys) == n
        for j, y in enumerate(ys):
            assert_equal(y.array, ints(10 * j + me, (j, me + 1), dtype), f"from rank {j}")
        sum(F.sum(y) * weight(me, j) for j, y in enumerate(ys)).backward()
        for j, x in enumerate(mine):
            assert_equal(x.grad, np.full(x.shape, weight(j, me), dtype), f"gradient for {j}")
    expect_raises(ValueError, FUNCS.alltoall, COMM, [np.ones(1, np.float32)] * (n + 1))


def case_bcast_function_from_every_root_sums_every_rank_gradient_on_the_root(hvd):
    n, me = COMM.size, COMM.rank
    for root in range(n):
        for dtype in FLOATS:
            data = ints(root, (3, 4), dtype)
            x = chainer.Variable(data.copy())
            y = FUNCS.bcast(COMM, x if me == root else None, root)
            assert_equal(y.array, data, f"bcast from {root}")
            (F.sum(y) * weight(me, root)).backward()
            if me == root:
                expected = sum(weight(k, root) for k in range(n))
                assert_equal(x.grad, np.full(data.shape, expected, dtype), "root's gradient")
            else:
                assert x.grad is None  # x was not an input here


def case_gather_function_of_different_shapes_scatters_gradients_back(hvd):
    n, me = COMM.size, COMM.rank
    for root in range(n):
        for dtype in FLOATS:
            xs = [ints(r, (r + 1, 2), dtype) for r in range(n)]
            x = chainer.Variable(xs[me].copy())
            out = FUNCS.gather(COMM, x, root)
            if me == root:
                assert isinstance(out, tuple) and len(out) == n
                for i, y in enumerate(out):
                    assert_equal(y.array, xs[i], f"gathered from {i}")
                sum(F.sum(y) * weight(root, i) for i, y in enumerate(out)).backward()
            else:
                assert out.shape == (0,), out.shape  # the delegate variable
                out.backward()
            assert_equal(x.grad, np.full(xs[me].shape, weight(root, me), dtype), "gradient")


def case_scatter_function_of_different_shapes_gathers_gradients_to_the_root(hvd):
    n, me = COMM.size, COMM.rank
    for root in range(n):
        for dtype in FLOATS:
            xs = [ints(r, (r + 1, 2), dtype) for r in range(n)]
            parts = [chainer.Variable(a.copy()) for a in xs]
            y = FUNCS.scatter(COMM, parts if me == root else None, root)
            assert_equal(y.array, xs[me], "my part")
            (F.sum(y) * weight(me, root)).backward()
            if me == root:
                for i, p in enumerate(parts):
                    assert_equal(p.grad, np.full(xs[i].shape, weight(i, root), dtype),
                                 f"gradient of part {i}")


def case_collective_outputs_without_a_gradient_take_part_with_zeros(hvd):
    n, me = COMM.size, COMM.rank
    x = chainer.Variable(ints(me, (2, 2), np.float32))
    ys = FUNCS.allgather(COMM, x)
    F.sum(ys[0]).backward()  # only rank 0's piece matters, on every rank
    assert_equal(x.grad, np.full((2, 2), n if me == 0 else 0, np.float32))
    parts = [chainer.Variable(np.ones((1, 2), np.float32)) for _ in range(n)]
    ys = FUNCS.alltoall(COMM, parts)
    F.sum(ys[-1]).backward()
    for j, p in enumerate(parts):
        assert_equal(p.grad, np.full((1, 2), 1.0 if me == n - 1 else 0.0, np.float32))


# ------------------------------------------------------------ send and recv
def ring_layers(n, dtype):
    """One Linear per rank, with ChainerMN's test weights."""
    with chainer.using_config("dtype", dtype):
        return [L.Linear(10, 10, initialW=np.arange(100).reshape(10, 10) / ((r + 1) * 100))
                for r in range(n)]


def start_input(dtype):
    with chainer.using_config("dtype", dtype):
        return chainer.Variable(np.arange(10).reshape(1, 10).astype(dtype) / 10)


def case_send_recv_chain_matches_one_process_in_values_and_every_gradient(hvd):
    n, me = COMM.size, COMM.rank
    for dtype in [np.float16, np.float32, chainer.mixed16]:
        with chainer.using_config("dtype", dtype):
            mine = ring_layers(n, dtype)[me]
            x = start_input(dtype)
            if me == 0:
                delegate = FUNCS.send(F.sigmoid(mine(x)), COMM, 1)
                assert delegate.shape == (0,)
                delegate.backward()
            else:
                h = FUNCS.recv(COMM, me - 1)
                y = F.sigmoid(mine(h))
                if me < n - 1:
                    FUNCS.send(y, COMM, me + 1).backward()
                else:
                    F.mean_squared_error(y, x).backward()

            reference = ring_layers(n, dtype)
            h = start_input(dtype)
            for layer in reference:
                h = F.sigmoid(layer(h))
            F.mean_squared_error(h, start_input(dtype)).backward()
            if me == n - 1:
                assert_close(y.array, h.array, f"{dtype} output")
            assert_close(mine.W.grad, reference[me].W.grad, f"{dtype} W gradient")
            assert_close(mine.b.grad, reference[me].b.grad, f"{dtype} b gradient")


def case_recv_with_a_delegate_closes_the_ring_and_backprop_reaches_rank_0_input(hvd):
    n, me = COMM.size, COMM.rank
    right, left = (me + 1) % n, (me - 1) % n
    mine = ring_layers(n, np.float32)[me]
    if me == 0:
        x = start_input(np.float32)
        delegate = FUNCS.send(F.sigmoid(mine(x)), COMM, right)
        # Without the delegate, backward would stop here and rank 1 would
        # wait forever for its gradient.
        back = FUNCS.recv(COMM, left, delegate_variable=delegate)
        F.mean_squared_error(back, start_input(np.float32)).backward()
    else:
        h = FUNCS.recv(COMM, left)
        FUNCS.send(F.sigmoid(mine(h)), COMM, right).backward()

    reference = ring_layers(n, np.float32)
    x_ref = start_input(np.float32)
    h = x_ref
    for layer in reference:
        h = F.sigmoid(layer(h))
    F.mean_squared_error(h, start_input(np.float32)).backward()
    if me == 0:
        assert_close(x.grad, x_ref.grad, "rank 0's input gradient")
    assert_close(mine.W.grad, reference[me].W.grad, "W gradient")


def case_send_of_a_list_arrives_as_a_tuple_and_each_element_gets_its_gradient(hvd):
    n, me = COMM.size, COMM.rank
    for length in (1, 2):
        layers = [L.Linear(10, 10, initialW=np.eye(10) * (i + 1)) for i in range(length)]
        x = start_input(np.float32)
        if me == 0:
            FUNCS.send([F.sigmoid(f(x)) for f in layers], COMM, 1).backward()
            # The last rank's loss, mse(sum of the elements, x), in one process.
            reference = [L.Linear(10, 10, initialW=np.eye(10) * (i + 1)) for i in range(length)]
            ys = [F.sigmoid(f(start_input(np.float32))) for f in reference]
            F.mean_squared_error(sum(ys[1:], ys[0]), start_input(np.float32)).backward()
            for f, g in zip(layers, reference):
                assert_close(f.W.grad, g.W.grad, f"length {length}")
        elif me < n - 1:
            received = FUNCS.recv(COMM, me - 1)
            assert isinstance(received, tuple) == (length > 1)
            FUNCS.send(received, COMM, me + 1).backward()
        else:
            received = FUNCS.recv(COMM, me - 1, force_tuple=True)
            assert isinstance(received, tuple) and len(received) == length
            F.mean_squared_error(sum(received[1:], received[0]), x).backward()


def case_send_of_a_plain_array_still_runs_backward_on_both_sides(hvd):
    n, me = COMM.size, COMM.rank
    data = np.ones((1, 10), np.float32)
    if me == 0:
        delegate = FUNCS.send(data, COMM, 1)
        x, = FUNCS.pseudo_connect(delegate, data)
        F.sum(x).backward()  # receives the peer's gradient, or hangs
    elif me < n - 1:
        FUNCS.send(FUNCS.recv(COMM, me - 1), COMM, me + 1).backward()
    else:
        x = FUNCS.recv(COMM, me - 1)
        assert_equal(x.array, data)
        F.sum(x * 2).backward()


def case_send_and_recv_to_this_rank_are_refused(hvd):
    x = chainer.Variable(np.ones(2, np.float32))
    exc = expect_raises(ValueError, FUNCS.send, x, COMM, COMM.rank)
    assert "deadlock" in str(exc)
    expect_raises(ValueError, FUNCS.recv, COMM, COMM.rank)
    expect_raises(ValueError, COMM.send, np.ones(2), COMM.rank, 0)
    expect_raises(ValueError, COMM.recv, COMM.size, 0)


def case_messages_pair_by_tag_and_communicator(hvd):
    me = COMM.rank
    other = chainermn.create_communicator("naive")
    if me == 0:
        COMM.send(np.full(2, 1.0), 1, 7)
        other.send(np.full(2, 2.0), 1, 7)
        COMM.send((np.full(3, 3, np.int32), np.full((1, 2), 4.0)), 1, 8)
        COMM.send(np.full(2, 5.0), 1, 7)
    elif me == 1:
        assert_equal(COMM.recv(0, 7), np.full(2, 1.0))
        assert_equal(other.recv(0, 7), np.full(2, 2.0))
        got = COMM.recv(0, 8)
        assert isinstance(got, tuple) and len(got) == 2
        assert_equal(got[0], np.full(3, 3, np.int32))
        assert_equal(got[1], np.full((1, 2), 4.0))
        assert_equal(COMM.recv(0, 7), np.full(2, 5.0))
    other.finalize()


def case_a_recv_nobody_sends_is_a_stall_error_naming_the_missing_rank(hvd):
    # The test module sets HOROVOD_STALL_SHUTDOWN_TIME_SECONDS.
    me = COMM.rank
    if me == 1:
        start = time.monotonic()
        exc = expect_raises(hvd.StallError, FUNCS.recv, COMM, 0, tag="never-sent")
        assert time.monotonic() - start < 60
        assert "rank 0" in str(exc) and "never-sent" in str(exc), str(exc)
        for other in range(COMM.size):
            if other != 1:
                COMM.send_obj("done", dest=other)
    else:
        # Waiting outside the coordinator (send_obj/recv_obj are MPI's), so
        # that no operation of theirs stalls meanwhile.
        assert COMM.recv_obj(1) == "done"
    # Then the communicator still works.
    assert_equal(COMM.allreduce(np.ones(2)), np.full(2, float(COMM.size)))


# --------------------------------------------------------- MultiNodeChainList
D = 4


class Sum(chainer.Chain):
    """Adds its inputs, then a Linear (ChainerMN's BranchSubB)."""

    def __init__(self, seed):
        super().__init__(f=linear(seed))

    def forward(self, *xs):
        return self.f(sum(xs[1:], xs[0]))


class Pair(chainer.Chain):
    """Returns two outputs (ChainerMN's TupleDataSubA)."""

    def __init__(self, seed):
        super().__init__(f0=linear(seed), f1=linear(seed + 1))

    def forward(self, x):
        return self.f0(x), self.f1(x)


class Unpair(chainer.Chain):
    """Takes the pair as one tuple (ChainerMN's TupleDataSubB)."""

    def __init__(self, seed):
        super().__init__(f0=linear(seed), f1=linear(seed + 1))

    def forward(self, x):
        x0, x1 = x
        return self.f0(x0) + self.f1(x1)


class TwoInputs(chainer.Chain):
    """Takes two model inputs."""

    def __init__(self, seed):
        super().__init__(f0=linear(seed), f1=linear(seed + 1))

    def forward(self, x0, x1):
        return self.f0(x0) + self.f1(x1)


class Merge(chainer.Chain):
    """Takes one tuple from each sender; returns a tuple as the model's output."""

    def __init__(self, seed):
        super().__init__(f=linear(seed))

    def forward(self, *pairs):
        total = sum(a + b * 2 for a, b in pairs)
        return self.f(total), total * 3


def linear(seed):
    w = np.random.RandomState(seed).uniform(-1, 1, (D, D)).astype(np.float32)
    return L.Linear(D, D, initialW=w, initial_bias=seed % 7 / 10)


def topology(name, r, n):
    """Rank r's components as (link, rank_in, rank_out), after the models of
    ChainerMN's test_multi_node_chain_list.py; links are seeded by rank and
    position, so any process can build any rank's."""
    nxt, prv = (r + 1) % n, (r - 1) % n
    s = 100 * r
    children = list(range(1, n))
    if name == "cycle":
        if r == 0:
            return [(linear(s), None, nxt), (linear(s + 1), prv, None)]
        return [(linear(s), prv, nxt)]
    if name == "cross":
        if r == 0:
            return [(linear(s), None, nxt), (linear(s + 1), prv, None)]
        return [(linear(s + 1), prv, None), (linear(s), None, nxt)]
    if name.startswith("branch"):
        if r > 0:
            return [(linear(s), 0, 0)]
        rotated = children[1:] + [0] + children[:1]
        ranks = {"branch1": children, "branch2": [0] + children,
                 "branch3": children + [0], "branch4": rotated}[name]
        if name == "branch1":
            return [(linear(s), None, children), (Sum(s + 1), children, None)]
        return [(linear(s), None, ranks), (linear(s + 2), 0, 0), (Sum(s + 1), ranks, None)]
    if name == "twist":
        if r == 0:
            return [(linear(s), None, nxt), (linear(s + 1), nxt, None)]
        if r == n - 1:
            return [(linear(s), prv, None), (linear(s + 1), None, prv)]
        return [(linear(s), prv, r), (linear(s + 1), None, prv), (linear(s + 2), None, nxt),
                (linear(s + 3), nxt, r), (Sum(s + 4), [r, r], None)]
    if name == "extras":  # beyond ChainerMN's tests
        if r == 0:
            return [(TwoInputs(s), None, children), (Merge(s + 2), children, None)]
        return [(Pair(s), 0, 0)]
    if name == "tuple":
        if r % 2 == 0 and r == n - 1:
            return []  # the odd one out
        if r % 2 == 0:
            return [(Pair(s), None, nxt), (linear(s + 2), nxt, None)]
        return [(Unpair(s), prv, prv)]
    raise ValueError(name)


def has_inputs(name, r, n):
    comps = topology(name, r, n)
    return any(rank_in is None for _, rank_in, _ in comps)


def has_output(name, r, n):
    return any(rank_out is None for _, _, rank_out in topology(name, r, n))


def as_list(ranks):
    return [ranks] if isinstance(ranks, int) else list(ranks)


def simulate(specs, inputs):
    """Runs every rank's components in this process, messages in queues, as
    MultiNodeChainList would across ranks; returns {rank: output}."""
    queues = collections.defaultdict(collections.deque)
    outputs = {}

    def program(r):
        own = collections.deque()
        y = None
        for link, rank_in, rank_out in specs[r]:
            if rank_in is None:
                xs = inputs[r]
            else:
                xs = []
                for src in as_list(rank_in):
                    queue = own if src == r else queues[src, r]
                    while not queue:
                        yield
                    xs.append(queue.popleft())
            x = link(*xs)
            if rank_out is None:
                y = x
            else:
                for dst in as_list(rank_out):
                    (own if dst == r else queues[r, dst]).append(x)
        outputs[r] = y

    running = [program(r) for r in range(len(specs))]
    for _ in range(1000):
        for p in list(running):
            try:
                next(p)
            except StopIteration:
                running.remove(p)
        if not running:
            return outputs
    raise AssertionError("the reference model deadlocks")


def step_data(name, r, step):
    """(model inputs, target) of rank r at this step."""
    rng = np.random.RandomState(1000 * step + r)
    xs = tuple(rng.uniform(-1, 1, (1, D)).astype(np.float32)
               for _ in range(2 if name == "extras" and r == 0 else 1))
    return xs, rng.uniform(-1, 1, (1, D)).astype(np.float32)


def loss_of(out, t):
    if isinstance(out, tuple):
        return sum(F.mean_squared_error(y, t) for y in out)
    return F.mean_squared_error(out, t)


def check_topology(name, steps=3):
    n, me = COMM.size, COMM.rank
    components = topology(name, me, n)
    if components:
        model = chainermn.MultiNodeChainList(COMM)
        for link, rank_in, rank_out in components:
            model.add_link(link, rank_in=rank_in, rank_out=rank_out)
        model.cleargrads()
        for step in range(steps):
            xs, t = step_data(name, me, step)
            out = model(*xs) if has_inputs(name, me, n) else model()
            if has_output(name, me, n):
                loss_of(out, t).backward()
            else:
                out.backward()

    specs = [topology(name, r, n) for r in range(n)]
    for spec in specs:
        for link, _, _ in spec:
            link.cleargrads()
    for step in range(steps):
        data = [step_data(name, r, step) for r in range(n)]
        outputs = simulate(specs, [xs for xs, _ in data])
        losses = [loss_of(y, data[r][1]) for r, y in outputs.items() if y is not None]
        sum(losses[1:], losses[0]).backward()
    for i, ((link, _, _), (ref, _, _)) in enumerate(zip(components, specs[me])):
        for (pname, p), (_, q) in zip(sorted(link.namedparams()), sorted(ref.namedparams())):
            assert_close(p.grad, q.grad, f"{name}: component {i} {pname}")


def case_chain_list_cycle_through_every_rank_has_one_process_gradients(hvd):
    check_topology("cycle")


def case_chain_list_crossing_models_have_one_process_gradients(hvd):
    check_topology("cross")


def case_chain_list_branching_to_every_rank_and_to_itself_has_one_process_gradients(hvd):
    for name in ("branch1", "branch2", "branch3", "branch4"):
        check_topology(name)


def case_chain_list_twisting_model_has_one_process_gradients(hvd):
    check_topology("twist")


def case_chain_list_passing_tuples_has_one_process_gradients(hvd):
    check_topology("tuple")


def case_chain_list_takes_several_inputs_and_tuples_from_several_ranks(hvd):
    check_topology("extras")


def case_chain_list_refuses_bad_ranks_and_a_second_output(hvd):
    model = chainermn.MultiNodeChainList(COMM)
    expect_raises(ValueError, model.add_link, linear(0), rank_in=COMM.size)
    expect_raises(ValueError, model.add_link, linear(0), rank_out=[-1])
    model.add_link(linear(0), rank_in=None, rank_out=None)
    exc = expect_raises(ValueError, model.add_link, linear(1), rank_in=None, rank_out=None)
    assert "rank_out is None" in str(exc)
    assert len(model) == 1


def case_chain_list_with_an_unmatched_self_send_raises(hvd):
    model = chainermn.MultiNodeChainList(COMM)
    model.add_link(linear(0), rank_in=None, rank_out=COMM.rank)
    exc = expect_raises(ValueError, model, np.ones((1, D), np.float32))
    assert "queue is not empty" in str(exc)


# ------------------------------------------------------- multi-node NStep RNN
def seeded_rnn(cls, r):
    np.random.seed(50 + r)
    return cls(1, 3, 3, 0.0)


def sequences(r):
    rng = np.random.RandomState(70 + r)
    return [rng.uniform(-1, 1, (length, 3)).astype(np.float32) for length in (4, 2)]


def rnn_loss(states, ys, last):
    loss = sum(F.sum(y * y) for y in ys)
    if last:  # distinct weights per state: swapped gradients would show
        for k, state in enumerate(states):
            loss += F.sum(state) * (3 + 2 * k)
    return loss


def case_multi_node_n_step_rnn_across_ranks_has_one_process_gradients(hvd):
    n, me = COMM.size, COMM.rank
    for cls in (L.NStepLSTM, L.NStepGRU):
        rnn = seeded_rnn(cls, me)
        link = chainermn.links.create_multi_node_n_step_rnn(
            rnn, COMM, rank_in=me - 1 if me > 0 else None,
            rank_out=me + 1 if me < n - 1 else None)
        link.cleargrads()
        *states, ys, delegate = link(sequences(me))
        assert (delegate is None) == (me == n - 1)
        loss, = FUNCS.pseudo_connect(delegate, rnn_loss(states, ys, me == n - 1))
        loss.backward()

        reference = [seeded_rnn(cls, r) for r in range(n)]
        total, states = 0, [None] * rnn.n_cells
        for r, ref in enumerate(reference):
            ref.cleargrads()
            *states, ys = ref(*states, sequences(r))
            total += rnn_loss(states, ys, r == n - 1)
        total.backward()
        for (pname, p), (_, q) in zip(sorted(rnn.namedparams()),
                                      sorted(reference[me].namedparams())):
            assert_close(p.grad, q.grad, f"{cls.__name__} {pname}")


def case_multi_node_n_step_rnn_refuses_other_links(hvd):
    exc = expect_raises(ValueError, chainermn.links.create_multi_node_n_step_rnn,
                        L.Linear(2, 2), COMM)
    assert "NStepRNN" in str(exc)
