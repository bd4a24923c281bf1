"""The launcher's watchdog: a process of its own that SIGKILLs every process group of the job when the
launcher dies without saying it is done, and the launcher's side of it (``Watchdog``)."""
import subprocess
import sys
import threading

__all__ = ["Watchdog"]

#: The watchdog: a process of its own that holds the read end of a pipe from the launcher. The launcher writes
#: ``+PGID`` for every process group it starts, ``-PGID`` once that group is gone, ``done`` when it ends
#: normally. If the pipe closes without ``done`` (the launcher was SIGKILLed, or crashed), the watchdog SIGKILLs
#: every group still listed: nothing of the job outlives its launcher.
_WATCHDOG_CODE = """
import os, signal, sys
groups = set()
for line in sys.stdin:
    word = line.strip()
    if word == "done":
        sys.exit(0)
    if word[:1] == "+":
        groups.add(int(word[1:]))
    elif word[:1] == "-":
        groups.discard(int(word[1:]))
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""


class Watchdog:
    """The launcher's side of the watchdog process (``_WATCHDOG_CODE``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.process = subprocess.Popen([sys.executable, "-c", _WATCHDOG_CODE], stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)   # Ctrl-C at the terminal does not reach it

    def _send(self, word):
        with self._lock:
            try:
                self.process.stdin.write(f"{word}\n".encode())
                self.process.stdin.flush()
            except (OSError, ValueError):   # it is gone: the launcher's own stop still works
                pass

    def watch(self, pgid):
        """The launcher started process group ``pgid``: kill it if the launcher dies."""
        self._send(f"+{pgid}")

    def forget(self, pgid):
        """Process group ``pgid`` is gone."""
        self._send(f"-{pgid}")

    def close(self):
        """The launcher ends normally: the watchdog exits without killing anything."""
        self._send("done")
        with self._lock:
            try:
                self.process.stdin.close()
            except OSError:
                pass
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
