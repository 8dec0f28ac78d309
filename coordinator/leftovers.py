"""What MPI may still touch after the coordinator has let go of it.

The coordinator stops waiting for some requests before they complete: the
negotiation cycle in flight at shutdown (a peer may never post its part),
the collectives of a step a peer never joined (`Executor.abandon`), a
control message it could not take back (`ControlChannel.cancel_sends`).
MPI does not forget them. It progresses whatever is posted, and
MPI_Finalize does so until every process has reached it (its closing
fence), so a peer that posts its part late completes them then: MPI writes
into their receive buffers and reads their send buffers.

mpi4py calls MPI_Finalize from a `Py_AtExit` hook, which runs after the
interpreter has torn its modules down and freed their objects: a buffer
held by Python alone is gone by then, and so is the request object, whose
deallocation frees the MPI request still in use. Measured at np=3 (a
process set's allgathers, HOROVOD_CACHE_CAPACITY=2, so the cycle's buffers
are 40 bytes): valgrind saw `opal_convertor_unpack` write into the cycle's
freed receive buffer during MPI_Finalize in 4 runs of 12, and without
valgrind glibc aborted the process after it had printed its results
("corrupted double-linked list" in `mca_pml_ob1_del_comm`), or it died of
SIGSEGV, in 5 runs of 160; in none of 200 once they were kept.

So they are kept here, in a list whose reference count never drops to
zero: the interpreter never frees it, nor what it holds. What it holds is
small (a cycle's words, a control message, the operations of a step that
failed) and a process gathers few of them.
"""

import ctypes

_KEPT = []
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT))


def keep(obj):
    """Keeps `obj` (and what it references) alive until the process ends."""
    _KEPT.append(obj)

