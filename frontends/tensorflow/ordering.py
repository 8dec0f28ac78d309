"""The order in which a graph's collectives run: the order they were created.

A collective op blocks the executor thread that runs it until every rank of
its process set has submitted it. TensorFlow's executor starts ops whose
inputs are ready in whatever order it likes, and that order differs between
ranks. So in a graph that holds more independent collectives than the
executor has threads, each rank ends up with all its threads waiting in
collectives the others have not started: the job deadlocks (a
tf.compat.v1 graph of 26 independent collectives on 2 ranks with 2
inter-op threads did, every time). Horovod's kernels are asynchronous and
hold no thread while they wait.

`in_creation_order` gives each collective a control dependency on the one
created before it in the same graph, so every rank runs a graph's
collectives in one order, one at a time, and a blocked collective never
waits on one that its own rank has not started:

- Graphs TensorFlow already orders are left alone. In a `tf.function`,
  automatic control dependencies chain every stateful op in program order
  (auto_control_deps.py), collectives included, and `cond`/`while_loop`
  bodies are functions ordered the same way. Nothing is added there: a
  traced function's graph is the same as without this module.
- In other graphs (tf.compat.v1 graphs run by a Session, `wrap_function`,
  and the function bodies of `tf.cond`/`tf.while_loop` built in them) each
  control-flow context has its own chain, because control inputs may not
  cross while-loop frames. The first collective of a nested TF1 context or
  of a `tf.cond` branch follows the enclosing chain (TensorFlow routes that
  edge into the while frame, or onto the If op); an op that calls a
  function holding collectives (If, Case, a tf.function call) joins the
  enclosing chain when the next collective there is created. While ops get
  no control inputs (TensorFlow's while-loop gradient adds inputs to them
  and then rejects the op, "Control dependencies must come after regular
  dependencies"): a loop is only ordered before the collectives after it.

What it costs. In a graph run by a Session, fetching a collective also runs
the collectives created before it in the same graph, with their inputs, as
a tf.function runs all of its stateful ops; ranks that fetch the same things
still run the same collectives. Not ordered: iterations of one while loop
whose collectives do not depend on each other's results (they reuse one
name, so give the loop `parallel_iterations=1`), and function calls created
after a graph's last collective.

`apart()` is for an op that must not pull the others in: collectives created
under it chain among themselves only, and later ones do not follow them. A
TF1 program creates the broadcast of its global variables after its training
step and runs it on its own, once, without the step's feeds (legacy.py);
chained, it would run the step's collectives too and want their
placeholders fed.

Why not a non-blocking submit op plus a wait op, chained submissions and
free waits? Fetching a result would pull in the earlier submissions but not
their waits, leaving tensors in flight that the next step submits again;
and inside a tf.function automatic control dependencies would chain each
submission behind the previous wait anyway, doubling the Python ops for no
overlap.
"""

import contextlib
import weakref

from tensorflow.python.framework import func_graph as _func_graph
from tensorflow.python.framework import ops as _tf_ops
from tensorflow.python.ops import control_flow_v2_func_graphs as _cf_graphs

# Ops that call functions. While ops are never given control inputs: the
# gradient of a while loop adds inputs to the While op, and TensorFlow then
# rejects it ("Control dependencies must come after regular dependencies").
_CALL_OP_TYPES = frozenset(("If", "StatelessIf", "While", "StatelessWhile", "Case",
                            "StatelessCase", "PartitionedCall", "StatefulPartitionedCall"))
_WHILE_OP_TYPES = frozenset(("While", "StatelessWhile"))
_WHILE_GRAPHS = (_cf_graphs.WhileCondFuncGraph, _cf_graphs.WhileBodyFuncGraph)

_CHAINS = weakref.WeakKeyDictionary()  # graph -> _Chains
_HOLDING_COLLECTIVES = weakref.WeakSet()  # function graphs with a collective, nested included


class _Chains:
    """A graph's chains: per control-flow context, the ops the next
    collective must follow (the last collective, and While ops created
    since); and the newest op id looked at for calls of functions holding
    collectives."""

    def __init__(self):
        self.tails = {}
        self.scanned = 0


def in_creation_order(create):
    """Runs `create()` (which adds one collective op to the default graph and
    returns its outputs) so that the op runs after the collectives created
    before it in the same graph; returns the outputs."""
    graph = _tf_ops.get_default_graph()
    _mark_enclosing_functions(graph)
    if _automatically_ordered(graph):
        return create()
    chains = _CHAINS.setdefault(graph, _Chains())
    context = graph._get_control_flow_context()
    with graph.control_dependencies(_tail(graph, context)):
        outputs = create()
    op = outputs[0].op
    _chain_calls(graph, chains, op._id)
    # Calls created since the last collective. After creation, only from the
    # op's own context: TensorFlow moves control inputs into a while frame
    # only while it creates the op.
    _follow(op, chains.tails.get(context, []))
    chains.tails[context] = [op]
    return outputs


@contextlib.contextmanager
def apart():
    """Collectives created in the default graph inside this block form a
    chain of their own: they follow none created before it, and those
    created after it follow none of them. Fetch them in session runs of
    their own: ranks that run both chains in one step may each start the
    other chain first and wait on each other. Nothing changes where
    TensorFlow orders the graph itself (a tf.function)."""
    graph = _tf_ops.get_default_graph()
    if _automatically_ordered(graph):
        yield
        return
    chains = _CHAINS.setdefault(graph, _Chains())
    # Calls created before the block belong to the enclosing chains.
    _chain_calls_so_far(graph, chains)
    kept, chains.tails = chains.tails, {}
    try:
        yield
    finally:
        _chain_calls_so_far(graph, chains)
        chains.tails = kept


def _chain_calls_so_far(graph, chains):
    newest = max(graph._nodes_by_id, default=0)
    _chain_calls(graph, chains, newest + 1)
    chains.scanned = newest


def _automatically_ordered(graph):
    return graph._add_control_dependencies


def _mark_enclosing_functions(graph):
    while isinstance(graph, _func_graph.FuncGraph) and graph not in _HOLDING_COLLECTIVES:
        _HOLDING_COLLECTIVES.add(graph)
        graph = graph.outer_graph


def _follow(op, tail):
    missing = [t for t in tail if t is not op and t not in op.control_inputs]
    if missing:
        op._add_control_inputs(missing)


def _tail(graph, context):
    """The ops a new collective in `graph` under `context` must follow: the
    end of its chain, else of the enclosing contexts' chains, else (in a
    cond branch) the enclosing graph's. Never a while loop's body: a control
    input there lands on the While op (see _CALL_OP_TYPES)."""
    chains = _CHAINS.get(graph)
    while chains is not None:
        if context in chains.tails:
            return chains.tails[context]
        if context is None:
            break
        context = context.outer_context
    outer = getattr(graph, "outer_graph", None)
    if (isinstance(graph, _func_graph.FuncGraph) and not isinstance(graph, _WHILE_GRAPHS)
            and outer is not None and not _automatically_ordered(outer)):
        return _tail(outer, outer._get_control_flow_context())
    return []


def _chain_calls(graph, chains, newest_id):
    """Appends to their contexts' chains the ops created since the last look
    (up to `newest_id`) that call a function holding collectives."""
    nodes = graph._nodes_by_id
    for op_id in range(chains.scanned + 1, newest_id):
        op = nodes[op_id] if op_id in nodes else None
        if op is None or not _calls_collectives(graph, op):
            continue
        context = op._control_flow_context
        tail = chains.tails.get(context, [])
        if op.type in _WHILE_OP_TYPES:
            chains.tails[context] = tail + [op]
        else:
            _follow(op, tail)
            chains.tails[context] = [op]
    chains.scanned = max(chains.scanned, newest_id)


def _calls_collectives(graph, op):
    if op.type in _CALL_OP_TYPES:
        names = []
        for value in op.node_def.attr.values():
            if value.HasField("func"):
                names.append(value.func.name)
            names.extend(f.name for f in value.list.func)
    elif graph._is_function(op.type):
        names = [op.type]
    else:
        return False
    for name in names:
        function = graph._get_function(name)
        if getattr(function, "_cached_graph", None) in _HOLDING_COLLECTIVES:
            return True
    return False
