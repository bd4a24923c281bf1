"""The launcher's restart policy (``--max-restarts``), a pure function: given what ended one start of the job,
start it again or stop, and with which exit status and line. No processes, no I/O.

A start of the job ends in one of these ways, its ``Ending.kind``:

- ``SUCCESS``: every worker exited with 0;
- ``PROCESS_FAILED``: a process of the job exited with a non-zero status or died from a signal (``returncode``
  as ``subprocess`` gives it: -9 for SIGKILL);
- ``NOT_STARTED``: a process could not be started (its command does not exist, ...);
- ``START_TIMEOUT``, ``STALL_TIMEOUT``: ``--start-timeout`` or ``--stall-timeout`` ran out;
- ``INTERRUPTED``: the launcher itself got SIGINT or SIGTERM (``signum``);
- ``TOO_FEW_HOSTS``: with ``-n MIN:MAX``, fewer than MIN hosts were available within ``--start-timeout``;
- ``BAD_DISCOVERY``: the ``--host-discovery-script`` printed a bad line, or another host with ``--launcher local``;
- ``HOSTS_CHANGED``: in an elastic job, the ``--host-discovery-script`` lists other hosts than the start's (a host
  joined, within ``-n MIN:MAX``, or one of the start's left). Always started again, on the hosts listed then, and
  not counted as a restart: a change is the job working as asked.
- ``DIVERGED``: the workers' flight records prove they disagree (``parallel.flight.diagnose``): one waits in a
  collective another will never issue. Not restarted: the same program on the same data diverges again.

``decide`` restarts a process that failed (unless it exited with ``USAGE_STATUS``, 2: its input cannot work and
would fail the same way again) and the two timeouts, while fewer than ``--max-restarts`` restarts were made and
the launcher itself was not interrupted; anything else stops the launcher with 0 (success), 128 + the signal's
number (interrupted: 130 for SIGINT, 143 for SIGTERM), ``USAGE_STATUS`` (2) for a bad discovery (the user's
script or flags cannot work: a bad line, another host with ``--launcher local``) or 1, and the ``error:`` line.
The launcher's loop (``parallel.launch.cli.main``) calls it after every start and does what it says.
"""
import time
from typing import NamedTuple, Optional

from ..cli import USAGE_STATUS

__all__ = ["SUCCESS", "PROCESS_FAILED", "NOT_STARTED", "START_TIMEOUT", "STALL_TIMEOUT", "INTERRUPTED",
           "TOO_FEW_HOSTS", "BAD_DISCOVERY", "DIVERGED", "HOSTS_CHANGED", "KINDS", "Ending", "Failure", "Decision",
           "decide", "Cooldowns"]

SUCCESS = "success"
PROCESS_FAILED = "process failed"
NOT_STARTED = "not started"
START_TIMEOUT = "start timeout"
STALL_TIMEOUT = "stall timeout"
INTERRUPTED = "interrupted"
TOO_FEW_HOSTS = "too few hosts"
BAD_DISCOVERY = "bad discovery"
DIVERGED = "diverged"
HOSTS_CHANGED = "hosts changed"
#: Every way a start of the job can end.
KINDS = (SUCCESS, PROCESS_FAILED, NOT_STARTED, START_TIMEOUT, STALL_TIMEOUT, INTERRUPTED, TOO_FEW_HOSTS,
         BAD_DISCOVERY, DIVERGED, HOSTS_CHANGED)


class Ending(NamedTuple):
    """What ended one start of the job.

    Attributes
    ----------
    kind : str
        One of ``KINDS``.
    message : str
        What happened, as the launcher prints it (``worker 1 (pid N) was killed by SIGKILL; ...``); empty for
        ``SUCCESS``.
    returncode : int or None
        ``PROCESS_FAILED``: the process's exit status, or minus the signal that killed it.
    signum : int or None
        ``INTERRUPTED``: the signal the launcher got.
    host : str or None
        ``PROCESS_FAILED``: the host the failed process ran on over ssh (None on this machine).
    """
    kind: str
    message: str = ""
    returncode: Optional[int] = None
    signum: Optional[int] = None
    host: Optional[str] = None


class Failure(Exception):
    """Raised where a start of the job ends badly; ``ending`` says how, and the message is the ending's."""

    def __init__(self, kind, message, returncode=None, signum=None, host=None):
        super().__init__(message)
        self.ending = Ending(kind, message, returncode, signum, host)


class Decision(NamedTuple):
    """What the launcher does once a start of the job has ended (``decide``).

    Attributes
    ----------
    restart : bool
        Start the job again.
    status : int or None
        When stopping, the launcher's exit status; None when restarting.
    line : str or None
        When stopping, the ``error: ...`` line the launcher prints last (None after a success). When restarting,
        ``restart r of R: <what ended the start>``, which ``restart_line`` completes once the next start's
        number of workers is known.
    """
    restart: bool
    status: Optional[int]
    line: Optional[str]

    def restart_line(self, num_workers):
        """The line that announces a restart of ``num_workers`` workers."""
        return f"{self.line}; starting {num_workers} worker(s) again"


def _restartable(ending):
    """Whether a start that ended so may be tried again: a failed process (but for exit status 2, bad input)
    and the two timeouts."""
    if ending.kind == PROCESS_FAILED:
        return ending.returncode != USAGE_STATUS
    return ending.kind in (START_TIMEOUT, STALL_TIMEOUT)


def decide(ending, restarts, max_restarts, interrupted=False, changes=0, reset_limit=None):
    """Restart the job, or stop the launcher (with which status and line), after a start of it ended.

    Parameters
    ----------
    ending : Ending
        What ended the start.
    restarts : int
        How many restarts were made before this start (0 for the first start).
    max_restarts : int
        ``--max-restarts``.
    interrupted : bool
        Whether the launcher got SIGINT or SIGTERM (which ends the job whatever ended this start).
    changes : int
        How many times the job's hosts changed before this start (``HOSTS_CHANGED`` endings).
    reset_limit : int or None
        ``--reset-limit``: after that many changes of hosts a further one ends the job (None: no limit).

    Returns
    -------
    Decision

    Examples
    --------
    >>> failed = Ending(PROCESS_FAILED, "worker 1 (pid 7) was killed by SIGKILL; it printed nothing", -9)
    >>> decide(failed, 0, 3).restart_line(2)
    'restart 1 of 3: worker 1 (pid 7) was killed by SIGKILL; it printed nothing; starting 2 worker(s) again'
    >>> decide(failed, 3, 3)
    Decision(restart=False, status=1, line='error: worker 1 (pid 7) was killed by SIGKILL; it printed nothing')
    >>> decide(Ending(PROCESS_FAILED, "worker 0 (pid 8) exited with status 2; its last output: error: --lr ...", 2),
    ...        0, 3).status   # a worker that refused its input: the launcher's status says so too
    2
    >>> decide(Ending(HOSTS_CHANGED, "the hosts changed: 10.0.0.3 joined"), 0, 0).restart_line(3)
    'the hosts changed: 10.0.0.3 joined; starting 3 worker(s) again'
    >>> decide(Ending(HOSTS_CHANGED, "the hosts changed: 10.0.0.3 left"), 0, 0, changes=2, reset_limit=2).line
    'error: the hosts changed: 10.0.0.3 left; the job has changed hosts 2 times, --reset-limit 2'
    """
    if ending.kind not in KINDS:
        raise ValueError(f"ending.kind must be one of {', '.join(KINDS)}, got {ending.kind!r}")
    if ending.kind == SUCCESS:
        return Decision(False, 0, None)
    if ending.kind == HOSTS_CHANGED and not interrupted:
        if reset_limit is not None and changes >= reset_limit:
            times = "1 time" if changes == 1 else f"{changes} times"
            return Decision(False, 1, f"error: {ending.message}; the job has changed hosts {times}, "
                                      f"--reset-limit {reset_limit}")
        return Decision(True, None, ending.message)
    if _restartable(ending) and restarts < max_restarts and not interrupted:
        return Decision(True, None, f"restart {restarts + 1} of {max_restarts}: {ending.message}")
    refused = ending.kind == PROCESS_FAILED and ending.returncode == USAGE_STATUS   # bad input, not a crash
    status = (128 + ending.signum if ending.kind == INTERRUPTED
              else USAGE_STATUS if ending.kind == BAD_DISCOVERY or refused else 1)
    return Decision(False, status, f"error: {ending.message}")


class Cooldowns:
    """Hosts left out of the job after failing (Horovod's blacklist with a cooldown): a host whose process failed
    ``strikes`` times is left out for ``seconds``, twice as long each time it is left out again, then given back.

    Pure: time comes from ``clock``.

    >>> now = [0.0]
    >>> cooldowns = Cooldowns(60, clock=lambda: now[0])
    >>> cooldowns.failed("h2") is None   # a first failure: the host stays
    True
    >>> cooldowns.failed("h2")
    'host h2 failed 2 times: left out of the job for 60 s (--host-cooldown)'
    >>> cooldowns.usable([("h1", None), ("h2", 22)]), cooldowns.left_out()
    ([('h1', None)], ['h2'])
    >>> now[0] = 61.0
    >>> cooldowns.usable([("h1", None), ("h2", 22)])
    [('h1', None), ('h2', 22)]
    >>> cooldowns.failed("h2")   # left out again: twice as long
    'host h2 failed 3 times: left out of the job for 120 s (--host-cooldown)'
    """

    def __init__(self, seconds, strikes=2, clock=time.monotonic):
        self.seconds, self.strikes, self.clock = seconds, strikes, clock
        self.failures, self.times_left_out, self.until = {}, {}, {}

    def failed(self, host):
        """Count a failure of a process on ``host`` (None: this machine, never left out); the line that says the
        host is left out now, or None."""
        if host is None or not self.seconds:
            return None
        self.failures[host] = self.failures.get(host, 0) + 1
        if self.failures[host] < self.strikes:
            return None
        times = self.times_left_out.get(host, 0)
        self.times_left_out[host] = times + 1
        seconds = self.seconds * 2 ** times
        self.until[host] = self.clock() + seconds
        return (f"host {host} failed {self.failures[host]} times: left out of the job for {seconds:g} s "
                "(--host-cooldown)")

    def left_out(self):
        """The hosts left out now."""
        now = self.clock()
        return sorted(host for host, until in self.until.items() if until > now)

    def usable(self, slots):
        """Of ``slots`` (``(host, ssh port)`` pairs), those whose host is not left out now."""
        out = set(self.left_out())
        return [slot for slot in slots if slot[0] not in out]
