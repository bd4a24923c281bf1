"""What Ctrl-C (SIGINT) and SIGTERM do to a training run, and how a run that is stuck still stops.

Python runs a signal handler only between bytecodes of the main thread. While the main thread waits inside
MXNet (``asnumpy``, ``waitall``) no handler runs, so a step that never finishes would make a process deaf to
every signal. Each context here therefore also hears the signals through ``signal.set_wakeup_fd``: the C-level
handler writes the signal's number to a pipe at once, and a thread reading that pipe can act while the main
thread is blocked.

- ``stop_between_batches``: during training. The first signal asks the loop to stop at the next batch boundary
  (``StopRequest``, polled by ``fit``), which writes the checkpoint; the second ends the process at once with
  status 130 and ``error: interrupted``, from the watching thread, whatever the main thread is doing (the
  temporary files of atomic writes in progress are removed first, so the last complete files stay).
- ``hold_interrupts``: around MXNet's import, a Ctrl-C is held and raised as ``KeyboardInterrupt`` afterwards.
- ``end_on_signals``: for a worker of a distributed job, SIGINT and SIGTERM end the process at once, leaving
  nothing it was writing behind.
"""
import contextlib
import os
import signal
import sys
import threading

from .files import remove_temporaries

__all__ = ["StopRequest", "stop_between_batches", "hold_interrupts", "end_on_signals", "INTERRUPTED_STATUS"]

#: The exit status of a process ended by a second signal (or Ctrl-C before training): 128 + SIGINT.
INTERRUPTED_STATUS = 128 + signal.SIGINT

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _in_main_thread():
    return threading.current_thread() is threading.main_thread()


class StopRequest:
    """Set by the first SIGINT or SIGTERM: ``request()`` is true from then on, ``signum`` says which."""

    def __init__(self):
        self.signum = None

    def __call__(self):
        return self.signum is not None


def _exit_at_once(signum=signal.SIGINT, say=True):
    """End the process now, from any thread, with status 128 + ``signum``: remove the temporaries of unfinished
    atomic writes, the lock files of the directory locks held and the directories made for the run that are still
    empty (``remove_temporaries``), say so on stderr if ``say``, and ``os._exit`` (no cleanup that could block, as
    the main thread may be stuck inside MXNet)."""
    remove_temporaries()
    if say:
        try:
            os.write(sys.stderr.fileno(), b"error: interrupted\n")
        except (OSError, ValueError):
            pass
    os._exit(128 + signum)


def _watch(read_fd, limit, say):
    """Count the stop signals written to ``read_fd``; end the process at the ``limit``-th one. Returns when
    the pipe's write end is closed."""
    seen = 0
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        stops = [byte for byte in data if byte in _STOP_SIGNALS]
        seen += len(stops)
        if seen >= limit:
            _exit_at_once(signal.SIGINT if say else stops[-1], say)


@contextlib.contextmanager
def _watched(limit, say=True):
    """While active, the ``limit``-th SIGINT/SIGTERM ends the process from a watching thread, even when the
    main thread is blocked in native code (with ``error: interrupted`` and status 130 if ``say``, else silently
    with 128 + the signal). The caller installs Python-level handlers for the signals."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch, args=(read_fd, limit, say), name="parallel-signal-watcher",
                               daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)     # the watcher reads the end of the pipe and returns
        watcher.join(5)
        os.close(read_fd)


@contextlib.contextmanager
def stop_between_batches():
    """During the block, a first SIGINT/SIGTERM sets the yielded ``StopRequest`` (the training loop stops at the
    next batch boundary and writes its checkpoint); a second one ends the process at once with status 130,
    even while the main thread waits inside MXNet for a step that never finishes."""
    request = StopRequest()
    if not _in_main_thread():   # only the main thread can install handlers
        yield request
        return

    def handler(signum, frame):
        if request.signum is None:
            request.signum = signum

    previous = {sig: signal.signal(sig, handler) for sig in _STOP_SIGNALS}
    try:
        with _watched(limit=2):
            yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def hold_interrupts():
    """Hold Ctrl-C until the block is done, then raise ``KeyboardInterrupt`` if it was pressed; a second Ctrl-C
    (or SIGTERM) during the block ends the process at once.

    For MXNet's import (about a second): a ``KeyboardInterrupt`` raised inside it, even when caught, can
    leave CPython marked as killed by an unhandled interrupt, so that it ends by SIGINT (status -2) after
    printing our one line (seen here in about half the runs interrupted 0.2-0.9 s after start).
    """
    if not _in_main_thread():
        yield
        return
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


@contextlib.contextmanager
def end_on_signals():
    """For a worker of a distributed job: during the block, SIGINT and SIGTERM end the process at once, with
    status 128 + the signal and no line (the launcher says why the job stopped), from the watching thread while
    the main thread waits inside ps-lite, where no Python handler can run. A stop at the next batch boundary would
    only hold up the launcher's grace period; the job resumes from its last checkpoint instead. What the run was
    writing goes first (``remove_temporaries``): no temporary file, no lock file in ``--checkpoint-dir``, and no
    directory made for a run that wrote nothing there."""
    if not _in_main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: _exit_at_once(signum, say=False))
                for sig in _STOP_SIGNALS}
    try:
        with _watched(limit=1, say=False):
            yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
