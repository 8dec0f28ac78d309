"""The driver behind gRPC (proto/driver.proto), and the workers' client.

`serve()` starts the ElasticDriver service on the address given (loopback
for a job on this machine only), with every call authenticated
(auth.py). Requests that parse but make no sense (an unknown membership, a
rank out of range, ...) are answered with INVALID_ARGUMENT; the service
goes on serving.
"""

import concurrent.futures
import logging
import socket

import grpc

from coordinator._wire import driver_pb2 as dpb
from coordinator._wire import driver_pb2_grpc as dgrpc
from coordinator.elastic import auth
from coordinator.elastic.driver import InvalidRequest, Outcome

log = logging.getLogger("coordinator.elastic")

# Threads serving calls: a watch stream holds one for as long as it is open
# (one per job: rank 0's), the other calls are short.
MAX_WORKERS = 16
MAX_RESULT_BYTES = 64 * 1024 * 1024


def _uint(value, what, limit=1 << 31):
    if not 0 <= value < limit:
        raise InvalidRequest(f"{what} {value} is out of range")
    return int(value)


class DriverService(dgrpc.ElasticDriverServicer):
    def __init__(self, driver):
        self.driver = driver

    def _call(self, context, fn):
        try:
            return fn()
        except InvalidRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def Register(self, request, context):
        def run():
            host, index = self.driver.register(
                _uint(request.generation, "generation", 1 << 62),
                _uint(request.rank, "rank"), _uint(request.size, "size"),
                _uint(request.pid, "pid"), request.host_identity[:256],
                int(request.start_time))
            return dpb.RegisterReply(slot=dpb.Slot(host=host, slot=index))
        return self._call(context, run)

    def Heartbeat(self, request, context):
        def run():
            version = self.driver.heartbeat(_uint(request.generation, "generation", 1 << 62),
                                            _uint(request.rank, "rank"))
            return dpb.HeartbeatReply(hosts_version=version, end=[
                dpb.Process(generation=g, rank=r, host_identity=i, pid=p, start_time=t)
                for g, r, i, p, t in self.driver.to_end()])
        return self._call(context, run)

    def WatchHosts(self, request, context):
        try:
            notices = self.driver.watch(_uint(request.generation, "generation", 1 << 62),
                                        _uint(request.rank, "rank"), context.is_active)
            for version, bits in notices:
                yield dpb.HostsUpdate(timestamp=version, result=bits)
        except InvalidRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def Reform(self, request, context):
        def run():
            plan = self.driver.reform(_uint(request.generation, "generation", 1 << 62),
                                      [_uint(r, "survivor") for r in request.survivors],
                                      bool(request.failure))
            reply = dpb.ReformReply(
                action=(dpb.ReformReply.STOP if plan.action == "stop"
                        else dpb.ReformReply.CONTINUE),
                reason=plan.reason, generation=plan.generation, leave=plan.leave,
                spawn=[dpb.Slot(host=h, slot=k) for h, k in plan.spawn],
                command=self.driver.command, workdir=self.driver.workdir,
                hosts_version=plan.hosts_version)
            return reply
        return self._call(context, run)

    def Finish(self, request, context):
        def run():
            if len(request.result) > MAX_RESULT_BYTES:
                raise InvalidRequest("result is too large")
            self.driver.finish(_uint(request.generation, "generation", 1 << 62),
                               _uint(request.rank, "rank"),
                               Outcome(int(request.exit_code), bytes(request.result),
                                       request.error[:10000]))
            return dpb.FinishReply()
        return self._call(context, run)

    def GetEnvironment(self, request, context):
        return dpb.EnvironmentReply(variables=[
            dpb.Variable(name=k, value=v) for k, v in sorted(self.driver.environment.items())])

    def GetTask(self, request, context):
        if not self.driver.task:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this job runs no function")
        return dpb.TaskReply(function=self.driver.task)


def serve(driver, secret, host="127.0.0.1", port=0):
    """Starts the service on host:port (port 0: any free one); returns
    (server, "host:port")."""
    verifier = auth.Verifier(secret)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(
        max_workers=MAX_WORKERS, thread_name_prefix="coordinator-driver"),
        interceptors=[auth.ServerAuth(verifier)],
        options=[("grpc.max_receive_message_length", MAX_RESULT_BYTES + 4096),
                 ("grpc.so_reuseport", 0)])
    dgrpc.add_ElasticDriverServicer_to_server(DriverService(driver), server)
    bound = server.add_insecure_port(_join(host, port))
    if not bound:
        raise RuntimeError(f"the driver cannot listen on {_join(host, port)}")
    server.start()
    server.verifier = verifier
    return server, _join(host, bound)


def _join(host, port):
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def address_for(hosts, interface=None):
    """Where the driver listens: loopback when every host is this machine,
    else the address of `interface`, or of the interface that routes to
    the first remote host."""
    remote = [h for h in hosts if not is_local(h)]
    if interface:
        return interface_address(interface)
    if not remote:
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((remote[0], 9))  # no packet is sent: only routing
        return probe.getsockname()[0]
    finally:
        probe.close()


def is_local(host):
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname()):
        return True
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(a.startswith("127.") or a == "::1" or a in _own_addresses()
                                   for a in addresses)


def _own_addresses():
    out = set()
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a test dependency
        return out
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                out.add(a.address.split("%")[0])
    return out


def interface_address(name):
    try:
        import psutil
    except ImportError:
        raise RuntimeError("--network-interface needs psutil to find the interface's "
                           "address") from None
    for a in psutil.net_if_addrs().get(name, ()):
        if a.family == socket.AF_INET:
            return a.address
    raise RuntimeError(f"network interface {name!r} has no IPv4 address")


class DriverClient:
    """A worker's (or a test's) authenticated connection to the driver."""

    def __init__(self, address, secret, timeout=30.0):
        self.address = address
        self.timeout = timeout
        self.channel = grpc.intercept_channel(grpc.insecure_channel(address),
                                              auth.ClientAuth(secret))
        self.stub = dgrpc.ElasticDriverStub(self.channel)

    def register(self, generation, rank, size, pid, identity="", start=0):
        reply = self.stub.Register(dpb.RegisterRequest(
            generation=generation, rank=rank, size=size, pid=pid, host_identity=identity,
            start_time=start), timeout=self.timeout)
        return reply.slot.host, reply.slot.slot

    def heartbeat(self, generation, rank, timeout=None):
        """The driver's HeartbeatReply: its hosts version, and the silent
        workers it wants ended."""
        return self.stub.Heartbeat(dpb.HeartbeatRequest(generation=generation, rank=rank),
                                   timeout=timeout or self.timeout)

    def watch(self, generation, rank):
        """The stream of host changes (an iterator of HostsUpdate; cancel()
        ends it)."""
        return self.stub.WatchHosts(dpb.WatchRequest(generation=generation, rank=rank))

    def reform(self, generation, survivors, failure, timeout=None):
        return self.stub.Reform(dpb.ReformRequest(generation=generation, survivors=survivors,
                                                  failure=failure), timeout=timeout)

    def finish(self, generation, rank, exit_code, result=b"", error=""):
        self.stub.Finish(dpb.FinishRequest(generation=generation, rank=rank,
                                           exit_code=exit_code, result=result, error=error),
                         timeout=self.timeout)

    def task(self):
        return self.stub.GetTask(dpb.TaskRequest(), timeout=self.timeout).function

    def environment(self):
        reply = self.stub.GetEnvironment(dpb.EnvironmentRequest(), timeout=self.timeout)
        return {v.name: v.value for v in reply.variables}

    def close(self):
        self.channel.close()
