"""What a rank owes (coordinator/owed.py), without MPI: its copy of a
global-set operation that failed before it submitted it fails with rank 0's
notice, once per notice, and a group's batch pays one notice together."""

from coordinator.owed import Owed, due_now
from coordinator.tensor_queue import Entry
from coordinator.wire import pb


def _notice(name="", group="", pset=0, error="rank 1 refused it"):
    return pb.Response(op=pb.ALLREDUCE, names=[name] if name else [], group=group,
                       process_set_id=pset, error=error, error_kind=pb.INVALID)


def _entry(name, group="", group_size=0, rejected=""):
    return Entry(name, pb.ALLREDUCE, group=group, group_size=group_size, rejected=rejected)


def test_each_notice_fails_one_later_submission_of_its_name():
    owed = Owed()
    assert not owed
    first, second = _notice("x", error="first"), _notice("x", error="second")
    owed.owe(first)
    owed.owe(second)
    assert owed
    assert owed.pay(_entry("y"), {}) is None  # another name owes nothing
    assert owed.pay(_entry("x"), {}) is first  # oldest first
    assert owed.pay(_entry("x"), {}) is second
    assert not owed and owed.pay(_entry("x"), {}) is None  # paid: the next one runs


def test_a_refusal_pays_what_its_copy_owes():
    """A refused copy is this rank's copy of the operation that failed: it
    pays, and the next real copy runs. (Sent on to rank 0 instead, it
    failed the others' next copy with this rank's old reason.)"""
    owed = Owed()
    owed.owe(_notice("x"))
    assert owed.pay(_entry("x", rejected="bad dtype"), {}) is not None
    assert not owed and owed.pay(_entry("x"), {}) is None
    assert owed.pay(_entry("x", rejected="bad dtype"), {}) is None  # nothing owed: told


def test_a_groups_refusal_pays_for_its_instance_alone():
    """The refusal and the group's next instance may be drained together:
    the next instance does not share the refusal's notice."""
    owed = Owed()
    owed.owe(_notice(group="g", error="refused"))
    batch = {}
    assert owed.pay(_entry("g", "g", 2, rejected="bad dtype"), batch).error == "refused"
    assert [owed.pay(_entry(n, "g", 2), batch) for n in ("a", "b")] == [None, None]


def test_a_groups_batch_pays_one_notice_together():
    owed = Owed()
    first, second = _notice(group="g", error="first"), _notice(group="g", error="second")
    owed.owe(first)
    owed.owe(second)
    batch = {}  # the entries drained together
    assert [owed.pay(_entry(n, "g", 2), batch) for n in ("a", "b")] == [first, first]
    later = {}
    assert [owed.pay(_entry(n, "g", 2), later) for n in ("a", "b")] == [second, second]
    assert not owed and owed.pay(_entry("a", "g", 2), {}) is None


def test_a_notice_of_the_name_comes_before_its_groups():
    owed = Owed()
    by_name, by_group = _notice("a"), _notice(group="g")
    owed.owe(by_group)
    owed.owe(by_name)
    assert owed.pay(_entry("a", "g", 2), {}) is by_name
    assert owed.pay(_entry("a", "g", 2), {}) is by_group


def test_waiting_copies_are_due_at_once_else_the_notice_is_kept():
    x1, x2, other_set = _entry("x"), _entry("x"), Entry("x", pb.ALLREDUCE, process_set_id=1)
    ga, gb = _entry("a", "g", 2), _entry("b", "g", 2)
    waiting = [other_set, x1, ga, x2, gb]
    assert due_now(_notice("x"), waiting) == [x1]  # the first of its name only
    assert due_now(_notice(group="g"), waiting) == [ga, gb]  # its whole group
    assert due_now(_notice("y"), waiting) is None
    assert due_now(_notice("x", pset=2), waiting) is None
