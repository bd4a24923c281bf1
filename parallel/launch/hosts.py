"""Where the launcher's job runs: the hostfile, the host discovery script, the hosts that answer ssh, this
machine's names, the hosts available for workers at a start (``-n MIN:MAX``), and the scheduler's address and
port."""
import contextlib
import socket
import subprocess

from ..cli import UsageError
from .restarts import BAD_DISCOVERY, Failure

__all__ = ["parse_hostfile", "default_scheduler_host", "free_port", "check_port", "available_slots"]

_DISCOVERY_TIMEOUT = 60.0


def parse_hostfile(path):
    """The hosts of a hostfile, in order: one ``host[:ssh port]`` a line, ``#`` comments and blank lines ignored.

    Returns
    -------
    list of (str, int or None)
        At least one host; raises ``UsageError`` for a missing, unreadable or empty file or a bad line.
    """
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise UsageError(f"cannot read the hostfile {path!r}: {e.strerror or e}") from None
    try:
        hosts = _parse_host_lines(lines)
    except ValueError as e:
        raise UsageError(f"hostfile {path!r}, {e}") from None
    if not hosts:
        raise UsageError(f"the hostfile {path!r} names no host; write one host[:port] a line")
    return hosts


def _parse_host_lines(lines):
    """The ``(host, port or None)`` of each ``host[:port]`` line, ``#`` comments and blank lines skipped; a bad
    line raises ``ValueError`` naming its number.

    >>> _parse_host_lines(["# hosts", "node1", "", "node2:22  # the second"])
    [('node1', None), ('node2', 22)]
    """
    hosts = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if line:
            try:
                hosts.append(_parse_host(line))
            except ValueError as e:
                raise ValueError(f"line {number}: {e}") from None
    return hosts


def _parse_host(text):
    """``(host, port or None)`` from ``host`` or ``host:port``.

    >>> _parse_host("node1"), _parse_host("127.0.0.1:2222")
    (('node1', None), ('127.0.0.1', 2222))
    """
    host, sep, port = text.partition(":")
    if " " in text or not host or (sep and not (port.isdigit() and 1 <= int(port) <= 65535)):
        raise ValueError(f"{text!r} is not host or host:port (port 1-65535)")
    return host, int(port) if sep else None


def default_scheduler_host(hosts):
    """``--scheduler-host`` when not given: 127.0.0.1 when every host is local, else this machine's address."""
    if all(host in ("localhost", "127.0.0.1") for host, _ in hosts):
        return "127.0.0.1"
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise UsageError(f"cannot find this machine's address ({e}); give --scheduler-host, an address of this "
                         "machine the hosts can reach") from None


def free_port():
    """A port free on this machine now, for the scheduler."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_port(port):
    """Raise ``UsageError`` unless ``--port`` ``port`` is a port number free on this machine."""
    if not 1 <= port <= 65535:
        raise UsageError(f"--port must be between 1 and 65535, got {port}")
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as e:
            raise UsageError(f"--port {port} is not free ({e.strerror or e}); choose another, or leave --port out "
                             "and the launcher picks a free one") from None


def _local_names():
    names = {"localhost", "127.0.0.1", socket.gethostname()}
    with contextlib.suppress(OSError):
        names.add(socket.getfqdn())
    return names


def _discover(args):
    """The hosts the ``--host-discovery-script`` prints now, one worker slot a line; ``[]`` if it fails."""
    return listed_slots(args) or []


def listed_slots(args):
    """The hosts the ``--host-discovery-script`` prints now, one worker slot a line; None when the script fails
    (exits with another status than 0, or runs over a minute): nothing is known then. Raises ``Failure``
    (``BAD_DISCOVERY``) for a bad line, or another host than this machine's with ``--launcher local``."""
    try:
        result = subprocess.run(args.host_discovery_script, shell=True, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=_DISCOVERY_TIMEOUT, start_new_session=True)
    except subprocess.TimeoutExpired:
        return None
    if result.returncode != 0:
        return None
    try:
        hosts = _parse_host_lines(result.stdout.splitlines())
    except ValueError as e:
        raise Failure(BAD_DISCOVERY, f"--host-discovery-script printed a bad {e}") from None
    if args.launcher == "local":
        names = _local_names()
        for host, _ in hosts:
            if host not in names:
                raise Failure(BAD_DISCOVERY, f"--host-discovery-script named the host {host!r}, but --launcher "
                                             "local runs every process on this machine; print localhost, or use "
                                             "--launcher ssh")
        hosts = [("127.0.0.1", None)] * len(hosts)
    return hosts


def _reachable(args, hosts):
    """Of the hostfile's ``hosts``, those that answer ssh now (each host asked once)."""
    answers = {}
    for host, port in hosts:
        if (host, port) not in answers:
            argv = ["ssh", *sum((["-o", option] for option in args.ssh_option), []), "-o", "BatchMode=yes",
                    "-o", "ConnectTimeout=5", "-o", "StrictHostKeyChecking=accept-new",
                    *(["-p", str(port)] if port is not None else []), host, "true"]
            try:
                answers[host, port] = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                                     timeout=30, start_new_session=True).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                answers[host, port] = False
    return [(host, port) for host, port in hosts if answers[host, port]]


def available_slots(args):
    """The hosts available for workers now (one slot a line), or None when the job's hosts are fixed."""
    if args.host_discovery_script is not None:
        return _discover(args)
    if args.elastic and args.launcher == "ssh":
        return _reachable(args, parse_hostfile(args.hostfile))
    return None
