"""How errors, the stall inspector and the watchdog name an operation."""

from coordinator.ops_names import add_by_members_name, describe, labelled, object_exchange_name
from coordinator.wire import pb


def test_a_tensor_is_named_with_its_operation():
    assert describe(pb.ALLREDUCE, "grad.w") == "allreduce of tensor 'grad.w'"
    assert labelled("grouped_allgather", "g") == "grouped_allgather of tensor 'g'"
    assert labelled("barrier", None) == "barrier"


def test_an_object_exchange_is_named_after_the_object_operation_not_its_allgather():
    assert describe(pb.ALLGATHER, object_exchange_name("broadcast_object", "cfg")) == \
        "broadcast_object 'cfg'"
    assert labelled("allgather", object_exchange_name("allgather_object", "a.b")) == \
        "allgather_object 'a.b'"


def test_a_tensor_named_like_an_object_exchange_is_still_a_tensor():
    assert describe(pb.ALLGATHER, "broadcast_object.cfg") == \
        "allgather of tensor 'broadcast_object.cfg'"
    assert object_exchange_name("broadcast_object", "cfg") != "broadcast_object.cfg"


def test_an_add_by_a_sets_own_ranks_is_named_by_those_ranks():
    """Its stall text said "add_process_set of tensor
    'coordinator.add_process_set.0,2'"."""
    assert describe(pb.ADD_PROCESS_SET, add_by_members_name([2, 0])) == \
        "add_process_set of ranks [0, 2]"
