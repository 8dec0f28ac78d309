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


def op_name(op):
    return OP_NAMES.get(op, f"op#{op}")


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
