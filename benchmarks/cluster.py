"""A simulated cluster on one machine: N hosts, each a network namespace with its own address, host name and
shaped link to a switch, reached by ``ssh`` as real hosts are. Root only (``ip netns``, ``tc``).

What makes a host a host here, and what does not:

- **Its own network.** Host ``i`` (1-based) is the namespace ``parallel-PID-hI`` with ``eth0`` at ``10.77.0.I/24``
  and ``lo``; a veth pair joins ``eth0`` to a port of a bridge in a switch namespace (``parallel-PID-sw``). Each
  host's link is shaped to ``rate`` each way (``tc tbf`` on ``eth0``'s egress, the host's upload, and on the
  switch port's egress, its download), so the link is full duplex and each host has its own, as on a switch;
  traffic inside a host (``127.0.0.1``, its own address) never crosses it. ``link_bytes(i)`` reads tc's counters.
- **Its own name.** Every command on host ``i`` runs with the host name ``hI`` (a UTS namespace), and ``h1`` ...
  ``hN`` resolve to the hosts' addresses on every host (``/etc/netns/NS/hosts``, which ``ip netns exec`` mounts
  over ``/etc/hosts``).
- **ssh over the link.** Each host runs a stand-in sshd (this file, ``--sshd``) on port 22 of its address, and a
  stand-in ``ssh`` (this file, ``--ssh``) is first on the ``PATH`` of every command the cluster runs. The client
  connects over the simulated network like OpenSSH's, so a link that goes down takes the session with it: the
  client's ``-o ServerAliveInterval=N`` probes time out after ``ServerAliveCountMax`` unanswered ones (``Timeout,
  server HOST not responding.``, status 255) while the remote command lives on, cut off; a client that ends while
  the link is up hangs up the remote command (``-tt``: a pseudo-terminal whose master the sshd closes, so the
  command gets SIGHUP); one whose client stopped answering (the link cut) is hung up after about
  ``CLIENT_ALIVE_SECONDS``, as an sshd with ``ClientAliveInterval`` set does. The remote command gets sshd's fresh environment (``HOME``, ``USER``, ``LOGNAME``,
  ``SHELL``, a default ``PATH`` with the stand-in ``ssh`` first, ``LANG``/``LC_*`` as OpenSSH's ``SendEnv``
  passes them, ``SSH_CONNECTION``), never the caller's other variables, and starts in ``$HOME``; the client's
  stdin reaches it (``-n``: none).
- **Shared**: the file system, users, CPUs and memory (a host's processes compete for the same cores).

Use it from Python (the tests' ``cluster`` fixture, the benchmarks)::

    with Cluster(hosts=2, rate="1gbit") as cluster:
        job = cluster.popen(["python", "-m", "parallel.launch", "--launcher", "ssh", "-H", hostfile, ...], host=1)
        cluster.cut(2)          # host 2's link down, its processes alive: a partition
        cluster.kill_host(2)    # every process on host 2 SIGKILLed: a host lost

or run a command on host 1 of a new cluster (its status is the command's)::

    python benchmarks/cluster.py --hosts 3 --rate 100mbit -- python -m parallel.launch --launcher ssh ...

The command sees ``CLUSTER_HOSTS`` (the addresses, space-separated) and ``CLUSTER_HOSTFILE`` (a hostfile of them).
On exit every process on every host is ended and the namespaces removed; ``--cleanup-stale`` removes those of a
cluster whose process was SIGKILLed (a new ``Cluster`` does so too).
"""
import argparse
import contextlib
import itertools
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402

__all__ = ["Cluster", "ClusterUnavailable", "unavailable", "cleanup_stale", "SUBNET"]

#: The hosts' subnet: host i is SUBNET.i (each cluster has its own namespaces, so clusters never share addresses).
SUBNET = "10.77.0"
#: The stand-in sshd's port on each host.
SSH_PORT = 22
#: How long the stand-in sshd keeps a session whose client stopped answering (a cut link): about this many seconds,
#: as an sshd with ``ClientAliveInterval 10`` and ``ClientAliveCountMax 3`` (OpenSSH's default keeps it for hours).
CLIENT_ALIVE_SECONDS = 30
#: sshd's default PATH (Debian's), after the stand-in ssh's directory.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_PREFIX = "parallel-"
#: A cluster's namespaces: parallel-PID-N-hI (host I) and parallel-PID-N-sw (its switch), N counting the clusters
#: of process PID.
_NAMESPACE = re.compile(r"^parallel-(\d+)-\d+-(h\d+|sw|probe)$")
_numbers = itertools.count(1)   # numbers the clusters this process makes


class ClusterUnavailable(RuntimeError):
    """This machine cannot make a simulated cluster (not root, no ``ip``/``tc``, no network namespaces)."""


def unavailable():
    """Why a simulated cluster cannot be made here (one line), or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2, util-linux)"
    probe = f"{_PREFIX}{os.getpid()}-0-probe"
    try:
        _sh("ip", "netns", "add", probe)
    except ClusterUnavailable as e:
        return f"cannot make a network namespace ({e})"
    _sh("ip", "netns", "del", probe, check=False)
    return None


def _sh(*argv, check=True):
    """Run one ``ip``/``tc`` command; its stdout. A failure raises ``ClusterUnavailable`` with its stderr, or
    with ``check=False`` gives ``""``."""
    try:
        return harness.run_process(list(argv), timeout=60)[0]
    except harness.BenchmarkError as e:
        if check:
            raise ClusterUnavailable(str(e)) from None
        return ""


def _namespace_pids(namespace):
    """The processes in ``namespace`` (``ip netns pids``)."""
    return [int(p) for p in _sh("ip", "netns", "pids", namespace, check=False).split()]


def _end_processes(namespaces, grace=3.0):
    """SIGTERM every process in ``namespaces``, SIGKILL what is left after ``grace`` seconds; wait until none is."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for namespace in namespaces:
            for pid in _namespace_pids(namespace):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not any(_namespace_pids(namespace) for namespace in namespaces):
                return
            time.sleep(0.05)


def _remove_namespaces(namespaces):
    """End the processes of ``namespaces`` and delete them (their veths go with them) and their hosts files."""
    _end_processes(namespaces)
    for namespace in namespaces:
        _sh("ip", "netns", "del", namespace, check=False)
        shutil.rmtree(os.path.join("/etc/netns", namespace), ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir("/etc/netns")


def cleanup_stale():
    """Remove the namespaces of clusters whose process is gone (SIGKILLed before it could clean up); their names."""
    stale = []
    for line in _sh("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAMESPACE.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            stale.append(name)
    _remove_namespaces(stale)
    return stale


def _burst(rate):
    """tbf's bucket for ``rate`` (``1gbit``, ``100mbit``): 1 ms of it, at least 128 KiB (as tools/twohost)."""
    match = re.fullmatch(r"([0-9.]+)\s*([kmgt]?)(bit|bps)", rate.strip().lower())
    if match is None:
        raise ValueError(f"rate must be like 1gbit, 100mbit or 10mbps, got {rate!r}")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match.group(2)]
    per_second = float(match.group(1)) * scale / (8 if match.group(3) == "bit" else 1)
    return max(131072, int(per_second / 1000))


class Host:
    """One simulated host: its name (``h1``), address, namespace and the switch port of its link."""

    def __init__(self, index, namespace, port):
        self.index, self.namespace, self.port = index, namespace, port
        self.name, self.address = f"h{index}", f"{SUBNET}.{index}"

    def __repr__(self):
        return f"Host({self.name}, {self.address})"


class Cluster:
    """``hosts`` simulated hosts on a switch, each link shaped to ``rate`` each way (None: unshaped); see the
    module's docstring. A context manager: ``start()`` on entry, ``close()`` on exit.

    Parameters
    ----------
    hosts : int
        How many hosts (>= 1).
    rate : str or None
        tc's rate of each direction of each host's link (``1gbit``, ``100mbit``); None for no shaping.
    latency : str
        tbf's queue: at most this much waiting data a direction (a switch-sized buffer).
    """

    def __init__(self, hosts=2, rate="1gbit", latency="10ms"):
        if isinstance(hosts, bool) or not isinstance(hosts, int):
            raise TypeError(f"hosts must be an int, got {type(hosts).__name__}")
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be from 1 to 200, got {hosts}")
        self.burst = None if rate is None else _burst(rate)
        self.rate, self.latency = rate, latency
        tag = f"{_PREFIX}{os.getpid()}-{next(_numbers)}"
        self.switch = f"{tag}-sw"
        self.hosts = [Host(i, f"{tag}-h{i}", f"p{i}") for i in range(1, hosts + 1)]
        self.bin = None
        self.hostfile = None
        self.sshd = {}   # host index -> its sshd's process

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def host(self, i):
        """Host ``i`` (1-based, as its name ``hI``)."""
        if not 1 <= i <= len(self.hosts):
            raise ValueError(f"host must be from 1 to {len(self.hosts)}, got {i}")
        return self.hosts[i - 1]

    @property
    def addresses(self):
        """The hosts' addresses, host 1's first."""
        return [host.address for host in self.hosts]

    def start(self):
        """Make the switch, the hosts, their links and names, the stand-in ssh and each host's sshd."""
        reason = unavailable()
        if reason:
            raise ClusterUnavailable(reason)
        cleanup_stale()
        try:
            _sh("ip", "netns", "add", self.switch)
            _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            with open("/etc/hosts") as f:   # this machine's names, and the hosts' names, on every host
                names = f.read().rstrip("\n") + "\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts)
            for host in self.hosts:
                self._add_host(host, names)
            self._write_tools()
            for host in self.hosts:
                self._start_sshd(host)
        except BaseException:
            self.close()
            raise

    def _add_host(self, host, names):
        """Host ``host``'s namespace, its link to the switch (shaped both ways) and its hosts file (``names``)."""
        ns = host.namespace
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", host.port, "netns",
            self.switch)
        _sh("ip", "-n", self.switch, "link", "set", host.port, "master", "br0")
        _sh("ip", "-n", self.switch, "link", "set", host.port, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        if self.rate is not None:
            for where, dev in ((ns, "eth0"), (self.switch, host.port)):
                _sh("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst",
                    str(self.burst), "latency", self.latency)
        os.makedirs(os.path.join("/etc/netns", ns), exist_ok=True)
        with open(os.path.join("/etc/netns", ns, "hosts"), "w") as f:
            f.write(names)

    def _write_tools(self):
        """A directory with the stand-in ``ssh`` (this file's ``--ssh``), and a hostfile of the hosts."""
        self.bin = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-bin-")
        script = os.path.join(self.bin, "ssh")
        with open(script, "w") as f:
            f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(os.path.abspath(__file__))} "
                    "--ssh \"$@\"\n")
        os.chmod(script, 0o755)
        self.hostfile = os.path.join(self.bin, "hosts.txt")
        with open(self.hostfile, "w") as f:
            f.write("".join(f"{address}\n" for address in self.addresses))

    def _start_sshd(self, host):
        """Host ``host``'s stand-in sshd, listening once this returns."""
        argv = [sys.executable, os.path.abspath(__file__), "--sshd", host.address, "--ssh-dir", self.bin]
        process = self.popen(argv, host=host.index, stdout=subprocess.PIPE)
        self.sshd[host.index] = process
        line = process.stdout.readline()   # "listening" once bound, or nothing when it failed
        process.stdout.close()
        if not line.startswith(b"listening"):
            raise ClusterUnavailable(f"the sshd of {host.name} did not start")

    def wrap(self, argv, host=1):
        """``argv`` as it runs on host ``host``: in its namespace, with its host name."""
        ns = self.host(host).namespace
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "--", "/bin/sh", "-c",
                'hostname "$0" && exec "$@"', self.host(host).name, *argv]

    def env(self, env=None):
        """``env`` (default this process's) with the stand-in ssh first on ``PATH`` and ``CLUSTER_HOSTS`` /
        ``CLUSTER_HOSTFILE``."""
        env = dict(os.environ if env is None else env)
        env["PATH"] = self.bin + os.pathsep + env.get("PATH", DEFAULT_PATH)
        env.update(CLUSTER_HOSTS=" ".join(self.addresses), CLUSTER_HOSTFILE=self.hostfile)
        return env

    def popen(self, argv, host=1, env=None, **kwargs):
        """Start ``argv`` on host ``host`` in a session of its own (``subprocess.Popen``'s ``kwargs``); the
        environment is ``env`` (default this process's) with the stand-in ssh first on ``PATH``."""
        return subprocess.Popen(self.wrap(argv, host), env=self.env(env), start_new_session=True, **kwargs)

    def cut(self, i):
        """Take host ``i``'s link down (the switch's end): its processes live on, unreachable."""
        _sh("ip", "-n", self.switch, "link", "set", self.host(i).port, "down")

    def heal(self, i):
        """Bring host ``i``'s link up again."""
        _sh("ip", "-n", self.switch, "link", "set", self.host(i).port, "up")

    def kill_host(self, i):
        """SIGKILL every process on host ``i`` (its sshd too) and take its link down: the host is lost."""
        self.cut(i)
        for pid in _namespace_pids(self.host(i).namespace):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def processes(self, i):
        """The processes on host ``i`` but its sshd (the stand-in for the host's own system processes)."""
        sshd = self.sshd.get(i)
        return [pid for pid in _namespace_pids(self.host(i).namespace) if sshd is None or pid != sshd.pid]

    def link_bytes(self, i):
        """``(sent, received)``: the bytes host ``i``'s link has carried each way so far (tc's counters, which
        count every packet's headers)."""
        host = self.host(i)
        return (_qdisc_bytes(host.namespace, "eth0"), _qdisc_bytes(self.switch, host.port))

    def close(self):
        """End every process on every host and remove the namespaces and the ssh directory."""
        _remove_namespaces([host.namespace for host in self.hosts] + [self.switch])
        for sshd in self.sshd.values():
            sshd.wait()
        if self.bin:
            shutil.rmtree(self.bin, ignore_errors=True)


def _qdisc_bytes(namespace, dev):
    """The bytes sent through ``dev``'s root qdisc in ``namespace`` (the interface's counter when unshaped)."""
    out = _sh("tc", "-n", namespace, "-s", "qdisc", "show", "dev", dev, check=False)
    match = re.search(r"Sent (\d+) bytes", out)
    if match and "noqueue" not in out.split("\n", 1)[0]:
        return int(match.group(1))
    stats = _sh("ip", "-n", namespace, "-s", "-j", "link", "show", "dev", dev, check=False)
    return json.loads(stats)[0]["stats64"]["tx"]["bytes"] if stats.strip() else 0


# ---- the stand-in ssh: a client and a server over TCP -------------------------------------------------------------
# Frames: one type byte, a 4-byte length, the payload. Client to server: H (the header: JSON of the command, tty,
# environment), I (stdin), E (stdin's end), P (a keepalive probe). Server to client: O (output), R (stderr without a terminal), Q (a probe's
# answer), X (the exit status, 4 bytes).

def _send(sock, kind, payload=b""):
    sock.sendall(kind + struct.pack("!I", len(payload)) + payload)


def _receive(sock):
    """The next frame ``(kind, payload)``; None when the connection ended."""
    head = _read_exactly(sock, 5)
    if head is None:
        return None
    payload = _read_exactly(sock, struct.unpack("!I", head[1:])[0])
    return None if payload is None else (head[:1], payload)


def _read_exactly(sock, n):
    data = b""
    while len(data) < n:
        try:
            piece = sock.recv(n - len(data))
        except OSError:
            return None
        if not piece:
            return None
        data += piece
    return data


def parse_ssh(argv):
    """OpenSSH's command line: ``(options, host, command)``; options ``tty`` (a terminal asked for),
    ``port``, ``alive_interval``, ``alive_count``, ``connect_timeout``, ``quiet``. Options it has no use for are
    accepted. A bad line exits 255 with ssh's message.

    >>> parse_ssh(["-tt", "-o", "ServerAliveInterval=5", "-p", "22", "h2", "cd /x && exec python"])[1:]
    ('h2', 'cd /x && exec python')
    """
    options = {"tty": False, "port": SSH_PORT, "alive_interval": 0.0, "alive_count": 3, "connect_timeout": 10.0,
               "quiet": False, "no_stdin": False}
    keys = {"serveraliveinterval": ("alive_interval", float), "serveralivecountmax": ("alive_count", int),
            "connecttimeout": ("connect_timeout", float), "port": ("port", int)}
    i, host, words = 0, None, list(argv)
    while i < len(words):
        flag = words[i]
        if flag == "--":
            if host is not None:
                break
            i += 1
            continue
        if not flag.startswith("-") or flag == "-":
            if host is not None:
                break
            host = flag.rsplit("@", 1)[-1]   # options may follow the destination (OpenSSH parses them again)
            i += 1
            continue
        i += _ssh_option(options, keys, flag, words[i + 1] if i + 1 < len(words) else None)
    if host is None:
        _die("usage: ssh [options] destination [command]")
    return options, host, " ".join(words[i + 1:] if i < len(words) and words[i] == "--" else words[i:])


def _ssh_option(options, keys, flag, value):
    """Read one option ``flag`` (and its ``value`` when it takes one) into ``options``; how many words it used."""
    if flag in ("-o", "-p", "-i", "-l", "-F", "-E", "-J") and value is not None:
        if flag == "-p":
            options["port"] = int(value)
        elif flag == "-o":
            key, _, val = value.replace(" ", "=", 1).partition("=")
            if key.lower() in keys:
                name, kind = keys[key.lower()]
                options[name] = kind(val)
        return 2
    options["tty"] = options["tty"] or "t" in flag
    options["quiet"] = options["quiet"] or "q" in flag
    options["no_stdin"] = options["no_stdin"] or "n" in flag
    return 1


def _die(message, status=255):
    sys.stderr.write(message + "\n")
    sys.exit(status)


def ssh_main(argv):
    """The stand-in ``ssh`` (``--ssh ARGS``): run the command on the host over the simulated network."""
    options, host, command = parse_ssh(argv)
    try:
        sock = socket.create_connection((host, options["port"]), timeout=options["connect_timeout"])
    except socket.gaierror:
        _die(f"ssh: Could not resolve hostname {host}: Name or service not known")
    except OSError as e:
        _die(f"ssh: connect to host {host} port {options['port']}: {e.strerror or e}")
    sock.settimeout(None)
    env = {k: v for k, v in os.environ.items() if k == "LANG" or k.startswith("LC_")}
    _send(sock, b"H", json.dumps({"command": command, "tty": options["tty"], "env": env}).encode())
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: os._exit(255))
    lock = threading.Lock()
    if not options["no_stdin"]:
        threading.Thread(target=_send_stdin, args=(sock, lock), daemon=True).start()
    return _relay_to_client(sock, host, options, lock)


def _send_stdin(sock, lock):
    """Send this process's stdin to the session, then its end (``-n``: none of it)."""
    while True:
        try:
            data = os.read(0, 65536)
        except OSError:
            data = b""
        with lock, contextlib.suppress(OSError):
            _send(sock, b"I" if data else b"E", data)
        if not data:
            return


def _relay_to_client(sock, host, options, lock):
    """Copy the session's output here until its exit status comes; probe the server every
    ``ServerAliveInterval`` seconds and give up after ``ServerAliveCountMax`` probes without an answer."""
    interval, unanswered = options["alive_interval"] or None, 0
    while True:
        ready, _, _ = select.select([sock], [], [], interval)
        if not ready:
            unanswered += 1
            if unanswered > options["alive_count"]:
                _die(f"Timeout, server {host} not responding.")
            with lock, contextlib.suppress(OSError):
                _send(sock, b"P")
            continue
        frame = _receive(sock)
        if frame is None:
            _die(f"Connection to {host} closed by remote host.")
        unanswered = 0
        kind, payload = frame
        if kind in (b"O", b"R"):
            stream = sys.stdout.buffer if kind == b"O" else sys.stderr.buffer
            stream.write(payload)
            stream.flush()
        elif kind == b"X":
            if options["tty"] and not options["quiet"]:
                sys.stderr.write(f"Connection to {host} closed.\n")
            return struct.unpack("!i", payload)[0]


def sshd_main(address, ssh_dir):
    """The stand-in sshd (``--sshd ADDRESS``): serve sessions on ``ADDRESS:22`` until killed."""
    server = socket.create_server((address, SSH_PORT))
    print("listening", flush=True)
    sys.stdout = open(os.devnull, "w")   # nobody reads the pipe after the first line
    while True:
        sock, peer = server.accept()
        _keep_alive(sock, CLIENT_ALIVE_SECONDS)
        threading.Thread(target=_session, args=(sock, peer, address, ssh_dir), daemon=True).start()


def _keep_alive(sock, seconds):
    """Drop a session whose client has not answered for about ``seconds`` (TCP keepalive probes when the session
    is idle, a limit on unacknowledged data when it is not: what sshd's ``ClientAliveInterval`` and
    ``ClientAliveCountMax`` do), so that a command cut off by a partition is hung up."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    step = max(1, int(seconds / 3))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, step)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, step)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(seconds * 1000))   # data left unacknowledged


def _session_env(header, peer, address, ssh_dir):
    """sshd's fresh environment for a session (as Debian's sshd with ``AcceptEnv LANG LC_*``)."""
    import pwd
    user = pwd.getpwuid(os.getuid())
    env = {"HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name, "SHELL": "/bin/sh",
           "PATH": ssh_dir + os.pathsep + DEFAULT_PATH, "SSH_CONNECTION": f"{peer[0]} {peer[1]} {address} 22"}
    env.update({k: v for k, v in header.get("env", {}).items() if k == "LANG" or k.startswith("LC_")})
    if header.get("tty"):
        env["TERM"] = "xterm"
    return env


def _session(sock, peer, address, ssh_dir):
    """One ssh session: its command under ``/bin/sh -c`` (with a pseudo-terminal when asked for) in ``$HOME``,
    its output sent back, its exit status last; when the client goes, the terminal hangs up."""
    frame = _receive(sock)
    if frame is None or frame[0] != b"H":
        sock.close()
        return
    header = json.loads(frame[1])
    env = _session_env(header, peer, address, ssh_dir)
    lock = threading.Lock()
    if header.get("tty"):
        master, slave = os.openpty()
        process = subprocess.Popen(["/bin/sh", "-c", header["command"] or "exec /bin/sh"], stdin=slave,
                                   stdout=slave, stderr=slave, cwd=env["HOME"], env=env, start_new_session=True,
                                   preexec_fn=_take_terminal)
        os.close(slave)
        sources = {master: b"O"}
    else:
        master = None
        process = subprocess.Popen(["/bin/sh", "-c", header["command"]], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=env["HOME"], env=env,
                                   start_new_session=True, preexec_fn=_default_signals)
        sources = {process.stdout.fileno(): b"O", process.stderr.fileno(): b"R"}
    stdin = master if master is not None else process.stdin.fileno()
    threading.Thread(target=_answer_client, args=(sock, process, stdin, lock), daemon=True).start()
    _relay_to_server(sock, sources, lock)
    if master is not None:
        os.close(master)
    status = process.wait()
    with lock, contextlib.suppress(OSError):
        _send(sock, b"X", struct.pack("!i", status if status >= 0 else 255))
    with contextlib.suppress(OSError):
        sock.close()


def _default_signals():
    """In a session's child: every signal at its default, as sshd starts a session (an sshd started under
    ``nohup`` or by a shell that ignores SIGHUP must not pass that on: a hung-up session must end)."""
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGPIPE, signal.SIGTSTP):
        signal.signal(sig, signal.SIG_DFL)


def _take_terminal():
    """In the session's child: default signals, and the pseudo-terminal on stdin as the controlling terminal of
    its new session."""
    import fcntl
    import termios
    _default_signals()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _relay_to_server(sock, sources, lock):
    """Send what the session's output descriptors give until each is closed (or the terminal hung up)."""
    while sources:
        ready, _, _ = select.select(list(sources), [], [])
        for fd in ready:
            try:
                data = os.read(fd, 65536)
            except OSError:   # a terminal whose last writer ended, or that was hung up
                data = b""
            if not data:
                del sources[fd]
                continue
            with lock, contextlib.suppress(OSError):
                _send(sock, sources[fd], data)


def _answer_client(sock, process, stdin, lock):
    """Pass the client's stdin to the session (its end closes the pipe; a terminal stays open) and answer its
    probes; when the connection ends before the command, hang up its session (SIGHUP, as the kernel sends when
    sshd closes a terminal's master; without a terminal too, where a real sshd's closed pipes would end it at its
    next write)."""
    while True:
        frame = _receive(sock)
        if frame is None:
            break
        kind, payload = frame
        if kind == b"P":
            with lock, contextlib.suppress(OSError):
                _send(sock, b"Q")
        elif kind == b"I":
            with contextlib.suppress(OSError):
                os.write(stdin, payload)
        elif kind == b"E" and process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGHUP)


def main(argv=None):
    """``--ssh``/``--sshd``: the stand-ins; else run ``COMMAND`` on host 1 of a new cluster; its exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--ssh"]:
        return ssh_main(argv[1:])
    if argv[:1] == ["--sshd"]:
        return sshd_main(argv[1], argv[3])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2, help="how many hosts; default 2")
    parser.add_argument("--rate", default="1gbit", help="each link's rate each way (tc's), or none; default 1gbit")
    parser.add_argument("--cleanup-stale", action="store_true", help="remove the namespaces of dead clusters")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run on host 1")
    args = parser.parse_args(argv)
    if args.cleanup_stale:
        print("\n".join(cleanup_stale()))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a COMMAND to run on host 1 (after --)")
    try:
        with Cluster(args.hosts, None if args.rate == "none" else args.rate) as cluster:
            process = cluster.popen(command, host=1)
            try:
                return process.wait()
            except KeyboardInterrupt:
                harness.stop_group(process)
                return 130
    except (ClusterUnavailable, ValueError, TypeError) as e:
        print(f"cluster.py: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
