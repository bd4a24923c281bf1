"""One start of the launcher's job: its plan (workers, hosts, port), its processes started and supervised (each
line they print forwarded with its process's name; a failed process, workers whose flight records disagree, the
start and stall timeouts, SIGINT or SIGTERM to the launcher end it), and stopping them. How a start ended is raised
as a ``restarts.Failure``."""
import argparse
import collections
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

from ..flight import INTERVAL, STILL, diagnose, format_records, parse_line, positions
from ..cli import UsageError
from ..handover import fetch_state, parse_announcement
from .hosts import available_slots, free_port, listed_slots, parse_hostfile
from .processes import (GROUP_GONE_SECONDS, P3_BELOW_MBIT, default_servers, hosts_to_probe, is_terminal,
                        kill_group, link_probe_argv, p3_suits, plan_processes, probe_link, user_wants_ps_log,
                        wait_group_gone)
from .restarts import (DIVERGED, HOSTS_CHANGED, INTERRUPTED, NOT_STARTED, PROCESS_FAILED, STALL_TIMEOUT,
                       START_TIMEOUT, SUCCESS, TOO_FEW_HOSTS, Ending, Failure)

__all__ = ["START_LINE", "Job", "Signals", "plan_start", "write_line", "describe_status", "is_ps_chatter"]

#: What ps-lite's scheduler logs (on stderr, with ``PS_VERBOSE`` >= 1) once every node has registered:
#: ``... van.cc:97: the scheduler is connected to 2 workers and 1 servers``.
START_LINE = re.compile(r"the scheduler is connected to (\d+) workers and (\d+) servers")

# With PS_VERBOSE=2 the scheduler also logs each registration it receives, which tells who is missing:
# "... van.cc:419: ? => 1. Meta: request=0, timestamp=0, control={ cmd=ADD_NODE, node={ role=worker, ip=..., port=..."
_REGISTRATION = re.compile(r"=> 1\. Meta: .*cmd=ADD_NODE, node=\{ role=(\w+), ip=([^,]+), port=(\d+)")
# The rest of its PS_VERBOSE=2 log (binding, ranks, barriers, messages, stopping): hidden unless the user set
# PS_VERBOSE, since the launcher sets it only to watch the start. ps-lite's threads write their log lines piece by
# piece, so two lines can come mixed ("[[02:08:30] 02:08:30../3rdparty/ps-lite/src/van.cc] ..."): a message is
# known by its words wherever they are in the scheduler's line, and a line left with nothing but pieces of log
# headers (times, ps-lite's file names) is chatter too.
_PS_CHATTER = re.compile(r"Bind to |assign rank=|Barrier count |\S+ => \S+\. Meta: |H\[\d+\] is stopp")
_PS_HEADER_PIECES = re.compile(r"\d\d:\d\d:\d\d|(\.\./)?(3rdparty/)?ps-lite/src/[\w./]+(:\d+)?:?|[\[\]\s]")
# ssh's own note when a -tt session ends.
_SSH_CLOSED = re.compile(r"^Connection to \S+ closed\.$")
# ssh's line when a host stopped answering its keepalives (ServerAliveInterval x ServerAliveCountMax).
_SSH_TIMEOUT = re.compile(r"^Timeout, server (\S+) not responding\.$")

_TAIL_LINES = 20
_READER_JOIN_SECONDS = 2.0
# Once the records prove a divergence, how long the launcher waits for every waiting worker's Python stack (a
# worker publishes it after STILL seconds without a new collective).
_STACK_WAIT_SECONDS = STILL + 2.0
# When a process fails, how long the launcher waits for the workers' latest records (published every INTERVAL).
_FAILURE_RECORD_SECONDS = 5 * INTERVAL
# How long taking an elastic job's state from a live worker may wait for a byte before trying the next worker.
_FETCH_SECONDS = 15.0


def _read_hostfile(path):
    """The hostfile's hosts now (``(host, ssh port)`` pairs), or None while it cannot be read or parsed (a file
    being rewritten): nothing is known then."""
    try:
        return parse_hostfile(path)
    except UsageError:
        return None


def _difference(hosts, others):
    """The names of ``hosts`` (``(host, ssh port)`` pairs) not in ``others``, counted as a multiset."""
    left = collections.Counter(others)
    names = []
    for host, port in hosts:
        if left[host, port]:
            left[host, port] -= 1
        else:
            names.append(host if port is None else f"{host}:{port}")
    return names


def _host_not_responding(child):
    """The host an ssh child gave up on (OpenSSH's ``Timeout, server HOST not responding.``, status 255), or None."""
    if child.spec.host is None or child.returncode != 255:
        return None
    for line in reversed(child.tail):
        found = _SSH_TIMEOUT.match(line.strip())
        if found:
            return found.group(1)
    return None


def is_ps_chatter(line):
    """Whether a line of the scheduler's ``PS_VERBOSE=2`` log is routine chatter, whole or mixed with another.

    >>> is_ps_chatter("[02:08:30] ../3rdparty/ps-lite/src/van.cc:455: Barrier count for 7 : 1")
    True
    >>> is_ps_chatter("[[02:08:30] 02:08:30../3rdparty/ps-lite/src/van.cc] ../3rdparty/ps-lite/src/van.cc:455: ")
    True
    >>> is_ps_chatter("[02:08:30] ../3rdparty/ps-lite/src/van.cc:136: Check failed: node.id != Node::kEmpty")
    False
    """
    return bool(_PS_CHATTER.search(line)) or (bool(line.strip()) and not _PS_HEADER_PIECES.sub("", line))


def describe_status(returncode, over_ssh=False):
    """``exited with status 3`` or ``was killed by SIGKILL``; ``over_ssh``: the status is ssh's, whose 255 stands
    for a remote process killed by a signal as well as for ssh's own failure.

    >>> describe_status(3), describe_status(-9)
    ('exited with status 3', 'was killed by SIGKILL')
    >>> describe_status(255, over_ssh=True)
    'exited with status 255 (ssh: killed by a signal there, or ssh failed)'
    """
    if returncode == 255 and over_ssh:
        return "exited with status 255 (ssh: killed by a signal there, or ssh failed)"
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


class _Child:
    """A started process: the thread that reaps it, the threads that forward its output, its last lines."""

    def __init__(self, spec, job):
        self.spec, self.job = spec, job
        self.tail = collections.deque(maxlen=_TAIL_LINES)
        self.done = threading.Event()
        self.returncode = None
        self.state_port = None   # an elastic job's worker: where it serves its commits (parallel.handover)
        self.rank = None   # a worker's rank, once it said it ("joined the job as rank R of W")
        self.label = spec.name   # what its lines are prefixed with: its rank once known
        env = None if spec.host is not None else dict(os.environ, **spec.env)
        self.process = subprocess.Popen(spec.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True)
        self.pid = self.process.pid
        job.watchdog.watch(self.pid)
        self.readers = [threading.Thread(target=self._forward, args=(pipe, out), daemon=True)
                        for pipe, out in ((self.process.stdout, "stdout"), (self.process.stderr, "stderr"))]
        for reader in self.readers:
            reader.start()
        threading.Thread(target=self._reap, daemon=True).start()

    def describe(self):
        where = f", ssh to {self.spec.host}" if self.spec.host is not None else ""
        if self.rank is not None:
            return f"rank {self.rank} ({self.spec.name}, pid {self.pid}{where})"
        return f"{self.spec.name} (pid {self.pid}{where})"

    def _forward(self, pipe, out):
        is_scheduler = self.spec.role == "scheduler"
        for raw, refresh in segments(pipe):
            line = raw.decode("utf-8", "replace")
            if refresh:   # a progress bar redrawn in place: the terminal's one display, else dropped
                write_progress(out, f"[{self.label}] {line}", source=self)
                continue
            if is_scheduler and self.job.watch_line(line):
                continue
            if self.spec.host is not None and _SSH_CLOSED.match(line):
                continue
            if self.spec.role == "worker":
                port = parse_announcement(line)
                if port is not None:
                    self.state_port = port
                    continue
                line, snapshot = parse_line(line)
                if snapshot is not None:
                    self.job.note_flight(self, snapshot)
                    if not line:
                        continue
                self.job.last_worker_line = time.monotonic()
            self.tail.append(line)
            self.job.write(out, f"[{self.label}] {line}", source=self)
            if self.spec.role == "worker" and self.rank is None:
                joined = _JOINED.match(line)
                if joined:   # from now on its lines carry its rank, as its files' names do
                    self.rank = int(joined.group(1))
                    self.label = f"rank {self.rank}"
        pipe.close()

    def _reap(self):
        self.returncode = self.process.wait()
        kill_group(self.pid, signal.SIGKILL)   # anything it left in its group (the group id is still reserved)
        wait_group_gone(self.pid)
        self.job.watchdog.forget(self.pid)
        for reader in self.readers:
            reader.join(_READER_JOIN_SECONDS)
        self.done.set()
        self.job.exits.put(self)


_WRITE_LOCK = threading.Lock()

#: The progress bar drawn on a terminal now: its stream, text and source, or None (``write_progress``).
_PROGRESS = [None]

#: The line ``python -m parallel.train`` prints once it knows its rank.
_JOINED = re.compile(r"joined the job as rank (\d+) of \d+")


def _stream(out):
    return sys.stdout if out == "stdout" else sys.stderr


def write_line(out, line, source=None):
    """One line to stdout or stderr (``out``), whole (the reader threads write at once). A progress bar drawn on
    the terminal (``write_progress``) is cleared first: a line from the bar's own ``source`` and stream (its last
    state, the bar done) takes its place; any other line goes above it, and the bar is drawn again below."""
    with _WRITE_LOCK:
        stream = _stream(out)
        try:
            drawn = _PROGRESS[0]
            if drawn is not None:
                drawn[0].write("\r\x1b[K")
                drawn[0].flush()
                if (drawn[0], drawn[2]) == (stream, source) and source is not None:
                    drawn = _PROGRESS[0] = None
            stream.write(line + "\n")
            stream.flush()
            if drawn is not None:
                drawn[0].write(drawn[1])
                drawn[0].flush()
        except (OSError, ValueError):   # our output is gone (a closed pipe): keep draining the children
            pass


def write_progress(out, text, source=None):
    """Draw ``text``, a progress bar's state from ``source``, in place on ``out``'s line when it is a terminal:
    one display for the job, the latest bar replacing the one before. On anything else a bar's intermediate
    states are dropped (its last state arrives as a line)."""
    with _WRITE_LOCK:
        stream = _stream(out)
        if not is_terminal(stream):
            return
        try:
            stream.write("\r" + text + "\x1b[K")
            stream.flush()
            _PROGRESS[0] = (stream, "\r" + text + "\x1b[K", source)
        except (OSError, ValueError):
            pass


def end_progress():
    """Clear the progress bar drawn on the terminal, if any, and forget it: the job that drew it has ended."""
    with _WRITE_LOCK:
        drawn, _PROGRESS[0] = _PROGRESS[0], None
        if drawn is not None:
            with contextlib.suppress(OSError, ValueError):
                drawn[0].write("\r\x1b[K")
                drawn[0].flush()


def segments(pipe, size=65536):
    r"""The output of ``pipe`` (a binary file), as ``(bytes, refresh)`` pairs: each line without its end (``\n``,
    or ssh's ``\r\n``), and with ``refresh`` True, each text a lone ``\r`` ends, which a terminal would draw over
    (a progress bar's state). Empty refreshes are skipped; what is left when the pipe ends is a line.

    >>> read, write = os.pipe()
    >>> os.write(write, b"a\r\n\r 10%\r 20%\r 30%\nb"), os.close(write)
    (20, None)
    >>> list(segments(os.fdopen(read, "rb"), size=3))
    [(b'a', False), (b' 10%', True), (b' 20%', True), (b' 30%', False), (b'b', False)]
    """
    fd = pipe.fileno()   # read as it comes, not a buffer's worth
    pending = b""
    while True:
        chunk = os.read(fd, size)
        if not chunk:
            break
        pending += chunk
        start = 0
        while True:
            cut = min((i for i in (pending.find(b"\n", start), pending.find(b"\r", start)) if i >= 0), default=-1)
            if cut < 0:
                break
            if pending[cut:cut + 1] == b"\r":
                if cut + 1 == len(pending):   # a \r\n split across reads: wait for the next byte
                    break
                if pending[cut + 1:cut + 2] == b"\n":
                    yield pending[start:cut], False
                    start = cut + 2
                    continue
                if cut > start:
                    yield pending[start:cut], True
                start = cut + 1
                continue
            yield pending[start:cut], False
            start = cut + 1
        pending = pending[start:]
    pending = pending.rstrip(b"\r")
    if pending:
        yield pending, False


class Job:
    """The processes of one start of the job and the watch over them (``run``)."""

    def __init__(self, args, signals, watchdog):
        self.args, self.signals, self.watchdog = args, signals, watchdog
        self.children = []
        self.exits = queue.SimpleQueue()
        self.connected = threading.Event()
        self.registered = {"worker": set(), "server": set()}
        self.last_worker_line = time.monotonic()
        self.quiet_scheduler = not user_wants_ps_log()
        self.flights = {}   # worker child -> the latest flight record it published
        self.flight_changed = threading.Event()
        self.divergence = None   # (the diagnosis line, when it was found)
        self.listed = None   # an elastic job: the hosts its discovery script listed last (None: not known)
        self.grown = False   # the start ended because hosts joined, and none of its own left
        self.file_at_start = None   # an elastic job on a hostfile: the hosts it named when the start began
        self.ended = threading.Event()

    def note_flight(self, child, snapshot):
        """Keep the latest flight record ``child`` published (``parallel.flight``)."""
        self.flights[child] = snapshot
        self.flight_changed.set()

    def _check_flights(self):
        """Raise ``Failure(DIVERGED)`` once the workers' records prove a divergence and every waiting worker's
        stack is in (or ``_STACK_WAIT_SECONDS`` passed); before that, print each worker's records and stack."""
        if self.flight_changed.is_set():
            self.flight_changed.clear()
            if self.divergence is None:
                line = diagnose(list(self.flights.values()))
                if line is not None:
                    self.divergence = (line, time.monotonic())
        if self.divergence is None:
            return
        line, found = self.divergence
        snapshots = list(self.flights.items())
        if time.monotonic() - found < _STACK_WAIT_SECONDS and not all("stack" in s for _, s in snapshots):
            return
        self._write_flights()
        raise Failure(DIVERGED, f"the workers disagree: {line}; every worker must issue the same collectives in "
                                "the same order (a worker with fewer batches: see parallel.Join in "
                                "docs/distributed.md)")

    def _write_flights(self):
        """Print each worker's last records and, when it sent one, its main thread's stack (what a divergence or a
        stall is read from)."""
        for child, snapshot in sorted(self.flights.items(), key=lambda item: item[1]["rank"]):
            prefix = f"[{child.label}] "
            self.write("stderr", f"{prefix}flight recorder of rank {snapshot['rank']} ({snapshot['seq']} "
                                 f"collectives, step {snapshot['step']}), last ones:")
            for record in format_records(snapshot):
                self.write("stderr", f"{prefix}  {record}")
            if snapshot.get("stack"):
                self.write("stderr", f"{prefix}Python stack of its main thread (most recent call last):")
                for stack_line in snapshot["stack"]:
                    self.write("stderr", prefix + stack_line)

    def write(self, out, line, source=None):
        write_line(out, line, source)

    def watch_line(self, line):
        """Note what the scheduler's log says; True if the line is ps-lite chatter not to forward."""
        if not self.connected.is_set():
            found = _REGISTRATION.search(line)
            if found and found.group(1) in self.registered:
                self.registered[found.group(1)].add((found.group(2), found.group(3)))
            if START_LINE.search(line):
                self.connected.set()
                return False
        return self.quiet_scheduler and is_ps_chatter(line)

    def measure_links(self):
        """``--van auto`` across hosts: measure each host's link to here, one host at a time (at once they would
        share this host's link), and keep the slowest in ``args.link_mbit`` for the plan; say so in one line."""
        args = self.args
        args.link_mbit = None
        hosts = hosts_to_probe(args)
        if not hosts:
            return
        measured = {host: probe_link(link_probe_argv(host, port, args.ssh_option)) for host, port in hosts}
        known = {host: mbit for host, mbit in measured.items() if mbit is not None}
        if not known:
            self.write("stderr", f"--van auto: no link of the job's {len(hosts)} hosts could be measured over ssh; "
                                 "the job runs on MXNet's P3 van (--van zmq or p3 to choose)")
            return
        slowest = min(known, key=known.get)
        args.link_mbit = known[slowest]
        van = "MXNet's P3 van" if p3_suits(args.link_mbit) else "ps-lite's ZeroMQ van"
        self.write("stderr", f"--van auto: the slowest link, from {slowest}, carried {args.link_mbit:.0f} Mbit/s "
                             f"here: the job runs on {van} (P3 below {P3_BELOW_MBIT} Mbit/s; --van zmq or p3 to "
                             "choose)")

    def start(self):
        self.measure_links()
        for spec in plan_processes(self.args):
            try:
                self.children.append(_Child(spec, self))
            except OSError as e:
                message = f"{spec.name} could not start: {e.strerror or e}: {spec.argv[0]!r}"
                raise Failure(NOT_STARTED, message) from None

    def run(self):
        """Start the processes and watch them until the job ends; returns ``Ending(SUCCESS)`` or raises
        ``Failure``."""
        args = self.args
        started = time.monotonic()
        self.start()
        workers = [c for c in self.children if c.spec.role == "worker"]
        if args.elastic and (args.host_discovery_script is not None or args.launcher == "ssh"):
            if args.host_discovery_script is None:   # -H with -n MIN:MAX: the hostfile is watched instead
                self.file_at_start = _read_hostfile(args.hostfile) or []
            threading.Thread(target=self._poll_discovery, daemon=True).start()
        while True:
            try:
                child = self.exits.get(timeout=0.1)
            except queue.Empty:
                child = None
            if self.signals.signum is not None:
                name = signal.Signals(self.signals.signum).name
                raise Failure(INTERRUPTED, f"interrupted by {name}; stopped the {len(self.children)} processes of "
                                           "the job", signum=self.signals.signum)
            if child is not None and child.returncode != 0:
                raise self._child_failure(child)
            self._check_flights()
            self.check_hosts()
            if all(w.done.is_set() for w in workers):
                return self._wind_down()
            now = time.monotonic()
            if not self.connected.is_set() and now - started > args.start_timeout:
                raise Failure(START_TIMEOUT, self._start_timeout_message())
            if args.stall_timeout and now - self.last_worker_line > args.stall_timeout:
                self._write_flights()   # where each worker's main thread waits: what a hang is read from
                where = (f"; the workers' last collectives: {positions(list(self.flights.values()))}"
                         if self.flights else "")
                raise Failure(STALL_TIMEOUT, f"no worker printed a line for {args.stall_timeout:g} s "
                                             "(--stall-timeout); the job is stuck or silent (a worker waiting for "
                                             f"a dead or hung peer never returns){where}")

    def _poll_discovery(self):
        """Run the discovery script (or read the hostfile) every ``--discovery-interval`` seconds while the start
        runs (a thread); keep what it lists in ``listed``, or the ``Failure`` of a bad line."""
        while not self.ended.wait(self.args.discovery_interval):
            try:
                listed = (listed_slots(self.args) if self.args.host_discovery_script is not None
                          else _read_hostfile(self.args.hostfile))
            except Failure as e:
                listed = e
            if listed is not None:
                self.listed = listed

    def check_hosts(self):
        """Raise ``Failure(HOSTS_CHANGED)`` once the discovery script lists other hosts than the start's (the
        first ``MAX`` of them: a host joined, or one of the start's left), or the hostfile changed so (a host the
        job had room for added, or one of the start's removed); the failure of a bad line as it is."""
        listed = self.listed
        if listed is None:
            return
        if isinstance(listed, Failure):
            raise listed
        args = self.args
        listed = args.cooldowns.usable(listed)   # a host left out after failing has not joined
        if args.host_discovery_script is None:   # a hostfile: a change of the file, and only what the job can use
            joined = _difference(listed, args.cooldowns.usable(self.file_at_start))
            left = _difference(args.hosts, listed)
            if not left and not (joined and len(args.hosts) < args.max_workers):
                return
        else:
            wanted = listed[:min(args.max_workers, len(listed))]
            if sorted(wanted) == sorted(args.hosts):
                return
            joined, left = _difference(wanted, args.hosts), _difference(args.hosts, wanted)
        self.grown = not left
        what = [f"{', '.join(joined)} joined" if joined else "", f"{', '.join(left)} left" if left else ""]
        raise Failure(HOSTS_CHANGED, f"the job's hosts changed: {' and '.join(w for w in what if w)} "
                                     f"({len(listed)} listed, -n {args.min_workers}:{args.max_workers})")

    def hand_over(self):
        """Fetch the newest state an elastic job's live workers committed (``parallel.handover``), from the first
        that answers; returns ``(step, bytes)``, or None when none could give one (say so in one line). When hosts
        only joined, every worker still trains: take the next commit, so that no step is lost to the change."""
        began = time.monotonic()
        if not any(c.state_port is not None for c in self.children):   # a command that commits nothing
            return None
        live = [c for c in self.children if c.spec.role == "worker" and not c.done.is_set()
                and c.state_port is not None]
        errors = []
        for child in live:
            try:
                step, data = fetch_state(child.spec.host or "127.0.0.1", child.state_port, timeout=_FETCH_SECONDS,
                                         next_commit=self.grown)
            except OSError as e:
                errors.append(f"{child.label}: {e}")
                continue
            if step >= 0:
                self.write("stderr", f"took the state of step {step} ({len(data) / 2**20:.1f} MiB) from "
                                     f"{child.describe()} in {time.monotonic() - began:.2f} s")
                return step, data
        why = "; ".join(errors) if errors else "no live worker had committed a state"
        self.write("stderr", f"no worker's state could be taken ({why}): the next start resumes from the last "
                             "state taken, or a checkpoint")
        return None

    def _wind_down(self):
        """Every worker exited with 0: the servers and scheduler get ``--grace`` seconds to exit by themselves
        (none if the job never connected: they would wait forever), then they are stopped."""
        deadline = time.monotonic() + (self.args.grace if self.connected.is_set() else 0)
        while time.monotonic() < deadline and not all(c.done.is_set() for c in self.children):
            try:
                child = self.exits.get(timeout=0.1)
            except queue.Empty:
                continue
            if child.returncode != 0:
                raise self._child_failure(child)
        return Ending(SUCCESS)

    def _child_failure(self, child):
        """The failure of ``child``, with its status (``restarts.decide`` restarts it unless that is 2), and what
        the workers' flight records prove, if anything (a server aborts on pushes of two sizes to one key)."""
        message = self._failure_message(child)
        waits = self.flights or child.spec.role != "worker"   # a server's failure may come before any record
        deadline = time.monotonic() + (_FAILURE_RECORD_SECONDS if waits else 0)
        while True:
            line = diagnose(list(self.flights.values()))
            if line is not None:
                message += f"; the workers disagree: {line}"
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return Failure(PROCESS_FAILED, message, returncode=child.returncode, host=child.spec.host)

    def _failure_message(self, child):
        lost = _host_not_responding(child)
        if lost is not None:
            there = [c.spec.name for c in self.children if c.spec.host == child.spec.host]
            return (f"host {lost} stopped answering: no reply to ssh's keepalives for {self.args.host_timeout:g} s "
                    f"(--host-timeout); {' and '.join(there)} there {'is' if len(there) == 1 else 'are'} cut off, and "
                    "the job's other processes wait for them in its collectives")
        lines = [line.strip() for line in child.tail if line.strip()]
        output = f"its last output: {' | '.join(lines)}" if lines else "it printed nothing"
        return f"{child.describe()} {describe_status(child.returncode, child.spec.host is not None)}; {output}"

    def _start_timeout_message(self):
        args = self.args
        heard = {role: len(nodes) for role, nodes in self.registered.items()}
        wanted = {"worker": args.num_workers, "server": args.num_servers}
        missing = [f"{wanted[r] - heard[r]} {r}{'s' if wanted[r] - heard[r] > 1 else ''}"
                   for r in ("worker", "server") if heard[r] < wanted[r]]
        counts = (f"the scheduler heard from {heard['worker']} of {wanted['worker']} workers and "
                  f"{heard['server']} of {wanted['server']} servers")
        which = f"; missing: {' and '.join(missing)}" if missing and self.quiet_scheduler else ""
        if not self.quiet_scheduler:   # the user's PS_VERBOSE may not log registrations: counts unknown
            counts = "ps-lite's scheduler did not report every node connected"
        return (f"the job did not start within {args.start_timeout:g} s (--start-timeout): {counts}{which}; "
                f"a process that never calls mx.kv.create, or a host that cannot reach the scheduler at "
                f"{args.scheduler_host}:{args.port}, stalls every other")

    def stop(self):
        """SIGTERM every process group still running, SIGKILL after ``--grace`` seconds; wait until reaped."""
        self.ended.set()
        running = [c for c in self.children if not c.done.is_set()]
        for child in running:
            kill_group(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.args.grace
        for child in running:
            child.done.wait(max(0.0, deadline - time.monotonic()))
        for child in running:
            if not child.done.is_set():
                kill_group(child.pid, signal.SIGKILL)
        for child in running:
            child.done.wait(_READER_JOIN_SECONDS + GROUP_GONE_SECONDS + 5)
        end_progress()   # a bar its workers left drawn is not redrawn under the launcher's next lines

    def kill_now(self):
        """``atexit`` backstop: SIGKILL whatever is still running (the launcher is going away)."""
        for child in self.children:
            if not child.done.is_set():
                kill_group(child.pid, signal.SIGKILL)


class Signals:
    """While active, SIGINT and SIGTERM only record themselves in ``signum``; the job's loop stops the job."""

    def __init__(self):
        self.signum, self.previous = None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._record)
        return self

    def _record(self, signum, frame):
        if self.signum is None:
            self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def plan_start(args, restart, signals):
    """The arguments of one start of the job: its number of workers and servers, its hosts, its port. With
    ``-n MIN:MAX``, waits (up to ``--start-timeout``) for at least MIN available hosts."""
    start = argparse.Namespace(**vars(args))
    start.restart = restart
    if restart and args.fresh_port:
        start.port = free_port()
    deadline = time.monotonic() + args.start_timeout
    while True:
        slots = available_slots(args)
        if slots is not None:
            slots = args.cooldowns.usable(slots)
        if slots is None or len(slots) >= args.min_workers:
            break
        if time.monotonic() > deadline or signals.signum is not None:
            out = args.cooldowns.left_out()
            why = f", {len(out)} left out after failing ({', '.join(out)}: --host-cooldown)" if out else ""
            raise Failure(TOO_FEW_HOSTS, f"only {len(slots)} host(s) available{why}, -n asks for at least "
                                         f"{args.min_workers} (waited {args.start_timeout:g} s, --start-timeout)")
        time.sleep(1.0)
    if slots is not None:
        start.num_workers = min(args.max_workers, len(slots))
        start.hosts = slots[:start.num_workers]
        if not args.fixed_servers:
            start.num_servers = default_servers(start.hosts, start.num_workers, args.launcher)
    return start
