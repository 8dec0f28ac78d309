"""Real hosts on one machine: Linux namespaces joined by a veth link.

    python examples/multihost/netns.py up DIR [--hosts hosta,hostb] &
    DIR/agent hosta coordrun -H hosta:2,hostb:2 python train.py
    kill %1    # takes the hosts down

Each host is a set of namespaces of its own: network (its address on the
link, its own loopback), UTS (its hostname), PID (its own pid 1 and /proc)
and mount (its /etc/hosts, /dev/shm and /sys). Its pid 1 is `hostd`, which
starts commands on request, as sshd would, and reaps orphans. A host can be
lost two ways: `kill_host` kills its pid 1, and with it the kernel kills
every process there at once (their connections close with a reset, as when
software dies); `power_off` first takes its link down, so it goes silent
(as when it loses power: the others hear nothing until their timeouts).

`DIR/agent HOST COMMAND...` is ssh's stand-in: it runs COMMAND through
/bin/sh on HOST with the agent's stdin, stdout and stderr, in the same
directory (the file system is shared, as an NFS home would be), in HOST's
login environment (PATH with this virtualenv's bin first, HOME, a private
TMPDIR), and exits with the command's status, or 255 if the host is gone.
Point mpirun's launcher at it (`--prtemca plm_ssh_agent DIR/agent`) and
PRRTE starts its daemons on the other hosts through it, over TCP on the
link.

The namespaces have no name in /run/netns: they live as long as their
hostd, and each hostd dies with the process that started it (the `unshare`
that holds it gets SIGKILL when its parent dies, and takes hostd with it).
Traffic goes only over the hosts' own loopbacks and the veth link between
them; nothing reaches the machine's network.

Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN), util-linux's `unshare`
and iproute2's `ip`.
"""

import argparse
import array
import ctypes
import json
import os
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

SUBNET = "10.77.0"  # hosts get .1, .2, ...; the namespaces are private, so it clashes with nothing
LINK = "eth0"
START_TIMEOUT = 20.0
PR_SET_PDEATHSIG = 1
SSH_FAILED = 255  # ssh's status when the connection fails


class Unavailable(Exception):
    """Namespaces cannot be made here; the message says why."""


def why_unavailable():
    """None if namespaces can be made here, else the reason."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making namespaces and veth links needs root"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (util-linux / iproute2)"
    return None


# ---------------------------------------------------------------- the cluster

class Host:
    def __init__(self, name, address, holder, pid, netns):
        self.name = name
        self.address = address
        self.holder = holder  # the `unshare` process (Popen) that holds hostd
        self.pid = pid  # hostd's pid as this machine's root PID namespace sees it
        self.netns = netns  # an fd on its network namespace

    def __repr__(self):
        return f"Host({self.name!r}, {self.address})"


class Cluster:
    """Hosts joined by one veth link (two hosts) or a bridge (more).

    Use as a context manager, or call start() and stop()."""

    def __init__(self, directory, names=("hosta", "hostb")):
        if len(set(names)) != len(names) or len(names) < 2:
            raise ValueError(f"need two or more distinct host names, got {names!r}")
        self.dir = os.path.abspath(directory)
        self.names = list(names)
        self.hosts = {}
        self.switch = None  # the process holding the bridge's namespace (3+ hosts)
        self.agent = os.path.join(self.dir, "agent")

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        reason = why_unavailable()
        if reason:
            raise Unavailable(reason)
        os.makedirs(self.dir, exist_ok=True)
        self._write_files()
        try:
            for i, name in enumerate(self.names, 1):
                self.hosts[name] = self._start_host(name, f"{SUBNET}.{i}")
            self._wire()
        except BaseException:
            self.stop()
            raise
        return self

    def _write_files(self):
        with open(os.path.join(self.dir, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n::1 localhost\n")
            for i, name in enumerate(self.names, 1):
                f.write(f"{SUBNET}.{i} {name}\n")
        with open(self.agent, "w") as f:
            f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} "
                    f"{shlex.quote(os.path.abspath(__file__))} agent "
                    f"{shlex.quote(self.dir)} \"$@\"\n")
        os.chmod(self.agent, 0o755)

    def _start_host(self, name, address):
        if os.path.exists(_socket_path(self.dir, name)):
            os.unlink(_socket_path(self.dir, name))
        os.makedirs(os.path.join(self.dir, name, "tmp"), exist_ok=True)
        log_path = os.path.join(self.dir, f"{name}.log")
        with open(log_path, "w") as log:
            holder = subprocess.Popen(
                ["unshare", "--net", "--uts", "--pid", "--mount-proc", "--kill-child",
                 sys.executable, os.path.abspath(__file__), "hostd", self.dir, name],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent)
        deadline = time.monotonic() + START_TIMEOUT
        while not os.path.exists(_socket_path(self.dir, name)):
            if holder.poll() is not None or time.monotonic() > deadline:
                holder.kill()
                holder.wait()
                with open(log_path) as log:
                    why = log.read().strip() or "unshare timed out"
                raise Unavailable(f"could not start host {name}: {why}")
            time.sleep(0.02)
        pid = _only_child(holder.pid)
        # Held open so that the host's network namespace, and the link to
        # it, outlive its processes (power_off): a dead host's switch port
        # stays.
        netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        return Host(name, address, holder, pid, netns)

    def _wire(self):
        hosts = list(self.hosts.values())
        if len(hosts) == 2:
            a, b = hosts
            _ip("link", "add", LINK, "netns", str(a.pid), "type", "veth",
                "peer", "name", LINK, "netns", str(b.pid))
        else:
            self.switch = subprocess.Popen(
                ["unshare", "--net", "--kill-child", "sleep", "infinity"],
                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            switch = _only_child(self.switch.pid)
            _nsenter(switch, "ip", "link", "add", "br0", "type", "bridge")
            _nsenter(switch, "ip", "link", "set", "br0", "up")
            for i, host in enumerate(hosts):
                _ip("link", "add", LINK, "netns", str(host.pid), "type", "veth",
                    "peer", "name", f"port{i}", "netns", str(switch))
                _nsenter(switch, "ip", "link", "set", f"port{i}", "master", "br0", "up")
        for host in hosts:
            _nsenter(host.pid, "ip", "addr", "add", f"{host.address}/24", "dev", LINK)
            _nsenter(host.pid, "ip", "link", "set", LINK, "up")

    def command(self, host, argv, env=None):
        """The argv that runs `argv` on `host` through the agent, with `env`
        set there (as `ssh host env K=V ... argv` would)."""
        words = ["env"] + [f"{k}={v}" for k, v in (env or {}).items()] + list(argv)
        return [self.agent, host, shlex.join(words)]

    def run(self, host, argv, env=None, **kwargs):
        """subprocess.run of `argv` on `host`."""
        return subprocess.run(self.command(host, argv, env), **kwargs)

    def popen(self, host, argv, env=None, **kwargs):
        return subprocess.Popen(self.command(host, argv, env), **kwargs)

    def kill_host(self, name):
        """Every process on `name` dies at once (its pid 1 gets SIGKILL, and
        the kernel kills the rest), as when a host's kernel panics in
        software but its network card still sends the resets: the other
        hosts see their connections to it close."""
        os.kill(self.hosts[name].pid, signal.SIGKILL)

    def processes(self, name):
        """{pid: command line} of the processes on `name` (pids as this
        machine's root PID namespace sees them), pid 1 (hostd) left out."""
        host = self.hosts[name]
        namespace = os.stat(f"/proc/{host.pid}/ns/pid").st_ino
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == host.pid:
                continue
            try:
                if os.stat(f"/proc/{entry}/ns/pid").st_ino != namespace:
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found[int(entry)] = f.read().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
        return found

    def kill_processes(self, name, word):
        """SIGKILLs every process on `name` whose command line contains
        `word`; returns how many."""
        pids = [pid for pid, line in self.processes(name).items() if word in line]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def power_off(self, name):
        """`name` goes silent, as when it loses power: its link goes down
        first, so nothing it had open says goodbye, then its processes die.
        Connections to it close only when the other side's timeouts say so,
        and `agent` sessions to it hang, as ssh's would."""
        host = self.hosts[name]
        open(_off_path(self.dir, name), "w").close()
        _nsenter(host.pid, "ip", "link", "set", LINK, "down")
        os.kill(host.pid, signal.SIGKILL)

    def stop(self):
        holders = [h.holder for h in self.hosts.values()]
        if self.switch is not None:
            holders.append(self.switch)
        for proc in holders:
            if proc.poll() is None:
                proc.kill()  # --kill-child: its hostd, and so its host, goes too
        for proc in holders:
            proc.wait()
        for host in self.hosts.values():
            os.close(host.netns)
            if os.path.exists(_off_path(self.dir, host.name)):
                os.unlink(_off_path(self.dir, host.name))
        self.hosts.clear()
        self.switch = None


def _socket_path(directory, name):
    return os.path.join(directory, f"{name}.sock")


def _off_path(directory, name):
    return os.path.join(directory, f"{name}.off")


def _die_with_parent():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _only_child(pid, timeout=5.0):
    """The pid of `pid`'s child (the namespace's pid 1 that unshare forked)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                return int(entry)
        time.sleep(0.01)
    raise Unavailable(f"unshare (pid {pid}) started no process")


def _ip(*args):
    _check(["ip", *args])


def _nsenter(pid, *argv):
    _check(["nsenter", "-t", str(pid), "-n", *argv])


def _check(argv):
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        raise Unavailable(f"`{shlex.join(argv)}` failed: {out.stderr.strip()}")


# ------------------------------------------------------------------- hostd

def login_environment(directory, name):
    """What a login shell on `name` would have: this virtualenv on PATH
    (as a .bashrc would put it), a private TMPDIR, nothing else."""
    return {
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/sbin",
                                 "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]),
        "HOME": os.path.expanduser("~"),
        "USER": os.environ.get("USER", "root"),
        "LOGNAME": os.environ.get("LOGNAME", "root"),
        "SHELL": "/bin/sh",
        "LANG": "C.UTF-8",
        "TMPDIR": os.path.join(directory, name, "tmp"),
    }


def hostd(directory, name):
    """pid 1 of host `name`: sets the host up, then serves the agent."""
    socket.sethostname(name)
    # This mount namespace is private: these mounts are the host's own.
    env = login_environment(directory, name)
    for argv in (["mount", "--bind", os.path.join(directory, "hosts"), "/etc/hosts"],
                 # Fresh at every start, as after a reboot: PRRTE's session
                 # directories of a host that was killed must not linger.
                 ["mount", "-t", "tmpfs", "-o", "size=8g", "tmpfs", "/dev/shm"],
                 ["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", env["TMPDIR"]],
                 ["umount", "-l", "/sys"],
                 ["mount", "-t", "sysfs", "sysfs", "/sys"],
                 ["ip", "link", "set", "lo", "up"]):
        _check(argv)
    path = _socket_path(directory, name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # it exists only once it accepts connections

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sessions = {}  # pid -> connection
    while True:
        for key, _ in sel.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                sel.register(conn, selectors.EVENT_READ, "request")
            elif key.data == "request":
                sel.unregister(key.fileobj)
                pid = _spawn(key.fileobj, env)
                if pid is not None:
                    sessions[pid] = key.fileobj
                    sel.register(key.fileobj, selectors.EVENT_READ, ("session", pid))
            elif key.data == "child":
                os.read(wake_r, 4096)
            else:  # the agent went away: end its command, as sshd would
                pid = key.data[1]
                sel.unregister(key.fileobj)
                try:
                    os.killpg(pid, signal.SIGTERM)
                except OSError:
                    pass
        _reap(sessions, sel)


def _spawn(conn, env):
    """Starts the command an agent sent; returns its pid, or None."""
    data, fds = b"", []
    while not data.endswith(b"\n"):
        msg, ancdata, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(3 * 4))
        if not msg:
            conn.close()
            return None
        data += msg
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(memoryview(payload).cast("i"))
    request = json.loads(data)
    try:
        proc = subprocess.Popen(["/bin/sh", "-c", request["command"]], cwd=request["cwd"],
                                env=env, stdin=fds[0], stdout=fds[1], stderr=fds[2],
                                start_new_session=True)
    except OSError as exc:
        _send_status(conn, 127, f"{exc}")
        return None
    finally:
        for fd in fds:
            os.close(fd)
    proc.returncode = 0  # hostd reaps it itself (_reap); keep Popen from waiting
    return proc.pid


def _reap(sessions, sel):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = sessions.pop(pid, None)
        if conn is None:
            continue  # an orphan this pid 1 adopted
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        code = os.waitstatus_to_exitcode(status)
        _send_status(conn, 128 - code if code < 0 else code)


def _send_status(conn, code, error=""):
    try:
        conn.sendall(json.dumps({"status": code, "error": error}).encode() + b"\n")
    except OSError:
        pass
    conn.close()


# ------------------------------------------------------------------- agent

def agent(directory, host, words):
    """ssh's stand-in: runs `words` (joined, as ssh joins them) on `host`."""
    path = _socket_path(directory, host)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError as exc:
        print(f"agent: cannot reach host {host} ({exc.strerror})", file=sys.stderr)
        return SSH_FAILED
    request = json.dumps({"command": " ".join(words), "cwd": os.getcwd()}).encode() + b"\n"
    fds = [0, 1, 2]
    conn.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                              array.array("i", fds).tobytes())])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(SSH_FAILED))
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            if os.path.exists(_off_path(directory, host)):
                signal.pause()  # a powered-off host never answers; ssh would hang
            print(f"agent: connection to {host} closed by remote host", file=sys.stderr)
            return SSH_FAILED
        reply += chunk
    answer = json.loads(reply)
    if answer.get("error"):
        print(f"agent: {host}: {answer['error']}", file=sys.stderr)
    return answer["status"]


# --------------------------------------------------------------------- CLI

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    up = sub.add_parser("up", help="start hosts and link them; stays in the foreground")
    up.add_argument("dir")
    up.add_argument("--hosts", default="hosta,hostb", help="comma-separated host names")
    d = sub.add_parser("hostd", help=argparse.SUPPRESS)
    d.add_argument("dir")
    d.add_argument("name")
    a = sub.add_parser("agent", help=argparse.SUPPRESS)
    a.add_argument("dir")
    a.add_argument("host")
    a.add_argument("words", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.what == "hostd":
        return hostd(args.dir, args.name)
    if args.what == "agent":
        return agent(args.dir, args.host, args.words)
    try:
        cluster = Cluster(args.dir, args.hosts.split(",")).start()
    except Unavailable as exc:
        print(f"netns: {exc}", file=sys.stderr)
        return 1
    print(f"hosts up: {', '.join(f'{h.name} {h.address}' for h in cluster.hosts.values())}; "
          f"run commands with {cluster.agent} HOST COMMAND; Ctrl-C takes them down",
          flush=True)
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    try:
        signal.sigwait(stop)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
