"""Files a run writes: atomic writes (a temporary file beside the target, then a rename over it), the checks
made before long work starts, and the lock that keeps two runs out of one directory.

An interrupted run never leaves a half-written file; the previous version stays until the rename. A path that
is a symbolic link is written through, to the file it points to (the link stays a link); a path that is not a
regular file (a device such as ``/dev/full``, a FIFO, a socket, ``/dev/stdout``) is refused, since replacing
it would destroy it and writing it in place would not be atomic.
"""
import atexit
import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import stat
import sys
import tempfile

__all__ = ["atomic_write", "fsync_directory", "check_writable", "output_target", "remove_temporaries",
           "remove_if_empty_at_exit", "scratch_file", "DirectoryLock", "DirectoryLocked", "LOCK_FILE", "MANIFEST",
           "export_files"]


def export_files(prefix):
    """The files ``--export PREFIX`` (``parallel.export``) writes, (symbol, params), or (None, None) for None.

    >>> export_files("out/lenet")
    ('out/lenet-symbol.json', 'out/lenet-0000.params')
    """
    return (None, None) if prefix is None else (f"{prefix}-symbol.json", f"{prefix}-0000.params")

#: Temporary files being written now (``atomic_write``) and the lock files of the directory
#: locks held now: what ``remove_temporaries`` removes when the process must end at once.
_PENDING = set()

#: Scratch files of this process (``scratch_file``): removed at its exit, a normal one or ``os._exit``'s.
_SCRATCH = set()

#: Directories made for this run (``remove_if_empty_at_exit``): removed by ``remove_temporaries`` if they are empty.
_MADE = set()

_KINDS = {stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device", stat.S_ISFIFO: "a FIFO (named pipe)",
          stat.S_ISSOCK: "a socket", stat.S_ISDIR: "a directory"}


def _kind(mode):
    return next((kind for test, kind in _KINDS.items() if test(mode)), "not a regular file")


def output_target(path):
    """The file a write to ``path`` replaces: ``path`` itself, or the file its symbolic links lead to.

    Raises
    ------
    ValueError
        When ``path`` exists but is not a regular file (a directory, a device, a FIFO, a socket).

    >>> output_target("/dev/null")
    Traceback (most recent call last):
        ...
    ValueError: '/dev/null' is a character device, not a regular file; give the path of a file to write
    """
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode   # follows symbolic links, as the kernel does
    except FileNotFoundError:
        return os.path.realpath(path)  # a new file, or the missing target of a dangling link
    except OSError as e:
        raise ValueError(f"{path!r} cannot be examined ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path!r} is {_kind(mode)}, not a regular file; give the path of a file to write")
    return os.path.realpath(path)


def remove_temporaries():
    """Remove the temporary files of the atomic writes in progress, the lock files of the directory locks held,
    and the directories made for the run that are still empty: for a process that must end at once
    (``os._exit``), so that nothing it was writing is left behind. Their targets are untouched."""
    for pending in (_PENDING, _SCRATCH):
        for tmp in list(pending):
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            pending.discard(tmp)
    for directory in list(_MADE):
        with contextlib.suppress(OSError):
            os.rmdir(directory)   # fails, as it should, on a directory that holds anything
        _MADE.discard(directory)


def remove_if_empty_at_exit(directory):
    """Have ``remove_temporaries`` remove ``directory``, made for this run, if it is still empty then: a run that
    ends at once before writing anything there leaves no empty directory."""
    _MADE.add(os.path.abspath(directory))


def scratch_file(prefix, suffix=""):
    """A new empty file in the temporary directory, for this process alone: removed when the process ends,
    normally (``atexit``) or at once (``remove_temporaries`` before ``os._exit``). Its path is returned."""
    handle, path = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(handle)
    if not _SCRATCH:
        atexit.register(remove_temporaries)
    _SCRATCH.add(path)
    return path

#: How many random temporary names ``atomic_write`` tries before giving up (a clash is already
#: vanishingly unlikely with 64 random bits; the bound only stops an endless loop).
_TEMP_ATTEMPTS = 100


def _create_temp(path):
    """Create a new empty file beside ``path`` named ``.<basename>.<random hex>.tmp``; return (fd, name).

    The file is created with mode 0o666 and the kernel applies the process umask itself, so it gets
    the same permissions ``open(path, "w")`` would give a new file, without reading the umask.
    """
    directory = os.path.dirname(os.path.abspath(path))
    prefix = "." + os.path.basename(path) + "."
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(_TEMP_ATTEMPTS):
        tmp = os.path.join(directory, prefix + secrets.token_hex(8) + ".tmp")
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
        _PENDING.add(tmp)
        return fd, tmp
    raise FileExistsError(errno.EEXIST, "no unused temporary file name after %d attempts" % _TEMP_ATTEMPTS,
                          os.path.join(directory, prefix + "*.tmp"))


@contextlib.contextmanager
def atomic_write(path, mode="w"):
    """Open a temporary file next to ``path`` for writing; rename it to ``path`` on success.

    The temporary file ``.<basename>.<random>.tmp`` is created in the same directory, so the final
    ``os.replace`` is atomic; it is flushed and fsynced before the rename. A new file gets the
    permissions ``open()`` would give it (0o666 less the umask, applied by the kernel); a file that
    is replaced keeps its permission bits. A symbolic link is written through: the file it leads to is
    replaced, and the link stays.

    Parameters
    ----------
    path : str or os.PathLike
    mode : str
        ``"w"`` (text) or ``"wb"`` (binary).

    Yields
    ------
    file object
        On an exception inside the block the temporary file is removed and ``path`` is untouched.

    Raises
    ------
    ValueError
        When ``path`` is not a regular file (``output_target``), before anything is written.
    """
    path = output_target(path)
    fd, tmp = _create_temp(path)
    try:
        try:
            f = os.fdopen(fd, mode)
        except BaseException:
            os.close(fd)   # e.g. a bad mode: fdopen did not take the descriptor
            raise
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _commit(tmp, path)
    except BaseException:
        _discard(tmp)
        raise


def _discard(tmp):
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    _PENDING.discard(tmp)


def _commit(tmp, path):
    """Give ``tmp`` the mode of the file it replaces, rename it to ``path``, and fsync the directory so that
    the rename itself survives a crash."""
    try:
        os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))   # a replaced file keeps its mode
    except FileNotFoundError:
        pass   # a new file: the kernel already applied the umask to 0o666 at creation
    os.replace(tmp, path)
    _PENDING.discard(tmp)
    fsync_directory(os.path.dirname(os.path.abspath(path)))


def fsync_directory(directory):
    """Flush a directory's entries (renames, removals) to disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass   # some file systems do not fsync directories
    finally:
        os.close(fd)


def check_writable(path, what="output"):
    """Raise ``ValueError`` unless ``atomic_write`` can write ``path`` (checked before long work starts):
    its directory exists and takes new files, and ``path`` is a regular file or does not exist yet.

    ``what`` names the output in the message (``"metrics_json"``).
    """
    path = os.fspath(path)
    if path == "":
        raise ValueError(f"{what} needs a file name, got an empty string")
    try:
        target = output_target(path)
    except ValueError as e:
        raise ValueError(f"cannot write {what}: {e}") from None
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise ValueError(f"cannot write {what} {path!r}: directory {directory!r} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".write-check.")
    except OSError as e:
        raise ValueError(f"cannot write {what} {path!r}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(tmp)


#: The lock file a run keeps in the directory it owns (its checkpoint directory).
LOCK_FILE = ".lock"

#: The file that makes a checkpoint exist (``parallel.checkpoint``): written last, it names the parameter file.
MANIFEST = "checkpoint.json"


class DirectoryLocked(RuntimeError):
    """Another process holds the directory's lock; ``holder`` says who (pid, host, command), as it wrote."""

    def __init__(self, directory, holder):
        who = (f"process {holder.get('pid')} on {holder.get('host')} ({holder.get('command')})"
               if holder else "another process")
        super().__init__(f"{directory} is in use by {who}; wait for that run to end, or use another directory")
        self.directory, self.holder = directory, holder


class DirectoryLock:
    """An advisory lock on a directory for the life of a run (``flock`` on ``DIR/.lock``).

    The lock file records who holds it (pid, host, command line), so that a second run is refused with a
    message that names the holder; it is removed when the lock is released. The operating system drops the
    lock when the holding process ends, however it ends (even ``SIGKILL``): a lock file left by a killed run
    never blocks a later one. ``flock`` locks may not reach across machines on some network file systems.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     with DirectoryLock(d):
    ...         try:
    ...             DirectoryLock(d).acquire()
    ...         except DirectoryLocked as e:
    ...             print("refused:", e.holder["pid"] == os.getpid())
    refused: True
    """

    def __init__(self, directory, job=None, restart=0):
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, LOCK_FILE)
        self.job, self.restart = job, restart
        self._fd = None

    def acquire(self):
        """Take the lock, or raise ``DirectoryLocked`` at once (never waits). Returns ``self``.

        A process of a launched job (``job``: its token, ``restart``: which start) takes the lock over from a
        process of an earlier start of the same job: the launcher gave that start up (its host lost or cut off),
        so its processes, if alive, cannot reach the job any more. The lock file is replaced; the old holder
        finds it gone (``held``) and writes nothing more."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                if self._earlier_start(holder) and _same_file(fd, self.path):
                    os.unlink(self.path)   # its flock stays on the unlinked file, ours goes on a new one
                    os.close(fd)
                    continue
                os.close(fd)
                raise DirectoryLocked(self.directory, holder) from None
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                break
            os.close(fd)   # the holder removed the file as we opened it: lock the one that is there now
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv), "job": self.job,
                  "restart": self.restart}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd
        _PENDING.add(self.path)
        return self

    def _earlier_start(self, holder):
        """Whether ``holder`` (what a lock file says) is a process of an earlier start of this process's job."""
        return (self.job is not None and isinstance(holder, dict) and holder.get("job") == self.job
                and isinstance(holder.get("restart"), int) and holder["restart"] < self.restart)

    def held(self):
        """Whether this lock is still the directory's: False once released, or taken over by a later start of
        the job (``acquire``)."""
        return self._fd is not None and _same_file(self._fd, self.path)

    def release(self):
        """Let go of the lock and remove the lock file (first, while still holding it: a process that opened
        it meanwhile sees that it is gone once it gets the lock, and tries again); a lock file that a later
        start took over is left to it."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            if _same_file(fd, self.path):
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            _PENDING.discard(self.path)
            os.close(fd)   # closing the descriptor drops the flock

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _same_file(fd, path):
    """Whether the open ``fd`` is still the file at ``path``."""
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _read_holder(fd):
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
