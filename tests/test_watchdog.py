"""Rank 0's watchdog (watchdog.py), with an injected clock: which members of
a collective in flight it pings, warns about and fails the job over."""

from coordinator.watchdog import Watchdog
from coordinator.wire import pb

CHECK, SHUTDOWN = 2.0, 5.0
MEMBERS = {0: (0, 1, 2)}.get
LANE = (0, -1)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _dog():
    clock = Clock()
    return Watchdog(0, CHECK, SHUTDOWN, clock=clock), clock


def _own(started, seq=7, name="grad"):
    """Rank 0 runs `name`, the seq-th operation of the global set's host lane."""
    return [(0, name, pb.ALLREDUCE, started, -1, seq)]


def _run(dog, clock, until, own, answers=(1, 2), positions=None, own_positions=None,
         running=(1,), every=None):
    """Steps the clock to `until`, every 0.25 s: each rank in `answers`
    answers with its report (`running` ones list the collective, with its
    counts from `positions`), or every `every[rank]`-th step. Returns every
    warning and the first fatal."""
    warnings, fatal = [], None
    started = clock.now
    step = 0
    while clock.now < until and fatal is None:
        step += 1
        for rank in answers:
            if step % (every or {}).get(rank, 1):
                continue
            items = ([(0, "grad", pb.ALLREDUCE, clock.now - started, -1, 7)]
                     if rank in running else [])
            dog.report(rank, items, positions=(positions or {}).get(rank))
        _, said, fatal = dog.inspect(own, MEMBERS, own_positions=own_positions)
        warnings += said
        clock.now += 0.25
    return warnings, fatal


def test_a_member_that_answers_but_never_started_the_collective_is_named_then_fails_it():
    dog, clock = _dog()
    own = _own(clock.now)
    positions = {1: {LANE: 7}, 2: {LANE: 6}}  # rank 2 is one operation behind
    warnings, fatal = _run(dog, clock, clock.now + 10, own, positions=positions,
                           own_positions={LANE: 7})
    assert warnings and all("rank 2 answers but has not started it" in w for w in warnings)
    assert "allreduce of tensor 'grad'" in warnings[0] and "ranks 0, 1" in warnings[0]
    assert fatal is not None and "rank 2 answers but has not started it" in fatal, fatal
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" in fatal
    assert "rank 1" not in fatal.split(" on ")[0], fatal


def test_reports_a_little_late_do_not_restart_the_count_of_how_long_a_member_is_behind():
    """Rank 2's reports come every 0.75 s, more than a period (0.5 s) apart:
    it still fails the job after the shutdown time."""
    dog, clock = _dog()
    start = clock.now
    warnings, fatal = _run(dog, clock, clock.now + 10, _own(clock.now),
                           positions={1: {LANE: 7}, 2: {LANE: 6}},
                           own_positions={LANE: 7}, every={2: 3})
    assert fatal is not None and "rank 2 answers but has not started it" in fatal, fatal
    assert clock.now - start < SHUTDOWN + 2.0, clock.now - start


def test_members_that_started_it_are_never_named_even_once_done_with_it():
    """Rank 2 started the collective (its count reached its place) and is
    no longer in it: it waits on nobody's behalf and is not named."""
    dog, clock = _dog()
    own = _own(clock.now)
    positions = {1: {LANE: 7}, 2: {LANE: 9}}
    warnings, fatal = _run(dog, clock, clock.now + 10, own, positions=positions,
                           own_positions={LANE: 7})
    assert warnings == [] and fatal is None


def test_a_member_whose_count_is_unknown_is_pinged_for_it_not_named():
    dog, clock = _dog()
    own = _own(clock.now)
    dog.report(1, [], positions={LANE: 7})
    dog.report(2, [])  # no count: an older worker, or no report yet
    clock.now += 1.0
    pings, warnings, fatal = dog.inspect(own, MEMBERS, own_positions={LANE: 7})
    assert 2 in pings and warnings == [] and fatal is None


def test_rank_0_itself_behind_is_named():
    dog, clock = _dog()
    positions = {1: {LANE: 7}, 2: {LANE: 7}}
    warnings, fatal = _run(dog, clock, clock.now + 10, [], positions=positions,
                           own_positions={LANE: 6}, running=(1, 2))
    assert fatal is not None and "rank 0 answers but has not started it" in fatal, fatal


def test_uncounted_work_never_names_a_member_that_answers():
    """A negotiation cycle has no place in a lane: members that answer are
    never named for it."""
    dog, clock = _dog()
    own = [(0, "(a negotiation cycle)", pb.BARRIER, clock.now, -1, 0)]
    warnings, fatal = _run(dog, clock, clock.now + 10, own, positions={2: {LANE: 0}},
                           own_positions={LANE: 7}, running=())
    assert warnings == [] and fatal is None


def test_a_silent_member_is_named_and_not_the_ones_it_holds_up():
    """Rank 1 stopped answering; rank 2 answers but is behind (it waits for
    rank 1 elsewhere): the stopped one is named, as before."""
    dog, clock = _dog()
    own = _own(clock.now)
    warnings, fatal = _run(dog, clock, clock.now + 10, own, answers=(2,),
                           positions={2: {LANE: 6}}, own_positions={LANE: 7})
    assert fatal is not None and "rank 1 has not answered" in fatal, fatal
    assert not any("answers but" in w for w in warnings), warnings


def test_a_short_wait_names_nobody():
    dog, clock = _dog()
    own = _own(clock.now)
    warnings, fatal = _run(dog, clock, clock.now + CHECK - 0.5, own,
                           positions={1: {LANE: 7}, 2: {LANE: 6}}, own_positions={LANE: 7})
    assert warnings == [] and fatal is None


def test_disabled_checks_without_a_silence_limit_do_nothing():
    clock = Clock()
    dog = Watchdog(0, CHECK, SHUTDOWN, disabled=True, clock=clock)
    assert dog.inspect(_own(0.0), MEMBERS, own_positions={LANE: 0}) == (set(), [], None)


def test_disabled_checks_keep_only_the_silence_limit():
    """HOROVOD_STALL_CHECK_DISABLE quiets the warnings and drops the stall
    shutdown time; a member that stops answering still fails the job after
    COORDINATOR_SILENT_RANK_SECONDS, where it used to hang it for good."""
    clock = Clock()
    dog = Watchdog(0, CHECK, SHUTDOWN, disabled=True, clock=clock, silence=8.0)
    own = _own(clock.now)
    warnings, fatal = _run(dog, clock, clock.now + 7.5, own, answers=(2,))
    assert warnings == [] and fatal is None  # past CHECK and SHUTDOWN: neither holds
    warnings, fatal = _run(dog, clock, clock.now + 2, own, answers=(2,))
    assert warnings == [] and "rank 1 has not answered for 8.0 s" in fatal, fatal
    assert fatal.endswith("(COORDINATOR_SILENT_RANK_SECONDS)"), fatal


def test_a_worker_with_checks_disabled_keeps_only_the_silence_limit():
    from coordinator.watchdog import CoordinatorWatch

    clock = Clock()
    watch = CoordinatorWatch(CHECK, SHUTDOWN, disabled=True, clock=clock, silence=8.0)
    said, fatal = [], None
    while fatal is None and clock.now < 130:
        if watch.report_due(busy=True):
            watch.sent_report(listed_ops=True)
        text, fatal = watch.inspect("allreduce of tensor 'grad'")
        said += [text] if text else []
        clock.now += 0.25
    assert said == [] and fatal.endswith("(COORDINATOR_SILENT_RANK_SECONDS)"), (said, fatal)
    assert "has not answered for 8.0 s" in fatal and clock.now < 111, fatal


def test_inside_says_which_long_collective_a_rank_is_in():
    """What the stall inspector adds about a rank that did not submit a
    tensor: the collective it has been inside for a while."""
    dog, clock = _dog()
    start = clock.now
    own = [(1, "a", pb.ALLREDUCE, start, -1, 3), (0, "(a negotiation cycle)", pb.BARRIER,
                                                  start - 50, -1, 0)]
    clock.now += 1.5
    dog.report(2, [(0, "b", pb.BROADCAST, 1.0, -1, 4)])
    clock.now += 0.5
    assert dog.inside(0, own) == "allreduce of tensor 'a' in process set 1 for 2.0 s"
    assert dog.inside(2, own) == "broadcast of tensor 'b' for 1.5 s"  # 1 s at the report
    assert dog.inside(1, own) is None  # nothing reported
    dog.report(1, [(0, "(a negotiation cycle)", pb.BARRIER, 9.0, -1, 0)])
    assert dog.inside(1, own) is None  # waiting in a cycle is what a stall looks like
    clock.now += 3 * dog.period + 0.1
    assert dog.inside(2, own) is None  # its report is stale: it may be done
    assert dog.inside(0, [(0, "c", pb.ALLREDUCE, clock.now, -1, 5)]) is None  # just started


def test_inside_names_the_silent_member_that_holds_that_collective_up():
    """Rank 1 never submits rank 0's tensor because it sits in a broadcast of
    set 2 ({1, 2}) that stopped rank 2 never joins: the stall inspector's
    error about rank 0's tensor named rank 1 and its broadcast, not rank 2,
    where the watchdog's own error (a moment later) named rank 2."""
    dog, clock = _dog()
    members = {0: (0, 1, 2), 1: (0, 1), 2: (1, 2)}.get
    start = clock.now
    while clock.now < start + 3.0:
        dog.report(1, [(2, "b", pb.BROADCAST, clock.now - start, -1, 4)])
        dog.inspect([], members, clock.now)  # rank 2 never answers its pings
        clock.now += 0.25
    said = dog.inside(1, [], clock.now, members)
    assert said.startswith("broadcast of tensor 'b' in process set 2 for 3."), said
    assert ", waiting for rank 2, which has not answered for 2." in said, said
    assert said.waiting_for == {2}  # (so the stall text names rank 2 once)
    assert dog.inside(1, [], clock.now) == said.split(",")[0]  # (without members_of)
    assert list(dog.silent_ranks(clock.now)) == [2]  # (the stall texts say it)
    dog.heard(2, clock.now)  # it answers again: nothing to add
    assert dog.inside(1, [], clock.now, members) == said.split(",")[0]
    assert dog.silent_ranks(clock.now) == {}


PAIR_LANE = (0, -1, 0, 1)  # the send/recvs between ranks 0 and 1 of the global set


def _p2p(started, seq=3):
    """Rank 0 sends 'msg' to rank 1: the seq-th send/recv between them."""
    return [(0, "msg", pb.P2P, started, -1, seq, (0, 1))]


def test_a_send_recv_pings_and_names_only_its_two_ranks():
    """Only its sender and receiver take part in a send/recv: rank 2, silent
    too, is neither pinged nor named for it; rank 1 is."""
    dog, clock = _dog()
    own, pinged, warnings, fatal = _p2p(clock.now), set(), [], None
    end = clock.now + 10
    while clock.now < end and fatal is None:  # nobody answers
        pings, said, fatal = dog.inspect(own, MEMBERS, own_positions={PAIR_LANE: 3})
        pinged |= pings
        warnings += said
        clock.now += 0.25
    assert pinged == {1}
    assert warnings and all(w.startswith("send/recv of tensor 'msg': rank 1 has not answered")
                            for w in warnings), warnings
    assert fatal is not None and "rank 1 has not answered" in fatal and "rank 2" not in fatal


def test_send_recvs_are_counted_per_pair():
    """Rank 1 answers but has started only 2 of the 3 send/recvs between
    ranks 0 and 1 that rank 0 has: it is named (its count on the set's lane
    plays no part); once it has started the third, nobody is."""
    dog, clock = _dog()
    behind = {1: {PAIR_LANE: 2, LANE: 9}, 2: {LANE: 9}}
    warnings, fatal = _run(dog, clock, clock.now + 10, _p2p(clock.now), answers=(1, 2),
                           positions=behind, own_positions={PAIR_LANE: 3, LANE: 9},
                           running=())
    assert fatal is not None and fatal.startswith(
        "Stalled send/recv of tensor 'msg': rank 1 answers but has not started it"), fatal
    assert "rank 2" not in fatal
    dog, clock = _dog()
    started = {1: {PAIR_LANE: 3, LANE: 0}, 2: {LANE: 0}}
    warnings, fatal = _run(dog, clock, clock.now + 10, _p2p(clock.now), answers=(1, 2),
                           positions=started, own_positions={PAIR_LANE: 3, LANE: 9},
                           running=())
    assert warnings == [] and fatal is None


def test_a_silent_member_fails_the_job_after_the_silence_limit_without_a_shutdown_time():
    """No stall shutdown time (Horovod's default): a member that does not
    answer is stopped, not slow, so after COORDINATOR_SILENT_RANK_SECONDS the
    job fails all the same, naming it; until then it is only warned about."""
    clock = Clock()
    dog = Watchdog(0, CHECK, 0.0, clock=clock, silence=8.0)
    own = _own(clock.now)
    warnings, fatal = _run(dog, clock, clock.now + 7.5, own, answers=(2,))
    assert fatal is None and warnings and all("rank 1 has not answered" in w for w in warnings)
    warnings, fatal = _run(dog, clock, clock.now + 2, own, answers=(2,))
    assert fatal is not None and "rank 1 has not answered for 8.0 s" in fatal, fatal
    assert fatal.endswith("failed after 8 s (COORDINATOR_SILENT_RANK_SECONDS)"), fatal


def test_the_shorter_of_the_shutdown_time_and_the_silence_limit_ends_it():
    clock = Clock()
    dog = Watchdog(0, CHECK, SHUTDOWN, clock=clock, silence=60.0)
    _, fatal = _run(dog, clock, clock.now + 10, _own(clock.now), answers=(2,))
    assert fatal.endswith("stall shutdown time of 5 s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)")


def test_without_either_limit_a_silent_member_is_only_warned_about():
    clock = Clock()
    dog = Watchdog(0, CHECK, 0.0, clock=clock, silence=0.0)
    warnings, fatal = _run(dog, clock, clock.now + 30, _own(clock.now), answers=(2,))
    assert fatal is None and len(warnings) >= 10


def test_a_worker_fails_when_rank_0_stays_silent_past_the_silence_limit():
    from coordinator.watchdog import CoordinatorWatch

    clock = Clock()
    watch = CoordinatorWatch(CHECK, 0.0, clock=clock, silence=8.0)
    said, fatal = [], None
    while fatal is None and clock.now < 130:
        if watch.report_due(busy=True):
            watch.sent_report(listed_ops=True)
        text, fatal = watch.inspect("allreduce of tensor 'grad'")
        said += [text] if text else []
        clock.now += 0.25
    assert said and "rank 0 (the coordinator) has not answered" in said[0]
    assert fatal.startswith("Stalled: rank 0 (the coordinator) has not answered for 8.0 s")
    assert fatal.endswith("(COORDINATOR_SILENT_RANK_SECONDS)") and clock.now < 111, fatal


def test_a_rank_counts_as_blocked_only_while_its_reports_say_so_and_keep_coming():
    """blocked_for (the deadlock check): a report's blocked time grows with
    the clock until the next; a report saying 0 (the rank runs) clears it;
    without a report for three periods the rank is not taken for blocked
    (it may be stopped: the silence check is for that)."""
    dog, clock = _dog()
    assert dog.blocked_for(1) == 0.0
    dog.report(1, [], blocked=4.0)
    clock.now += 0.25
    assert dog.blocked_for(1) == 4.25
    dog.report(1, [], blocked=0.0)
    assert dog.blocked_for(1) == 0.0
    dog.report(1, [], blocked=10.0)
    clock.now += 3 * dog.period + 0.01
    assert dog.blocked_for(1) == 0.0
    assert Watchdog(0, 0.0, 0.0, disabled=True, deadlock=120.0).enabled


# ------------------------------------------------------------- heartbeat
def _beat(rank=0, size=3, silence=8.0, check=CHECK):
    from coordinator.watchdog import Heartbeat

    clock = Clock()
    return Heartbeat(rank, size, silence, check, clock=clock), clock


def _until_fatal(beat, clock, answering, busy=False, until=140.0):
    """Steps the clock by 0.25 s; rank 0 sends its heartbeats when due, and
    each rank in `answering` answers every one. Returns (warnings, fatal,
    heartbeats sent)."""
    said, fatal, beats = [], None, 0
    while fatal is None and clock.now < until:
        if beat.beat_due():
            beats += 1
            for rank in answering:
                beat.heard(rank)
        warnings, fatal = beat.inspect(busy)
        said += warnings
        clock.now += 0.25
    return said, fatal, beats


def test_the_heartbeat_fails_the_job_over_a_worker_silent_with_nothing_in_flight():
    """Rank 0 has nothing in flight (the others wait in MPI calls of the
    program's own): the watchdog, which watches only collectives in
    flight, never looked, and a stopped rank held the job for good. The
    heartbeat warns at the stall check time and fails at the silence
    limit, naming the rank, never the ones that answer."""
    beat, clock = _beat()
    said, fatal, beats = _until_fatal(beat, clock, answering=(2,))
    assert said and all(w.startswith("rank 1 has not answered for ") for w in said), said
    assert fatal == ("Stalled: rank 1 has not answered for 8.0 s (rank 1 is stopped, or its "
                     "coordinator thread cannot run); failed after 8 s "
                     "(COORDINATOR_SILENT_RANK_SECONDS)"), fatal
    assert beats == 9  # one a period (1 s), from the start: rank 0 sends little
    assert clock.now < 109


def test_the_heartbeat_lets_answering_ranks_be_and_leaves_busy_warnings_to_the_watchdog():
    beat, clock = _beat()
    said, fatal, _ = _until_fatal(beat, clock, answering=(1, 2), until=160.0)
    assert said == [] and fatal is None
    beat, clock = _beat()
    said, fatal, _ = _until_fatal(beat, clock, answering=(2,), busy=True)
    assert said == [] and "rank 1 has not answered for 8.0 s" in fatal  # it still fails


def test_a_worker_fails_over_rank_0_silent_with_nothing_in_flight():
    beat, clock = _beat(rank=2)
    assert not beat.beat_due()  # only rank 0 sends heartbeats
    said, fatal, _ = _until_fatal(beat, clock, answering=())
    assert fatal.startswith("Stalled: rank 0 (the coordinator) has not answered for 8.0 s"), fatal
    beat, clock = _beat(rank=2)
    for _ in range(60):
        clock.now += 0.25
        if clock.now % 1.0 == 0:
            beat.heard(0)
        assert beat.inspect() == ([], None)


def test_time_this_rank_did_not_run_is_not_counted_as_a_peers_silence():
    """The whole job suspended (SIGSTOP to every rank, a batch system's
    suspend), or a long C call holding this rank's interpreter lock: its
    peers' heartbeats wait unread, through no fault of theirs."""
    beat, clock = _beat(rank=1, check=2.0)
    beat.inspect()
    clock.now += 2.7  # this rank was stopped a while: once continued, it does not warn
    assert beat.inspect() == ([], None)
    beat.heard(0)
    clock.now += 600.0  # this rank did not run
    assert beat.inspect() == ([], None)
    fatal = None
    while fatal is None:  # nothing heard from now on, while this rank runs
        clock.now += 0.25
        _, fatal = beat.inspect()
    assert "has not answered for 8.0 s" in fatal and abs(clock.now - 710.7) < 1e-6, clock.now


def test_without_a_silence_limit_or_a_peer_there_is_no_heartbeat():
    from coordinator.watchdog import Heartbeat

    assert not Heartbeat(0, 4, 0.0).enabled  # COORDINATOR_SILENT_RANK_SECONDS=0
    assert not Heartbeat(0, 1, 120.0).enabled
    beat = Heartbeat(0, 4, 120.0)
    assert beat.enabled and beat.period == 1.0
    assert beat.inspect() == ([], None)


def test_the_watchdog_says_whether_its_fatal_is_about_a_silent_rank():
    """A silent member fails the job as SILENT (the program's own MPI calls
    waiting on it are released); one that answers but never started the
    collective is a STALL (nothing of the program's waits on a stopped
    rank)."""
    dog = Watchdog(0, CHECK, SHUTDOWN, clock=Clock())
    warnings, fatal = _run(dog, dog.clock, dog.clock.now + 10, _own(dog.clock.now),
                           answers=(2,))
    assert "rank 1 has not answered" in fatal and dog.silent
    clock = Clock()
    dog = Watchdog(0, CHECK, SHUTDOWN, clock=clock)
    positions = {1: {LANE: 7}, 2: {LANE: 6}}
    warnings, fatal = _run(dog, clock, clock.now + 10, _own(clock.now), positions=positions,
                           own_positions={LANE: 7})
    assert "rank 2 answers but has not started it" in fatal and not dog.silent


def test_the_heartbeat_names_every_rank_not_answering_when_it_fails_the_job():
    """Two ranks of a host, one stopped: the other's messages may be held up
    as long (measured on two hosts of namespaces), and rank 0 cannot tell
    which is stopped, so the StallError names both, longest silent first;
    not a rank silent only since the last heartbeat."""
    beat, clock = _beat(size=4)
    fatal = None
    while fatal is None:
        clock.now += 0.25
        if clock.now % 2.0 == 0.75:
            beat.heard(1)  # it answers, if slowly: silent 1.25 s when rank 3 fails the job
        if clock.now == 101.0:
            beat.heard(2)  # rank 2 unheard from 1 s after rank 3
        _, fatal = beat.inspect()
    assert fatal == ("Stalled: 2 ranks have not answered: rank 3 for 8.0 s, rank 2 for 7.0 s "
                     "(one or more is stopped, or its coordinator thread cannot run; on a host "
                     "with fewer cores than busy processes, ranks spinning in MPI calls can keep "
                     "another off the CPU); failed after 8 s "
                     "(COORDINATOR_SILENT_RANK_SECONDS)"), fatal


def test_under_a_limit_of_few_periods_the_rank_past_it_is_still_named():
    """COORDINATOR_SILENT_RANK_SECONDS=0.1: the period is its floor (0.05 s),
    and half the limit with three periods would be past the limit itself."""
    beat, clock = _beat(silence=0.1)
    fatal = None
    while fatal is None:
        clock.now += 0.01
        beat.heard(2)
        _, fatal = beat.inspect()
    assert fatal.startswith("Stalled: rank 1 has not answered for 0.1 s"), fatal
