"""What a rank owes: global-set operations that failed before it submitted
its copy.

Rank 0 fails an operation on every member when one refused it, it stalled
or its group cannot complete (controller.py). A member that had not
submitted it yet gets a notice (the error Response) in a round's answer.
Its copy, once submitted, fails with that error at once: it never reaches
rank 0, which has forgotten the operation, so every rank's Nth submission
of a name is only ever combined with the others' Nth.

`Owed` is the member's ledger of those notices, plain Python: the
background thread records a notice no waiting entry took (`due_now`), and
asks the ledger for each submission (`pay`).
"""


class Owed:
    """Notices not yet paid, oldest first: by (set, name), and by (set,
    group) for a group's whole batch."""

    __slots__ = ("_by_key", "_by_group")

    def __init__(self):
        self._by_key = {}
        self._by_group = {}

    def __bool__(self):
        return bool(self._by_key or self._by_group)

    def owe(self, notice):
        """Records a notice for a copy not submitted yet."""
        if notice.group:
            where, key = self._by_group, (notice.process_set_id, notice.group)
        else:
            where, key = self._by_key, (notice.process_set_id, notice.names[0])
        where.setdefault(key, []).append(notice)

    def pay(self, e, paid_groups):
        """The notice submitted entry `e` fails with, or None where it owes
        nothing. The entries of one group's batch share its notice:
        `paid_groups`, one dict for the entries submitted together,
        remembers the notice a batch paid with.

        A refusal pays too: it is this rank's copy of the operation that
        failed, so it stays here. Sent on, rank 0 took it for a refusal of
        the next copy, and failed the other ranks' next submission of that
        name with this rank's old reason (two ranks refusing an alltoall
        of one name a moment apart failed every later valid one). A group's
        refusal stands for its whole instance: the next instance, perhaps
        submitted together with it, does not share its notice."""
        if e.key in self._by_key:
            return _pop(self._by_key, e.key)
        if not e.group:
            return None
        gkey = (e.key[0], e.group)
        if e.rejected:
            return _pop(self._by_group, gkey) if gkey in self._by_group else None
        notice = paid_groups.get(gkey)
        if notice is None and gkey in self._by_group:
            notice = paid_groups[gkey] = _pop(self._by_group, gkey)
        return notice


def due_now(notice, waiting):
    """The entries among those `waiting` (submitted, not yet negotiated) that
    `notice` fails at once: every one of its group, or the first of its
    name. None where it is owed for a later submission."""
    pset = notice.process_set_id
    if notice.group:
        due = [e for e in waiting if e.group == notice.group and e.key[0] == pset]
    else:
        key = (pset, notice.names[0])
        due = [e for e in waiting if e.key == key][:1]
    return due or None


def _pop(owed, key):
    notices = owed[key]
    notice = notices.pop(0)
    if not notices:
        del owed[key]
    return notice
