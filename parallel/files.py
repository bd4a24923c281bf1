"""Atomic file output: write to a temporary file beside the target, then rename over it.

An interrupted run never leaves a half-written file; the previous version stays until the rename.
"""
import contextlib
import os
import tempfile

__all__ = ["atomic_write", "check_writable"]


@contextlib.contextmanager
def atomic_write(path, mode="w"):
    """Open a temporary file next to ``path`` for writing; rename it to ``path`` on success.

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
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for(path))   # mkstemp makes 0600 files; give the file the mode open() would
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _mode_for(path):
    """The existing file's permission bits, or those a new file gets from open(): 0o666 less the umask."""
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


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
