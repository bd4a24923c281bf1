"""An elastic job's committed state handed from one process to another over TCP, with no file between them.

Each worker of an elastic job (``PARALLEL_ELASTIC=1``, set by ``python -m parallel.launch`` for ``-n MIN:MAX`` or
a ``--host-discovery-script``) commits its training state in memory (``parallel.checkpoint.packer``)
and serves the latest commit with a ``StateServer``, a thread that answers while the worker's main thread waits in
a collective (MXNet's calls release the interpreter's lock). It says where in one line (``announcement``), which
the launcher reads from its output. When the job's hosts change or a process fails, the launcher fetches the
newest commit from a worker that is still alive (``fetch_state``), serves it with a ``StateServer`` of its own,
and starts the next workers with ``PARALLEL_ELASTIC_STATE=host:port``: rank 0 fetches it and resumes from it.

A commit is cheap: a worker hands ``commit`` a function that packs the state (its host copies, taken with
MXNet's asynchronous copies), and the server calls it once, on the first request for that commit.

The protocol: a client connects and sends one byte, ``L`` for the latest commit or ``N`` for the next one (the
first commit after the request: a worker that is still training loses no step to the change), then reads a
header (the commit's optimizer step, -1 when nothing is committed yet, and its length in bytes) and the bytes.
Standard library only: the launcher, which never imports MXNet, uses it too.

>>> server = StateServer("127.0.0.1")
>>> fetch_state("127.0.0.1", server.port)
(-1, b'')
>>> server.commit(12, lambda: b"state")
>>> fetch_state("127.0.0.1", server.port)
(12, b'state')
>>> parse_announcement(server.announcement()) == server.port
True
>>> server.close()
"""
import re
import socket
import socketserver
import struct
import threading

__all__ = ["ELASTIC_ENV", "STATE_ENV", "StateServer", "fetch_state", "parse_announcement", "parse_address"]

#: ``"1"`` in the environment of an elastic job's workers: commit in memory and serve the commits.
ELASTIC_ENV = "PARALLEL_ELASTIC"
#: ``host:port`` of the state a start after a change resumes from (the launcher's ``StateServer``).
STATE_ENV = "PARALLEL_ELASTIC_STATE"

_HEADER = struct.Struct("<qQ")   # the commit's step (-1: none yet), its length in bytes
_LATEST, _NEXT = b"L", b"N"
_ANNOUNCEMENT = "parallel-elastic: commits served on port {port}"
_ANNOUNCED = re.compile(r"^parallel-elastic: commits served on port (\d+)$")
_CHUNK = 1 << 20
#: How long a request for the next commit waits for one before it takes the latest.
_NEXT_SECONDS = 60.0


class StateServer:
    """A thread that serves the latest commit (``commit(step, data)``) to every client that connects.

    Parameters
    ----------
    host : str
        The address to listen on; ``""`` (the default) listens on every address of the machine.
    """

    def __init__(self, host=""):
        self._changed = threading.Condition()
        self._latest = (-1, b"")
        self._packing = threading.Lock()   # one packing of a commit at a time
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                try:
                    wanted = self.request.recv(1)
                    if wanted == _NEXT:
                        outer.wait_for_next(outer.latest_step(), _NEXT_SECONDS)
                    step, data = outer.latest()
                    self.request.sendall(_HEADER.pack(step, len(data)))
                    self.request.sendall(memoryview(data))
                except OSError:   # the client went away: its fetch fails, not this server
                    pass

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="parallel-state-server", daemon=True)
        self._thread.start()

    def commit(self, step, data):
        """Serve the state after optimizer step ``step`` from now on: ``data``, bytes or a function of no argument
        that returns them (called once, when the commit is first asked for, in the server's thread)."""
        with self._changed:
            self._latest = (int(step), data)
            self._changed.notify_all()

    def latest_step(self):
        """The step of the latest commit; -1 before the first."""
        with self._changed:
            return self._latest[0]

    def wait_for_next(self, step, timeout):
        """Wait up to ``timeout`` seconds for a commit after step ``step``; whether one came."""
        with self._changed:
            return self._changed.wait_for(lambda: self._latest[0] > step, timeout)

    def latest(self):
        """``(step, bytes)`` of the latest commit, packed now if it was not yet; ``(-1, b"")`` before the first."""
        with self._packing:
            with self._changed:
                step, data = self._latest
            if callable(data):
                data = data()
                with self._changed:
                    if self._latest[0] == step:   # keep the bytes unless a newer commit came meanwhile
                        self._latest = (step, data)
            return step, data

    def announcement(self):
        """The line that tells the launcher where this server listens."""
        return _ANNOUNCEMENT.format(port=self.port)

    def close(self):
        """Stop serving (a fetch under way is cut short) and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def parse_announcement(line):
    """The port a worker's ``StateServer.announcement`` line names, or None for any other line."""
    found = _ANNOUNCED.match(line)
    return int(found.group(1)) if found else None


def parse_address(text):
    """``(host, port)`` of a ``host:port`` (``STATE_ENV``'s value); raises ``ValueError`` naming it otherwise.

    >>> parse_address("10.0.0.2:4711")
    ('10.0.0.2', 4711)
    """
    host, sep, port = str(text).rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"{STATE_ENV} must be host:port, got {text!r}")
    return host, int(port)


def fetch_state(host, port, timeout=60.0, next_commit=False):
    """The latest commit of the ``StateServer`` at ``host``:``port``, as ``(step, bytes)``; with ``next_commit``,
    the first commit after this request (the latest if none comes within a minute).

    Raises ``OSError`` (``ConnectionError`` when the server closes before the whole commit arrived, ``TimeoutError``
    when nothing arrives for ``timeout`` seconds, which a wait for the next commit adds to)."""
    with socket.create_connection((host, port), timeout=timeout) as connection:
        connection.sendall(_NEXT if next_commit else _LATEST)
        if next_commit:
            connection.settimeout(timeout + _NEXT_SECONDS)
        step, length = _HEADER.unpack(_read(connection, _HEADER.size))
        return step, _read(connection, length)


def _read(connection, length):
    """Exactly ``length`` bytes from ``connection``."""
    data = bytearray(length)
    view, got = memoryview(data), 0
    while got < length:
        n = connection.recv_into(view[got:], min(_CHUNK, length - got))
        if n == 0:
            raise ConnectionError(f"the state's sender closed the connection after {got} of {length} bytes")
        got += n
    return bytes(data)
