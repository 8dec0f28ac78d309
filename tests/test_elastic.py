"""Elastic training without MPI: discovery and blacklisting, the driver's
plans, the gRPC service's authentication and input checks (with a fuzz
test), the states and the run loop, coordrun's new flags."""

import logging
import os
import random
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from coordinator import liveness, run
from coordinator._wire import driver_pb2 as dpb
from coordinator.elastic import auth, hosts, loop, membership, service, state
from coordinator.elastic.driver import ElasticDriver, InvalidRequest, JobStopped, assign
from coordinator.errors import (DeadlockError, HorovodInternalError, InvalidOperationError,
                                RankFailedError, StallError, TensorMismatchError)

SECRET = "0123456789abcdef" * 4
METHODS = {
    "Register": dpb.RegisterRequest, "Heartbeat": dpb.HeartbeatRequest,
    "WatchHosts": dpb.WatchRequest, "Reform": dpb.ReformRequest,
    "Finish": dpb.FinishRequest, "GetTask": dpb.TaskRequest,
}


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def manager(slots, cooldown=None, clock=None):
    m = hosts.HostManager(hosts.FixedHosts(slots), cooldown, clock=clock or Clock(),
                          rng=random.Random(0))
    m.update(m.find())
    return m


def driver_for(slots, min_np=1, max_np=None, **kwargs):
    d = ElasticDriver(manager(slots), min_np=min_np, max_np=max_np, **kwargs)
    d.start_world()
    return d


# ------------------------------------------------------------ discovery

def test_discovery_output_takes_host_and_host_colon_slots():
    assert hosts.parse_discovery_output("a:2\n\nb\n c:0 \n", 4) == {"a": 2, "b": 4, "c": 0}


@pytest.mark.parametrize("text,message", [
    ("a:x\n", "slots must be"), ("b\n", "gives no slots"), ("a b:1\n", "is not host")])
def test_discovery_output_names_the_bad_line(text, message):
    with pytest.raises(ValueError, match=message):
        hosts.parse_discovery_output(text, None)


def test_failing_discovery_script_says_so(tmp_path):
    script = tmp_path / "d.sh"
    script.write_text("#!/bin/sh\necho oops >&2\nexit 3\n")
    script.chmod(0o755)
    with pytest.raises(RuntimeError, match="exited with status 3: oops"):
        hosts.DiscoveryScript(str(script)).find()


def test_hosts_keep_their_order_and_new_ones_come_last():
    fixed = hosts.FixedHosts({"b": 1, "a": 1})
    m = hosts.HostManager(fixed)
    m.update(m.find())
    assert m.order == ["a", "b"]
    fixed.host_slots = {"c": 1, "b": 2, "a": 1}
    bits, changed = m.update(m.find())
    assert changed and bits == hosts.ADDED and m.order == ["a", "b", "c"]
    fixed.host_slots = {"c": 1, "a": 1}
    bits, _ = m.update(m.find())
    assert bits == hosts.REMOVED and m.order == ["a", "c"]


def test_a_failed_host_is_blacklisted_for_good_without_a_cooldown():
    m = manager({"a": 1, "b": 2})
    m.record_failure("b")
    assert m.is_blacklisted("b") and m.available() == [("a", 1)]
    m.update(m.find())
    assert m.is_blacklisted("b")


def test_a_host_that_keeps_failing_stays_out_longer_each_time():
    clock = Clock()
    m = manager({"a": 1, "b": 1}, cooldown=(1, 100), clock=clock)
    waits = []
    for _ in range(3):
        m.record_failure("b")
        assert m.is_blacklisted("b")
        waits.append(m.records["b"].until - clock.now)
        clock.now += waits[-1] - 0.01
        m.update(m.find())
        assert m.is_blacklisted("b")
        clock.now += 0.02
        bits, changed = m.update(m.find())
        assert changed and bits & hosts.ADDED and not m.is_blacklisted("b")
    assert waits[0] < waits[1] < waits[2] <= 100


@pytest.mark.parametrize("bad", [(0, 5), (5, 4000), (9, 3)])
def test_cooldown_range_is_checked(bad):
    with pytest.raises(ValueError, match="cooldown"):
        hosts.validate_cooldown_range(bad)


# --------------------------------------------------------------- driver

def test_assign_keeps_workers_in_place_and_fills_free_slots_up_to_max():
    stay, leave, new = assign([("a", 2), ("b", 1)], [("b", 0), ("a", 0)], max_np=None)
    assert (stay, leave, new) == ([0, 1], [], [("a", 1)])
    stay, leave, new = assign([("a", 2)], [("b", 0), ("a", 0)], max_np=None)
    assert (stay, leave, new) == ([1], [0], [("a", 1)])
    assert assign([("a", 4)], [], max_np=3)[2] == [("a", 0), ("a", 1), ("a", 2)]


def test_start_world_uses_every_slot_up_to_max_np():
    d = driver_for({"a": 2, "b": 2}, min_np=2, max_np=3)
    assert d.worlds[0] == [("a", 0), ("a", 1), ("b", 0)]


def test_start_world_waits_then_fails_clearly_with_too_few_slots():
    d = ElasticDriver(manager({"a": 1}), min_np=3, elastic_timeout=0.1)
    with pytest.raises(JobStopped, match=r"only 1 worker slots .* the 3 needed to start"):
        d.start_world()


def test_lost_worker_blacklists_its_host_and_the_job_goes_on_with_the_rest():
    d = driver_for({"a": 1, "b": 1, "c": 1}, min_np=2)
    plan = d.reform(0, [0, 2], failure=True)
    assert plan.action == "continue" and plan.spawn == [] and plan.leave == []
    assert d.hosts.is_blacklisted("b") and d.worlds[plan.generation] == [("a", 0), ("c", 0)]


def test_after_a_loss_free_slots_are_offered_as_a_change_of_hosts():
    d = driver_for({"a": 1, "b": 1}, min_np=1, max_np=2)
    d.hosts.discovery.host_slots = {"a": 1, "b": 1, "c": 1}
    d.discover()
    assert not d.notices  # already at --max-np
    plan = d.reform(0, [0], failure=True)
    assert plan.spawn == []  # goes on at once with the survivor
    assert d.notices and d.notices[-1][1] & hosts.ADDED
    grown = d.reform(plan.generation, [0], failure=False)
    assert grown.spawn == [("c", 0)]


def test_below_min_np_a_lost_worker_is_replaced_at_once():
    d = driver_for({"a": 1, "b": 1}, min_np=2)
    d.hosts.discovery.host_slots = {"a": 1, "b": 1, "c": 1}
    d.discover()
    plan = d.reform(0, [0], failure=True)
    assert plan.spawn == [("c", 0)]


def test_reset_limit_stops_the_job_and_says_why():
    d = driver_for({"a": 1, "b": 1, "c": 1}, min_np=1, reset_limit=1)
    first = d.reform(0, [0, 1], failure=True)
    assert first.action == "continue"
    second = d.reform(first.generation, [0], failure=True)
    assert second.action == "stop" and "--reset-limit" in second.reason
    assert d.stop_reason == second.reason


def test_too_few_workers_after_the_elastic_timeout_stops_the_job():
    d = driver_for({"a": 1, "b": 1}, min_np=2, elastic_timeout=0.2)
    started = time.monotonic()
    plan = d.reform(0, [0], failure=True)
    assert plan.action == "stop" and time.monotonic() - started >= 0.2
    assert "fewer than the 2 needed to go on (--min-np)" in plan.reason
    assert "--elastic-timeout" in plan.reason and "blacklisted: ['b']" in plan.reason


def test_a_host_appearing_while_waiting_lets_the_job_go_on():
    d = driver_for({"a": 1, "b": 1}, min_np=2, elastic_timeout=10)

    def add_host():
        time.sleep(0.3)
        d.hosts.discovery.host_slots = {"a": 1, "b": 1, "c": 1}
        d.discover()

    threading.Thread(target=add_host).start()
    plan = d.reform(0, [0], failure=True)
    assert plan.action == "continue" and plan.spawn == [("c", 0)]


def test_removed_host_makes_its_workers_leave():
    d = driver_for({"a": 1, "b": 1, "c": 1}, min_np=1)
    d.hosts.discovery.host_slots = {"a": 1, "c": 1}
    d.discover()
    assert d.notices[-1][1] == hosts.REMOVED
    plan = d.reform(0, [0, 1, 2], failure=False)
    assert plan.leave == [1] and d.worlds[plan.generation] == [("a", 0), ("c", 0)]


def test_watch_streams_changes_after_the_membership_formed():
    d = driver_for({"a": 1}, min_np=1)
    got = []
    stream = d.watch(0, 0)
    t = threading.Thread(target=lambda: got.append(next(stream)))
    t.start()
    d.hosts.discovery.host_slots = {"a": 1, "b": 1}
    d.discover()
    t.join(5)
    assert got == [(1, hosts.ADDED)]


# -------------------------------------------- silent (stopped) workers

@pytest.fixture
def sleeper():
    """A process to stand for a stopped worker: (pid, start time)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc, liveness.process_start(proc.pid)
    proc.kill()
    proc.wait()


def _silent_driver(clock, identity, pid, start, limit=30.0):
    d = ElasticDriver(manager({"a": 1, "b": 1, "c": 1}), min_np=1, clock=clock)
    d.start_world()
    d.silence_limit = limit
    for rank in range(3):
        d.register(0, rank, 3, 100 + rank, "other-machine", 5)
    d.register(0, 2, 3, pid, identity, start)
    return d


def test_a_silent_worker_on_the_drivers_machine_is_ended_by_the_driver(sleeper):
    """Rank 2 stops sending heartbeats: after silence_limit (ULFM's detector
    timeout under coordrun) the driver ends it, since it runs on its own
    machine, and names it to the others too."""
    proc, start = sleeper
    clock = Clock()
    d = _silent_driver(clock, None, proc.pid, start)
    d.registered[(0, 2)] = (liveness.host_identity(), proc.pid, start)
    clock.now += 20
    for rank in (0, 1):
        d.heartbeat(0, rank)
    d._check_heartbeats()
    assert proc.poll() is None and d.to_end() == []  # 20 s: not yet
    clock.now += 11
    d._check_heartbeats()
    assert proc.wait(10) == -9
    assert d.to_end() == [(0, 2, liveness.host_identity(), proc.pid, start)]
    assert d.stop_reason is None
    # The others re-form without it: it is neither waited for nor named.
    plan = d.reform(0, [0, 1], failure=True)
    clock.now += 60
    for rank in (0, 1):
        d.heartbeat(plan.generation, rank)
    d._check_heartbeats()
    assert d.to_end() == [] and d.stop_reason is None


def test_a_silent_worker_nobody_can_end_stops_the_job_saying_so(sleeper):
    """On another machine, where no worker ends it (none shares it), the
    driver stops the job END_WAIT s after asking, instead of leaving the
    others waiting for it for ever. A process with the same pid that started
    at another time is never ended."""
    from coordinator.elastic import driver as drivermod

    proc, start = sleeper
    clock = Clock()
    d = _silent_driver(clock, "other-machine", proc.pid, start)
    d.registered[(0, 0)] = (liveness.host_identity(), proc.pid, start + 1)  # not that process
    clock.now += 31
    d._check_heartbeats()
    assert sorted(k[:2] for k in d.to_end()) == [(0, 0), (0, 1), (0, 2)]
    clock.now += drivermod.END_WAIT - 1
    for rank in (0, 1):
        d.heartbeat(0, rank)
    d._check_heartbeats()
    assert proc.poll() is None and d.stop_reason is None
    assert [k[:2] for k in d.to_end()] == [(0, 2)]  # the others spoke up
    clock.now += 2
    d._check_heartbeats()
    assert proc.poll() is None
    assert d.stop_reason == ("rank 2 (c[0]) of membership 0 has sent no heartbeat for 47 s "
                             "(stopped, or hung) and no process on its machine ended it, so "
                             "the other workers cannot re-form without it")


def test_without_a_silence_limit_silence_is_only_reported(sleeper, caplog):
    proc, start = sleeper
    clock = Clock()
    d = _silent_driver(clock, None, proc.pid, start, limit=None)
    d.registered[(0, 2)] = (liveness.host_identity(), proc.pid, start)
    clock.now += 100
    with caplog.at_level(logging.WARNING, logger="coordinator.elastic"):
        d._check_heartbeats()
        d._check_heartbeats()  # once per HEARTBEAT_LOST
    assert proc.poll() is None and d.to_end() == [] and d.stop_reason is None
    assert [r.getMessage() for r in caplog.records].count(
        "driver: no heartbeat from rank 2 (c[0]) for 100 s") == 1


def test_a_worker_ends_the_silent_workers_on_its_machine_only(sleeper, monkeypatch):
    """The heartbeat's reply names the workers the driver wants ended; an
    agent ends those that share its machine and PID namespace (once), and
    leaves the others."""
    from coordinator.elastic import worker

    proc, start = sleeper
    monkeypatch.setattr(worker, "HEARTBEAT_PERIOD", 0.05)  # many heartbeats, soon

    class Client:
        def __init__(self):
            self.end = []
            self.beats = 0
            self.cond = threading.Condition()

        def register(self, *args):
            return ("a", 0)

        def heartbeat(self, generation, rank, timeout=None):
            with self.cond:
                self.beats += 1
                self.cond.notify_all()
            return dpb.HeartbeatReply(hosts_version=0, end=list(self.end))

        def two_more_beats(self):
            """Returns once the agent has acted on the reply to a heartbeat
            sent after this call (it sends the next one only then)."""
            with self.cond:
                until = self.beats + 2
                assert self.cond.wait_for(lambda: self.beats >= until, 60), self.beats

    client = Client()
    agent = worker.Agent(client)
    try:
        agent.follow(0, 1, 3)
        assert agent.wait_slot(0, 10) == ("a", 0)
        client.end = [
            dpb.Process(generation=0, rank=2, host_identity="elsewhere", pid=proc.pid,
                        start_time=start),
            dpb.Process(generation=0, rank=2, host_identity=agent.identity, pid=proc.pid,
                        start_time=start + 1)]
        # Counted heartbeats, not a sleep: a loaded machine may run the
        # agent's thread late.
        client.two_more_beats()
        assert proc.poll() is None
        client.end.append(dpb.Process(generation=0, rank=2, host_identity=agent.identity,
                                      pid=proc.pid, start_time=start))
        assert proc.wait(60) == -9
    finally:
        agent.stop()


@pytest.mark.parametrize("call", [
    lambda d: d.register(7, 0, 1, 1), lambda d: d.register(0, 5, 1, 1),
    lambda d: d.register(0, 0, 9, 1), lambda d: d.reform(0, [], True),
    lambda d: d.reform(0, [0, 0], True), lambda d: d.reform(0, [3], True),
    lambda d: d.heartbeat(3, 0)])
def test_requests_that_make_no_sense_are_invalid(call):
    with pytest.raises(InvalidRequest):
        call(driver_for({"a": 1}))


# -------------------------------------------------- the service, secured

@pytest.fixture
def served():
    d = driver_for({"a": 2, "b": 1}, min_np=1)
    server, address = service.serve(d, SECRET)
    yield d, server, address
    server.stop(0)


def test_driver_listens_on_loopback_for_a_job_on_this_machine(served):
    assert served[2].startswith("127.0.0.1:")
    assert service.address_for(["localhost", "127.0.0.1"]) == "127.0.0.1"


def test_an_authenticated_worker_registers(served):
    d, _, address = served
    client = service.DriverClient(address, SECRET)
    assert client.register(0, 2, 3, 99) == ("b", 0)
    assert d.registered[(0, 2)][1] == 99  # (host identity, pid, start time)


def test_an_unauthenticated_client_is_refused_and_logged(served, caplog):
    _, _, address = served
    plain = service.dgrpc.ElasticDriverStub(grpc.insecure_channel(address))
    wrong = service.DriverClient(address, "not the job's secret")
    with caplog.at_level(logging.WARNING, logger="coordinator.elastic"):
        for call in (lambda: plain.Register(dpb.RegisterRequest(size=3), timeout=5),
                     lambda: wrong.register(0, 0, 3, 1)):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    text = caplog.text
    assert "refused a call to /coordinator.driver.ElasticDriver/Register" in text
    assert "no proof of the job's secret" in text and "wrong HMAC" in text


def _raw(address):
    channel = grpc.insecure_channel(address)
    return {name: channel.unary_unary(f"/coordinator.driver.ElasticDriver/{name}")
            for name in METHODS if name != "WatchHosts"}, channel.unary_stream(
        "/coordinator.driver.ElasticDriver/WatchHosts")


def test_a_replayed_or_stale_call_is_refused(served):
    _, _, address = served
    unary, _ = _raw(address)
    method = "/coordinator.driver.ElasticDriver/Heartbeat"
    body = dpb.HeartbeatRequest(generation=0, rank=0).SerializeToString()
    metadata = auth.signed_metadata(SECRET, method, body)
    unary["Heartbeat"](body, metadata=metadata, timeout=5)
    stale = auth.signed_metadata(SECRET, method, body, now=time.time() - 3600)
    for md in (metadata, stale):
        with pytest.raises(grpc.RpcError) as info:
            unary["Heartbeat"](body, metadata=md, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _mutations(rng, n):
    """Random bytes and mutated valid requests, each for a random method."""
    seeds = {
        "Register": dpb.RegisterRequest(generation=0, rank=1, size=3, pid=5),
        "Heartbeat": dpb.HeartbeatRequest(generation=0, rank=0),
        "WatchHosts": dpb.WatchRequest(generation=0, rank=0),
        "Reform": dpb.ReformRequest(generation=0, survivors=[0, 1], failure=True),
        "Finish": dpb.FinishRequest(generation=0, rank=0, exit_code=0, result=b"x"),
        "GetTask": dpb.TaskRequest(),
    }
    names = sorted(METHODS)
    for i in range(n):
        name = names[rng.randrange(len(names))]
        body = bytearray(seeds[name].SerializeToString())
        kind = i % 4
        if kind == 0:
            body = bytearray(rng.randbytes(rng.randrange(0, 64)))
        elif kind == 1 and body:
            for _ in range(rng.randrange(1, 4)):
                body[rng.randrange(len(body))] = rng.randrange(256)
        elif kind == 2:
            cut = rng.randrange(len(body) + 1)
            body = body[:cut] + bytearray(rng.randbytes(rng.randrange(0, 8))) + body[cut:]
        else:
            field = rng.randrange(1, 20)
            wire = rng.choice([0, 1, 2, 5])
            body += bytearray([(field << 3) | wire]) + bytearray(rng.randbytes(9))
        yield name, bytes(body)


def test_fuzz_ten_thousand_malformed_requests_then_a_valid_one(served):
    """>= 10,000 random or mutated requests (most signed, so they reach the
    parser and the checks; some not): every answer is OK, INVALID_ARGUMENT,
    UNAUTHENTICATED or, for a stream that stayed open, DEADLINE_EXCEEDED;
    never INTERNAL or UNKNOWN. Then the driver still serves a valid call."""
    d, server, address = served
    d.task = b"task"
    unary, stream = _raw(address)
    rng = random.Random(14)
    allowed = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
               grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.DEADLINE_EXCEEDED}
    seen, bad = {}, []
    futures = []

    def record(code, name, body):
        seen[code] = seen.get(code, 0) + 1
        if code not in allowed:
            bad.append((name, body, code))

    for i, (name, body) in enumerate(_mutations(rng, 10_000)):
        method = f"/coordinator.driver.ElasticDriver/{name}"
        metadata = auth.signed_metadata(SECRET, method, body) if i % 10 else [("x", "y")]
        if name == "WatchHosts":
            try:
                for _ in stream(body, metadata=metadata, timeout=0.05):
                    break
                record(grpc.StatusCode.OK, name, body)
            except grpc.RpcError as exc:
                record(exc.code(), name, body)
            continue
        futures.append((name, body, unary[name].future(body, metadata=metadata, timeout=30)))
        if len(futures) >= 64:
            for n, b, f in futures:
                try:
                    f.result()
                    record(grpc.StatusCode.OK, n, b)
                except grpc.RpcError as exc:
                    record(exc.code(), n, b)
            futures = []
    for n, b, f in futures:
        try:
            f.result()
            record(grpc.StatusCode.OK, n, b)
        except grpc.RpcError as exc:
            record(exc.code(), n, b)
    assert sum(seen.values()) == 10_000
    assert not bad, bad[:5]
    assert seen[grpc.StatusCode.INVALID_ARGUMENT] > 1000
    assert seen[grpc.StatusCode.UNAUTHENTICATED] >= 900  # the unsigned tenth
    client = service.DriverClient(address, SECRET)
    assert client.register(0, 0, 3, 1234) == ("a", 0)
    assert client.heartbeat(0, 0).hosts_version >= 0


# ------------------------------------------------------ states and the loop

def identity(obj):
    return obj


def test_object_state_commit_restore_and_sync():
    s = state.ObjectState(bcast_object=identity, get_rank=lambda: 0, epoch=0, seen=[1])
    s.epoch = 3
    s.seen.append(2)
    s.commit()
    s.epoch = 9
    s.seen.append(3)
    s.restore()
    assert (s.epoch, s.seen) == (3, [1, 2])
    s.sync()
    assert (s.epoch, s.seen) == (3, [1, 2])


def test_host_updates_raise_on_the_next_commit_and_removals_skip_the_sync():
    s = state.ObjectState(bcast_object=identity, get_rank=lambda: 0, epoch=0)
    s.commit()
    s.on_hosts_updated(1, hosts.REMOVED)
    with pytest.raises(state.HostsUpdatedInterrupt) as info:
        s.commit()
    assert info.value.skip_sync
    s.commit()  # seen: no second interrupt
    s.on_hosts_updated(2, hosts.ADDED)
    s.on_hosts_updated(3, hosts.REMOVED)
    with pytest.raises(state.HostsUpdatedInterrupt) as info:
        s.check_host_updates()
    assert not info.value.skip_sync


class FakeMembership:
    hosts_version = 0
    added_last = 0

    def communicator(self):
        return None


def test_run_restores_after_a_lost_worker_and_keeps_state_after_a_host_change(monkeypatch):
    monkeypatch.setattr(membership, "current", lambda: FakeMembership())
    s = state.ObjectState(bcast_object=identity, get_rank=lambda: 0, step=0)
    events, calls = [], []
    s.register_reset_callbacks([lambda: events.append(("reset", s.step))])

    def train(s):
        calls.append(1)
        events.append(("start", s.step))
        s.step += 1
        s.commit()
        s.step += 1
        if len(calls) == 1:
            raise HorovodInternalError("a worker was lost")  # back to the commit: 1
        if len(calls) == 2:
            raise state.HostsUpdatedInterrupt(skip_sync=True)  # keeps 3
        return s.step

    resets = []
    assert loop.run_fn(train, lambda: resets.append(1))(s) == 5
    assert events == [("start", 0), ("reset", 1), ("start", 1), ("reset", 3), ("start", 3)]
    assert len(resets) == 2


@pytest.mark.parametrize("added, synced", [(0, False), (2, True)])
def test_after_hosts_were_removed_the_state_is_synced_only_if_workers_joined(
        monkeypatch, added, synced):
    """The interrupt said "removed only", but hosts came back before the
    driver planned and the re-forming started new workers, which sync from
    rank 0: the old ranks must sync too (they skipped it: the job hung)."""
    current = FakeMembership()
    monkeypatch.setattr(membership, "current", lambda: current)
    syncs = []
    s = state.ObjectState(bcast_object=lambda obj: syncs.append(obj) or obj,
                          get_rank=lambda: 0, step=0)
    calls = []

    def train(s):
        calls.append(1)
        if len(calls) == 1:
            raise state.HostsUpdatedInterrupt(skip_sync=True)
        return "done"

    def reset():
        current.added_last = added

    assert loop.run_fn(train, reset)(s) == "done"
    assert len(syncs) == (2 if synced else 1), syncs  # the first call syncs too


def test_outside_an_elastic_job_a_failure_propagates(monkeypatch):
    monkeypatch.setattr(membership, "current", lambda: None)
    s = state.ObjectState(bcast_object=identity, get_rank=lambda: 0, step=0)

    def train(s):
        raise HorovodInternalError("lost")

    with pytest.raises(HorovodInternalError):
        loop.run_fn(train, lambda: None)(s)


@pytest.mark.parametrize("error", [
    TensorMismatchError("Mismatched shape for allreduce of tensor 'w': rank 1 sent (4,)"),
    InvalidOperationError("rank 1 rejected allreduce of tensor 'w': TypeError: strings"),
    DeadlockError("Deadlocked allreduce of tensor 'acc0': rank 1 did not submit it"),
], ids=type)
def test_the_programs_own_mistakes_stop_an_elastic_job_instead_of_resetting_it(
        monkeypatch, error):
    """A reset replays the program from its last commit, which makes the same
    calls again: Horovod reset on a mismatch about 70 times a second, for
    ever. The error leaves run() as it came, saying why it was not retried."""
    monkeypatch.setattr(membership, "current", lambda: FakeMembership())
    s = state.ObjectState(bcast_object=identity, get_rank=lambda: 0, step=0)
    calls, resets = [], []

    def train(s):
        calls.append(1)
        if len(calls) > 1:
            return "replayed"
        raise error

    with pytest.raises(type(error)) as raised:
        loop.run_fn(train, lambda: resets.append(1))(s)
    assert raised.value is error and (calls, resets) == ([1], [])
    assert any("did not reset the job" in note for note in raised.value.__notes__)


@pytest.mark.parametrize("error", [StallError("Stalled allreduce of tensor 'w'"),
                                   RankFailedError("rank 2 died"),
                                   HorovodInternalError("operation failed on rank 1")],
                         ids=type)
def test_failures_a_reset_can_repair_still_reset_an_elastic_job(monkeypatch, error):
    monkeypatch.setattr(membership, "current", lambda: FakeMembership())
    s = state.ObjectState(bcast_object=identity, get_rank=lambda: 0, step=0)
    calls, resets = [], []

    def train(s):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return "done"

    assert loop.run_fn(train, lambda: resets.append(1))(s) == "done"
    assert resets == [1]


def test_the_same_failure_at_the_same_commit_three_times_stops_an_elastic_job(monkeypatch):
    """Resets that do not repair a failure (a rank's backend fails the same
    operation in every membership) stop on the third attempt; a commit
    between two failures, or a lost rank, starts the count again."""
    monkeypatch.setattr(membership, "current", lambda: FakeMembership())
    s = state.ObjectState(bcast_object=identity, get_rank=lambda: 0, step=0)
    script = iter([("fail", "rank 1: allreduce of tensor 'g' failed after 1.5 s"),
                   ("commit", None),
                   ("fail", "rank 2: allreduce of tensor 'g' failed after 0.7 s"),
                   ("lost", None),
                   ("fail", "rank 2: allreduce of tensor 'g' failed after 0.2 s"),
                   ("fail", "rank 1: allreduce of tensor 'g' failed after 3.1 s"),
                   ("fail", "rank 1: allreduce of tensor 'g' failed after 1.0 s")])
    resets = []

    def train(s):
        for what, text in script:
            if what == "commit":
                s.commit()
            elif what == "lost":
                raise RankFailedError("rank 2 (pid 77 on a) died")
            else:
                raise HorovodInternalError(text)
        return "done"

    with pytest.raises(HorovodInternalError, match="after 1.0 s") as raised:
        loop.run_fn(train, lambda: resets.append(1))(s)
    assert len(resets) == 5
    assert any("came back on 3 attempts in a row" in note for note in raised.value.__notes__)


class EndedDriver:
    """What launch._status reads of a driver after the job ended."""

    stop_reason = None
    generation = 1
    worlds = {1: [("a", 0), ("b", 0)]}
    registered = {(1, 0): ("a", 11, 0.0), (1, 1): ("b", 12, 0.0)}

    def __init__(self, outcomes):
        self.outcomes = outcomes

    def final_outcomes(self):
        return self.outcomes


def test_the_end_of_a_job_names_the_workers_that_ended_without_reporting(monkeypatch):
    from coordinator.elastic import launch
    from coordinator.elastic.driver import Outcome

    monkeypatch.setattr(run, "_forwarded", [])
    assert launch._status(EndedDriver({0: Outcome(0), 1: Outcome(0)}), 0, None) == (0, None)
    status, text = launch._status(EndedDriver({0: Outcome(0)}), 0, None)
    assert status == 1 and "rank 1 (b[0]) ended without reporting" in text, text
    assert "rank 0" not in text and "could not re-form" not in text, text
    status, text = launch._status(EndedDriver({}), 137, None)
    assert status == 137 and "rank 0 (a[0]), rank 1 (b[0]) ended" in text, text
    assert "no worker of it was left to carry the job's state on" in text, text
    # A rank that raised says so itself; the job's status is its.
    assert launch._status(EndedDriver({0: Outcome(0), 1: Outcome(2)}), 2, None) == (2, None)
    # No worker ever joined (the program never called init), every process
    # exited 0: a success, as for Horovod; exited otherwise, the job failed.
    never = EndedDriver({})
    never.registered = {}
    assert launch._status(never, 0, None) == (0, None)
    assert launch._status(never, 3, None)[0] == 3
    # Stopped from outside: not what happened in the job.
    monkeypatch.setattr(run, "_forwarded", [15, 15])
    assert launch._status(EndedDriver({}), 143, None) == (
        143, "the job was stopped: coordrun got SIGTERM")


# ------------------------------------------------------------ coordrun

LAUNCHER = run.Launcher("/opt/ompi/bin/mpirun", run.OPEN_MPI)
ENV = {"PATH": "/usr/bin"}


def test_elastic_flags_make_an_elastic_job():
    args = run.parse_args(["-np", "2", "--max-np", "4", "--host-discovery-script", "d.sh",
                           "--slots-per-host", "2", "--elastic-timeout", "5",
                           "--reset-limit", "3", "--blacklist-cooldown-range", "2", "9",
                           "python", "t.py"])
    assert run.is_elastic(args) and args.min_np == 2 and args.slots == 2
    assert args.cooldown_range == [2, 9] and args.reset_limit == 3
    job = run.DriverJob(hosts=[("a", 2), ("b", 1)], exports={"K": "v"},
                        command=["python", "t.py"])
    argv, env = run.build_command(args, LAUNCHER, ENV, euid=1, job=job)
    assert argv[:8] == ["/opt/ompi/bin/mpirun", "--with-ft", "ulfm", "-np", "3", "--bind-to",
                        "none", "--map-by"]
    assert "--host" in argv and argv[argv.index("--host") + 1] == "a:2,b:1"
    assert env["OMPI_MCA_btl_tcp_if_include"] == "lo" and "OMPI_MCA_btl" not in env
    assert "-x" in argv and "K" in argv and "v" not in argv  # values stay off argv
    # ULFM's heartbeat detector takes a silent rank for dead after 30 s,
    # without its own thread (MPI_Finalize hangs with it); the user's choice wins
    assert (env["OMPI_MCA_mpi_ft_detector"], env["OMPI_MCA_mpi_ft_detector_thread"],
            env["OMPI_MCA_mpi_ft_detector_timeout"]) == ("true", "false", "30")
    assert argv[argv.index("OMPI_MCA_mpi_ft_detector") - 1] == "-x"
    _, env = run.build_command(args, LAUNCHER, dict(ENV, OMPI_MCA_mpi_ft_detector_timeout="12"),
                               euid=1, job=job)
    assert env["OMPI_MCA_mpi_ft_detector_timeout"] == "12"
    static = run.build_command(run.parse_args(["-np", "2", "python", "t.py"]), LAUNCHER, ENV,
                               euid=1)[1]
    assert "OMPI_MCA_mpi_ft_detector" not in static


@pytest.mark.parametrize("argv,message", [
    (["-np", "2", "--gloo", "python"], "runs over MPI"),
    (["--min-np", "2", "python"], "needs --host-discovery-script or -H"),
    (["-np", "1", "--min-np", "2", "-H", "a:2", "python"], "below --min-np"),
    (["-np", "2", "--max-np", "1", "--host-discovery-script", "d", "python"], "below -np"),
    (["-np", "2", "--blacklist-cooldown-range", "0", "5", "--host-discovery-script", "d",
      "python"], "lower limit"),
])
def test_bad_elastic_flags_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit):
        run.parse_args(argv)
    assert message in capsys.readouterr().err


def test_remaining_horovodrun_flags_reach_mpirun_and_the_ranks():
    args = run.parse_args([
        "-np", "2", "-H", "h1:1,h2:1", "--start-timeout", "40", "--output-filename", "/tmp/o",
        "--prefix-output-with-timestamp", "--network-interface", "eth0,eth1", "-p", "2222",
        "-i", "/k/id", "--tcp", "--binding-args=--bind-to core", "--num-nccl-streams", "2",
        "--mpi", "python", "t.py"])
    argv, env = run.build_command(args, LAUNCHER, ENV, euid=1)
    line = " ".join(argv)
    assert "--bind-to core" in line and "--bind-to none" not in line
    assert "--output dir=/tmp/o,timestamp" in line
    assert "--prtemca plm_ssh_args -p 2222 -i /k/id" in line
    assert "--prtemca oob_tcp_if_include eth0,eth1" in line
    assert env["OMPI_MCA_btl"] == "self,tcp" and env["OMPI_MCA_btl_tcp_if_include"] == "eth0,eth1"
    assert env["HOROVOD_NUM_NCCL_STREAMS"] == "2" and env["HOROVOD_START_TIMEOUT"] == "40"
    assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_SOCKET_IFNAME"] == "eth0,eth1"


def test_config_file_sets_what_the_command_line_does_not(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("params:\n  fusion_threshold_mb: 32\n  cycle_time_ms: 2  # ms\n"
                    "timeline:\n  filename: /tmp/t.json\n  mark_cycles: true\n"
                    "stall_check:\n  enabled: false\n  warning_time_seconds: 9\n"
                    "logging:\n  level: DEBUG\n  with_timestamp: false\n"
                    "autotune:\n  warmup_samples: 2\n  steps_per_sample: 7\n"
                    "  bayes_opt_max_samples: 20\ncontroller: mpi\n")
    args = run.parse_args(["-np", "2", "--cycle-time-ms", "5", "--config-file", str(path),
                           "python", "t.py"])
    env = run.horovod_env(args)
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
    assert env["HOROVOD_CYCLE_TIME"] == "5"  # the command line wins
    assert env["HOROVOD_TIMELINE"] == "/tmp/t.json" and env["HOROVOD_TIMELINE_MARK_CYCLES"] == "1"
    assert env["HOROVOD_STALL_CHECK_DISABLE"] == "1"
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "9" and env["HOROVOD_LOG_LEVEL"] == "DEBUG"
    assert env["HOROVOD_LOG_HIDE_TIME"] == "1"
    assert env["HOROVOD_AUTOTUNE_WARMUP_SAMPLES"] == "2"
    assert env["HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"] == "7"


def test_config_file_keys_without_meaning_here_are_named_like_their_flags(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("params:\n  hierarchical_allgather: true\n"
                    "library_options:\n  mpi_threads_disable: false\n"
                    "  gloo_timeout_seconds: 60\n  ccl_bgt_affinity: 1\n")
    env = run.horovod_env(run.parse_args(["-np", "2", "--config-file", str(path), "python"]))
    assert not [name for name in env if name.startswith("HOROVOD_")]
    err = capsys.readouterr().err
    assert "--hierarchical-allgather (or its --config-file key) has no effect here" in err
    assert "--gloo-timeout-seconds (or its --config-file key) has no effect here" in err
    assert "mpi-threads-disable" not in err and "ccl" not in err  # off, or silent


def test_config_files_horovodrun_reads_are_read_the_same(tmp_path, capsys):
    """A leading ---, flow mappings, 1 and 0 for booleans, WARN, the 0.28.1
    keys torus_allreduce and thread_affinity; sections and keys horovodrun
    does not read are skipped, said on stderr; --mpi beats controller:
    gloo."""
    path = tmp_path / "c.yaml"
    path.write_text("---\nparams: {fusion_threshold_mb: 32, hierarchical_allreduce: 1}\n"
                    "params2:\n  x: 1\nparams_extra: 3\n"
                    "library_options:\n  thread_affinity: 1\n  mlsl_bgt_affinity: 1\n"
                    "logging:\n  level: warn\ncontroller: gloo\n")
    args = run.parse_args(["-np", "2", "--mpi", "--config-file", str(path), "python"])
    env = run.horovod_env(args)
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
    assert env["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "1"
    assert env["HOROVOD_THREAD_AFFINITY"] == "1" and env["HOROVOD_LOG_LEVEL"] == "WARNING"
    err = capsys.readouterr().err
    assert "section 'params2'" in err and "key library_options.mlsl_bgt_affinity" in err
    path.write_text("params:\n  torus_allreduce: false\n")
    env = run.horovod_env(run.parse_args(["-np", "2", "--config-file", str(path), "python"]))
    assert env["HOROVOD_TORUS_ALLREDUCE"] == "0"


@pytest.mark.parametrize("text,message", [
    ("controller: gloo\n", "not Gloo"), ("params:\n  cache_capacity: -1\n", ">= 0"),
    ("nonsense\n", "is not 'key: value'")])
def test_bad_config_file_is_a_usage_error(tmp_path, capsys, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit):
        run.parse_args(["-np", "2", "--config-file", str(path), "python"])
    assert message in capsys.readouterr().err


def test_coordinator_run_is_callable_and_stays_the_coordrun_module():
    import coordinator

    assert callable(coordinator.run) and coordinator.run.main is run.main
    out = subprocess.run([sys.executable, "-m", "coordinator.run", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--host-discovery-script" in out.stdout


def test_importing_the_frontends_does_not_import_grpc():
    code = ("import sys, coordinator, coordinator.elastic; "
            "assert 'grpc' not in sys.modules, 'grpc imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, COORDINATOR_ELASTIC=""))
    assert out.returncode == 0, out.stderr


def test_chainer_state_restores_links_and_optimizer_state():
    chainer_elastic = pytest.importorskip("frontends.chainer.elastic")
    import chainer
    import chainer.links as L

    model = L.Linear(3, 2)
    opt = chainer.optimizers.MomentumSGD(0.1)
    opt.setup(model)
    s = chainer_elastic.ChainerState(model, opt, epoch=1)
    model.cleargrads()
    chainer.functions.sum(model(np.ones((1, 3), np.float32))).backward()
    opt.update()
    s.epoch = 2
    s.save()
    saved_w, saved_v, saved_t = model.W.array.copy(), opt.target.W.update_rule.state["v"].copy(), opt.t
    model.W.array[...] = 9
    opt.update()
    s.epoch = 5
    s.restore()
    np.testing.assert_array_equal(model.W.array, saved_w)
    np.testing.assert_array_equal(opt.target.W.update_rule.state["v"], saved_v)
    assert (opt.t, s.epoch) == (saved_t, 2)


def test_after_a_loss_hosts_without_an_mpi_daemon_get_no_workers():
    d = driver_for({"a": 1, "b": 1}, min_np=1, max_np=3)
    d.daemon_hosts = {"a", "b"}
    d.hosts.discovery.host_slots = {"a": 1, "b": 1, "c": 1}
    d.discover()
    assert d.notices[-1][1] & hosts.ADDED  # before any loss c is fine
    plan = d.reform(0, [0], failure=True)
    assert plan.action == "continue" and plan.spawn == []
    assert d.reform(plan.generation, [0], failure=False).spawn == []
