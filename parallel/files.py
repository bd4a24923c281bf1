"""Atomic file output: write to a temporary file beside the target, then rename over it.

An interrupted run never leaves a half-written file; the previous version stays until the rename.
"""
import contextlib
import errno
import os
import secrets
import stat
import tempfile

__all__ = ["atomic_write", "atomic_path", "fsync_directory", "check_writable"]

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
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary file name after %d attempts" % _TEMP_ATTEMPTS,
                          os.path.join(directory, prefix + "*.tmp"))


@contextlib.contextmanager
def atomic_write(path, mode="w"):
    """Open a temporary file next to ``path`` for writing; rename it to ``path`` on success.

    The temporary file ``.<basename>.<random>.tmp`` is created in the same directory, so the final
    ``os.replace`` is atomic; it is flushed and fsynced before the rename. A new file gets the
    permissions ``open()`` would give it (0o666 less the umask, applied by the kernel); a file that
    is replaced keeps its permission bits.

    Parameters
    ----------
    path : str or os.PathLike
    mode : str
        ``"w"`` (text) or ``"wb"`` (binary).

    Yields
    ------
    file object
        On an exception inside the block the temporary file is removed and ``path`` is untouched.
    """
    path = os.fspath(path)
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
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path beside ``path`` for a writer that takes a file name (``mx.nd.save``, ``savefig``);
    afterwards fsync it and rename it to ``path``, as ``atomic_write`` does.

    On an exception inside the block the temporary file is removed and ``path`` is untouched.

    >>> import os, tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     with atomic_path(os.path.join(d, "a.txt")) as tmp:
    ...         _ = open(tmp, "w").write("hello")
    ...     print(os.listdir(d), open(os.path.join(d, "a.txt")).read())
    ['a.txt'] hello
    """
    path = os.fspath(path)
    fd, tmp = _create_temp(path)
    os.close(fd)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)   # what the writer wrote is on disk before the rename makes it visible
        finally:
            os.close(fd)
        _commit(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _commit(tmp, path):
    """Give ``tmp`` the mode of the file it replaces, rename it to ``path``, and fsync the directory so that
    the rename itself survives a crash."""
    try:
        os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))   # a replaced file keeps its mode
    except FileNotFoundError:
        pass   # a new file: the kernel already applied the umask to 0o666 at creation
    os.replace(tmp, path)
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
    """Raise ``ValueError`` unless a file can be created at ``path`` (checked before long work starts)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"cannot write {what} {path!r}: it is a directory; give a file name")
    if not os.path.isdir(directory):
        raise ValueError(f"cannot write {what} {path!r}: directory {directory!r} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".write-check.")
    except OSError as e:
        raise ValueError(f"cannot write {what} {path!r}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(tmp)
