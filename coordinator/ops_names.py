"""Human-readable names of wire enums, for errors, logs and the timeline."""

from coordinator.wire import pb

OP_NAMES = {
    pb.ALLREDUCE: "allreduce",
    pb.ALLGATHER: "allgather",
    pb.BROADCAST: "broadcast",
    pb.ALLTOALL: "alltoall",
    pb.REDUCESCATTER: "reducescatter",
    pb.BARRIER: "barrier",
    pb.JOIN: "join",
    pb.ADD_PROCESS_SET: "add_process_set",
    pb.REMOVE_PROCESS_SET: "remove_process_set",
    pb.P2P: "send/recv",
}

REDUCE_OP_NAMES = {
    pb.AVERAGE: "Average",
    pb.SUM: "Sum",
    pb.ADASUM: "Adasum",
    pb.MIN: "Min",
    pb.MAX: "Max",
    pb.PRODUCT: "Product",
}

CPU_DEVICE = -1

# The coordinator's own operations are named in a namespace of their own, which
# a program's tensor names may not enter (collectives._name): a tensor named
# 'join' met join()'s entry on a joined rank, which took it for the tensor and
# stopped the job; one named 'barrier.0' met a barrier.
INTERNAL_PREFIX = "coordinator."
JOIN_NAME = INTERNAL_PREFIX + "join"
ADD_PROCESS_SET_NAME = INTERNAL_PREFIX + "add_process_set"
REMOVE_PROCESS_SET_NAME = INTERNAL_PREFIX + "remove_process_set"


# Python objects travel as allgathers of bytes (objects.py) named in that
# namespace too, so a tensor named 'broadcast_object.x' meets none of them,
# and errors name the object operation, not the allgather under it.
OBJECT_OPERATIONS = ("broadcast_object", "allgather_object")


def object_exchange_name(kind, name):
    """The allgather's name of `kind` ('broadcast_object', 'allgather_object')
    called with `name`."""
    return f"{INTERNAL_PREFIX}{kind}.{name}"


def add_by_members_name(ranks):
    """The name of an add_process_set by the set's own ranks
    (basics.add_process_set_of_members): one per set of ranks."""
    return f"{ADD_PROCESS_SET_NAME}.{','.join(str(r) for r in sorted(ranks))}"


def barrier_name(process_set_id):
    return f"{INTERNAL_PREFIX}barrier.{process_set_id}"


def op_name(op):
    return OP_NAMES.get(op, f"op#{op}")


def labelled(kind, name):
    """How every error names an operation: "allreduce of tensor 'x'", or
    "broadcast_object 'x'" for an object exchange. `kind` is the operation's
    name ('allreduce'), `name` the tensor's full name (None: `kind` alone)."""
    if not name:
        return kind
    if name.startswith(INTERNAL_PREFIX):
        if name.startswith(ADD_PROCESS_SET_NAME + "."):
            ranks = name[len(ADD_PROCESS_SET_NAME) + 1:].replace(",", ", ")
            return f"add_process_set of ranks [{ranks}]"
        for operation in OBJECT_OPERATIONS:
            prefix = f"{INTERNAL_PREFIX}{operation}."
            if name.startswith(prefix):
                return f"{operation} '{name[len(prefix):]}'"
    return f"{kind} of tensor '{name}'"


def describe(op, name):
    """`labelled` for a wire op (pb.ALLREDUCE)."""
    return labelled(op_name(op), name)


def reduce_op_name(op):
    return REDUCE_OP_NAMES.get(op, f"reduce_op#{op}")


def device_name(device):
    return "CPU" if device == CPU_DEVICE else f"GPU {device}"


def format_ranks(ranks):
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def display_name(process_set_id, name):
    """A tensor's name in logs and the timeline: names are per process set."""
    return name if not process_set_id else f"{name} (process set {process_set_id})"
