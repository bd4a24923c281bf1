"""An elastic job's committed state handed from one process to another over TCP, with no file between them.

Each worker of an elastic job (``PARALLEL_ELASTIC=1``, set by ``python -m parallel.launch`` for ``-n MIN:MAX`` or
a ``--host-discovery-script``) commits its training state in memory (``parallel.checkpoint.checkpoint_bytes``)
and serves the latest commit with a ``StateServer``, a thread that answers while the worker's main thread waits in
a collective (MXNet's calls release the interpreter's lock). It says where in one line (``announcement``), which
the launcher reads from its output. When the job's hosts change or a process fails, the launcher fetches the
newest commit from a worker that is still alive (``fetch_state``), serves it with a ``StateServer`` of its own,
and starts the next workers with ``PARALLEL_ELASTIC_STATE=host:port``: rank 0 fetches it and resumes from it.

The protocol: a client connects and reads a header (the commit's optimizer step, -1 when nothing is committed
yet, and its length in bytes), then the bytes. Standard library only: the launcher, which never imports MXNet,
uses it too.

>>> server = StateServer("127.0.0.1")
>>> fetch_state("127.0.0.1", server.port)
(-1, b'')
>>> server.commit(12, b"state")
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
_ANNOUNCEMENT = "parallel-elastic: commits served on port {port}"
_ANNOUNCED = re.compile(r"^parallel-elastic: commits served on port (\d+)$")
_CHUNK = 1 << 20


class StateServer:
    """A thread that serves the latest commit (``commit(step, data)``) to every client that connects.

    Parameters
    ----------
    host : str
        The address to listen on; ``""`` (the default) listens on every address of the machine.
    """

    def __init__(self, host=""):
        self._lock = threading.Lock()
        self._latest = (-1, b"")
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                step, data = outer.latest()
                try:
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
        """Serve ``data`` (bytes), the state after optimizer step ``step``, from now on."""
        with self._lock:
            self._latest = (int(step), bytes(data) if not isinstance(data, bytes) else data)

    def latest(self):
        """``(step, data)`` of the latest commit; ``(-1, b"")`` before the first."""
        with self._lock:
            return self._latest

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


def fetch_state(host, port, timeout=60.0):
    """The latest commit of the ``StateServer`` at ``host``:``port``, as ``(step, bytes)``.

    Raises ``OSError`` (``ConnectionError`` when the server closes before the whole commit arrived, ``TimeoutError``
    when nothing arrives for ``timeout`` seconds)."""
    with socket.create_connection((host, port), timeout=timeout) as connection:
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
