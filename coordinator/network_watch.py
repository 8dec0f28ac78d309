"""Watching ranks on other machines over the network (liveness.py watches
the ones on this machine through pidfds).

Each rank keeps one idle TCP connection to a rank of every other host (the
one with the same local rank, see watch_pairs), made at `init`:

- a peer that dies closes it at once: its kernel sends FIN or RST;
- a host that loses power, or its network, stops answering the keepalive
  probes the kernel sends on an idle connection, and the connection fails
  after SILENT_HOST_SECONDS;
- a rank that shuts down says BYE first, so its going is no death.

So every rank of every other host hears of a lost host through its own
connection, and the error names the host. Nothing flows once connected but
the kernel's probes; a thread waits in poll(); listening sockets are bound to
this machine's link addresses (never the wildcard) and closed once every peer
has connected. Measured on two network-namespace hosts
(tests/test_multihost.py): a silent host is named by every survivor 3-4 s
after it goes; a host whose processes are killed is noticed within about
10 ms, as fast as mpirun notices it (and mpirun then ends the job).
"""

import errno
import fcntl
import ipaddress
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time

from coordinator.liveness import Dead

log = logging.getLogger("coordinator")

# A silent peer is declared lost after IDLE + PROBES * INTERVAL seconds:
# keepalive probes start after IDLE seconds without traffic and go every
# INTERVAL seconds; PROBES unanswered ones fail the connection (ETIMEDOUT).
KEEPALIVE_IDLE = 1
KEEPALIVE_INTERVAL = 1
KEEPALIVE_PROBES = 3
SILENT_HOST_SECONDS = KEEPALIVE_IDLE + KEEPALIVE_PROBES * KEEPALIVE_INTERVAL
# How long the watch waits for its peers to connect before it closes its
# listening sockets, and for each of its own connection attempts.
SETUP_SECONDS = 60.0
CONNECT_SECONDS = 10.0
BYE = b"B"  # sent by a rank that shuts down: its connection closing is no death
_HELLO = struct.Struct("!16si")  # job token, the connecting rank


def watch_pairs(hosts):
    """Which ranks watch each other across hosts: `hosts` lists each host's
    ranks; returns a set of (lower rank, higher rank).

    Local rank l of one host pairs with local rank l (modulo the other
    host's size) of every other host, and the other way round, so every rank
    watches at least one rank of every other host (and hears of that host's
    loss itself) and every rank is watched from every other host. A rank
    holds about one connection per other host."""
    pairs = set()
    for i, mine in enumerate(hosts):
        for theirs in hosts[i + 1:]:
            for k in range(max(len(mine), len(theirs))):
                a, b = mine[k % len(mine)], theirs[k % len(theirs)]
                pairs.add((min(a, b), max(a, b)))
    return pairs


def link_addresses(environ=None):
    """(address, network) of this machine's IPv4 interfaces that are up,
    loopback excluded; Open MPI's btl_tcp_if_include / _exclude (names or
    CIDR networks), where set, choose among them as they choose MPI's links."""
    environ = os.environ if environ is None else environ
    include = _words(environ.get("OMPI_MCA_btl_tcp_if_include", ""))
    exclude = _words(environ.get("OMPI_MCA_btl_tcp_if_exclude", ""))
    found = []
    for _, name in socket.if_nameindex():
        try:
            flags, address, netmask = _interface(name)
        except OSError:
            continue
        if not flags & 0x1 or flags & 0x8:  # IFF_UP, IFF_LOOPBACK
            continue
        network = ipaddress.ip_interface(f"{address}/{netmask}").network
        if include and not _matches(include, name, address):
            continue
        if exclude and _matches(exclude, name, address):
            continue
        found.append((address, str(network)))
    return found


def _words(text):
    return [w.strip() for w in text.split(",") if w.strip()]


def _matches(patterns, name, address):
    for pattern in patterns:
        if "/" in pattern:
            try:
                if ipaddress.ip_address(address) in ipaddress.ip_network(pattern, strict=False):
                    return True
            except ValueError:
                continue
        elif pattern == name:
            return True
    return False


_SIOCGIFFLAGS, _SIOCGIFADDR, _SIOCGIFNETMASK = 0x8913, 0x8915, 0x891B


def _interface(name):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("256s", name.encode()[:15])
        flags = struct.unpack_from("H", fcntl.ioctl(s, _SIOCGIFFLAGS, request), 16)[0]
        address = socket.inet_ntoa(fcntl.ioctl(s, _SIOCGIFADDR, request)[20:24])
        netmask = socket.inet_ntoa(fcntl.ioctl(s, _SIOCGIFNETMASK, request)[20:24])
    return flags, address, netmask


def _candidates(theirs, mine):
    """Their listening (address, port)s, those on a network of ours first."""
    networks = {ipaddress.ip_network(net) for _, net in mine}
    near = [(a, p) for a, p, net in theirs if ipaddress.ip_network(net) in networks]
    return near + [(a, p) for a, p, net in theirs if (a, p) not in near]


class _Peer:
    """One watched rank and our connection to it."""

    def __init__(self, rank, pid, host, connects, addresses=()):
        self.rank, self.pid, self.host = rank, pid, host
        self.connects = connects  # we connect to it (else it connects to us)
        self.addresses = list(addresses)  # its listening addresses still to try
        self.sock = None
        self.state = "waiting"  # waiting, connecting, watching, gone
        self.until = 0.0  # when the connection attempt in progress gives up


class NetworkWatch:
    """A thread that holds one idle TCP connection per watched remote rank
    and reports the ones that close or stop answering."""

    @classmethod
    def start(cls, comm, my_rank, peers):
        """Collective over `comm`. None when every rank shares one machine."""
        identities = [identity for identity, _, _ in peers]
        if len(set(identities)) == 1:
            return None
        hosts = {}
        for rank, identity in enumerate(identities):
            hosts.setdefault(identity, []).append(rank)
        pairs = watch_pairs(list(hosts.values()))
        watched = sorted({b if a == my_rank else a for a, b in pairs if my_rank in (a, b)})
        listeners, mine = [], []
        try:
            addresses = link_addresses()
        except OSError:
            addresses = []
        if any(r < my_rank for r in watched):  # the lower rank of a pair connects
            for address, network in addresses:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    s.bind((address, 0))
                    s.listen(128)
                except OSError:
                    s.close()
                    continue
                s.setblocking(False)
                listeners.append(s)
                mine.append((address, s.getsockname()[1], network))
        token = secrets.token_bytes(16)
        gathered = comm.allgather((token, mine))
        token = gathered[0][0]
        watch = cls(my_rank, token, listeners)
        for rank in watched:  # the lower rank of a pair connects
            _, pid, host = peers[rank]
            connects = rank > my_rank
            theirs = _candidates(gathered[rank][1], addresses) if connects else ()
            watch._add(_Peer(rank, pid, host, connects, theirs))
        watch._thread.start()
        return watch

    def __init__(self, my_rank, token, listeners):
        self.rank = my_rank
        self.token = token
        self._listeners = listeners
        self._peers = {}  # rank -> _Peer
        self._by_fd = {}  # fd of a peer's socket -> _Peer
        self._pending = {}  # fd accepted, hello not yet read -> (socket, bytes so far)
        self._poll = select.poll()
        self._wake_r, self._wake_w = os.pipe()
        self._poll.register(self._wake_r, select.POLLIN)
        for s in listeners:
            self._poll.register(s.fileno(), select.POLLIN)
        self._lock = threading.Lock()
        self._found = []
        self._closing = False
        self._deadline = time.monotonic() + SETUP_SECONDS
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="coordinator-network-watch")

    # ------------------------------------------------------------ public
    def take(self):
        """Remote peers found dead since the last call."""
        with self._lock:
            found, self._found = self._found, []
        return found

    @property
    def listening(self):
        """Whether it still listens for peers to connect (only while setting up)."""
        return bool(self._listeners)

    @property
    def watching(self):
        """Ranks with an open connection, now."""
        return sorted(p.rank for p in self._peers.values() if p.state == "watching")

    def close(self):
        """Says goodbye on every connection (so the peers do not take this
        rank's exit for a death) and stops the thread."""
        if self._closing:
            return
        self._closing = True
        os.write(self._wake_w, b"x")
        self._thread.join(5)
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    # ------------------------------------------------------------ thread
    def _add(self, peer):
        self._peers[peer.rank] = peer
        if peer.connects:
            self._connect(peer)

    def _run(self):
        try:
            while not self._closing:
                for fd, events in self._poll.poll(self._timeout_ms()):
                    self._event(fd, events)
                self._expire(time.monotonic())
        except Exception:  # the watch must never take the rank down
            log.exception("the network watch of remote peers failed; remote ranks "
                          "are now watched only by mpirun")
        finally:
            self._shut()

    def _timeout_ms(self):
        """Until the next set-up deadline; None (forever) once set up."""
        deadlines = [p.until for p in self._peers.values() if p.state == "connecting"]
        if self._listeners or self._pending:
            deadlines.append(self._deadline)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic()) * 1000 + 1

    def _expire(self, now):
        for peer in self._peers.values():
            if peer.state == "connecting" and now >= peer.until:
                self._forget(peer)
                self._connect(peer)  # the next address, if any
        if (self._listeners or self._pending) and now >= self._deadline:
            self._give_up()

    def _event(self, fd, events):
        if fd == self._wake_r:
            os.read(self._wake_r, 64)
            return
        if any(fd == s.fileno() for s in self._listeners):
            self._accept(fd)
            return
        if fd in self._pending:
            self._hello(fd)
            return
        peer = self._by_fd.get(fd)
        if peer is None:
            return
        if peer.state == "connecting":
            self._connected(peer)
        else:
            self._readable(peer)

    def _connect(self, peer):
        while peer.addresses:
            address = peer.addresses.pop(0)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            err = s.connect_ex(address)
            if err in (0, errno.EINPROGRESS):
                peer.sock, peer.state = s, "connecting"
                peer.until = time.monotonic() + CONNECT_SECONDS
                self._by_fd[s.fileno()] = peer
                self._poll.register(s.fileno(), select.POLLOUT)
                return
            s.close()
        peer.state = "gone"
        log.warning("cannot reach rank %d on %s over the network to watch it; "
                    "only mpirun will notice if it dies", peer.rank, peer.host)

    def _connected(self, peer):
        s = peer.sock
        self._poll.unregister(s.fileno())
        del self._by_fd[s.fileno()]
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
            s.close()
            peer.sock = None
            self._connect(peer)
            return
        try:
            s.send(_HELLO.pack(self.token, self.rank))
        except OSError:
            s.close()
            peer.sock = None
            self._connect(peer)
            return
        self._watch(peer, s)

    def _accept(self, fd):
        listener = next(s for s in self._listeners if s.fileno() == fd)
        try:
            s, _ = listener.accept()
        except OSError:
            return
        s.setblocking(False)
        self._pending[s.fileno()] = (s, b"")
        self._poll.register(s.fileno(), select.POLLIN)

    def _hello(self, fd):
        s, data = self._pending[fd]
        try:
            chunk = s.recv(_HELLO.size - len(data))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        data += chunk
        if chunk and len(data) < _HELLO.size:
            self._pending[fd] = (s, data)
            return
        del self._pending[fd]
        self._poll.unregister(fd)
        token, rank = _HELLO.unpack(data) if len(data) == _HELLO.size else (b"", -1)
        peer = self._peers.get(rank)
        if token != self.token or peer is None or peer.state != "waiting":
            s.close()  # not one of ours
            return
        self._watch(peer, s)
        if all(p.state != "waiting" for p in self._peers.values()):
            self._close_listeners()

    def _watch(self, peer, s):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE),
                            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                            ("TCP_KEEPCNT", KEEPALIVE_PROBES),
                            ("TCP_USER_TIMEOUT", SILENT_HOST_SECONDS * 1000)):
            if hasattr(socket, name):
                s.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        peer.sock, peer.state = s, "watching"
        self._by_fd[s.fileno()] = peer
        self._poll.register(s.fileno(), select.POLLIN | getattr(select, "POLLRDHUP", 0))

    def _readable(self, peer):
        s = peer.sock
        try:
            data = s.recv(64)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno == errno.ETIMEDOUT:
                how = (f"host {peer.host} stopped answering for {SILENT_HOST_SECONDS} s "
                       "(down, or its network is)")
            else:
                how = f"the connection to host {peer.host} failed: {exc.strerror}"
            self._lost(peer, how)
            return
        if data.startswith(BYE):
            self._forget(peer)
        elif not data:
            self._lost(peer, f"the connection to host {peer.host} closed")

    def _lost(self, peer, how):
        self._forget(peer)
        if self._closing:
            return
        # Said at once, not at the background thread's next check: when a
        # host dies, mpirun ends the whole job within milliseconds (measured:
        # 15-20 ms), and this line is all that may get out.
        log.error("lost rank %d (pid %d on %s): %s", peer.rank, peer.pid, peer.host, how)
        with self._lock:
            self._found.append(Dead(peer.rank, peer.pid, peer.host, how))

    def _forget(self, peer):
        if peer.sock is not None:
            self._poll.unregister(peer.sock.fileno())
            self._by_fd.pop(peer.sock.fileno(), None)
            peer.sock.close()
            peer.sock = None
        peer.state = "gone"

    def _give_up(self):
        for s, _ in self._pending.values():
            self._poll.unregister(s.fileno())
            s.close()
        self._pending.clear()
        missing = [p for p in self._peers.values() if p.state == "waiting"]
        for peer in missing:
            peer.state = "gone"
        if missing:
            log.warning("ranks %s never connected to watch this rank over the network; "
                        "only mpirun will notice if they die",
                        ", ".join(str(p.rank) for p in missing))
        self._close_listeners()

    def _close_listeners(self):
        for s in self._listeners:
            self._poll.unregister(s.fileno())
            s.close()
        self._listeners = []

    def _shut(self):
        self._close_listeners()
        for s, _ in self._pending.values():
            s.close()
        self._pending.clear()
        for peer in self._peers.values():
            if peer.sock is not None:
                if peer.state == "watching":
                    try:
                        peer.sock.send(BYE)
                    except OSError:
                        pass
                peer.sock.close()
                peer.sock = None
