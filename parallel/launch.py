"""Start a distributed kvstore job (scheduler, servers, workers) and watch it: MXNet's ``tools/launch.py``, here.

Run your kvstore script (one that calls ``mx.kv.create('dist_sync')``) on 2 workers and 2 servers of this
machine, or on the hosts of a hostfile over ssh::

    python -m parallel.launch -n 2 python my_kvstore_script.py
    python -m parallel.launch -n 3 -s 1 --stall-timeout 300 python my_kvstore_script.py --epochs 5
    python -m parallel.launch -n 4 --launcher ssh -H hosts.txt --env OMP_NUM_THREADS python my_kvstore_script.py
    python -m parallel.launch -n 1:2 --max-restarts 3 python -m parallel.train --checkpoint-dir ckpt --checkpoint-every 50

The flags are those of ``tools/launch.py`` (``-n``, ``-s``, ``--launcher``, ``-H``, ``--env``, then the command),
plus the watchdog's. ps-lite, under MXNet's distributed kvstore, has no timeouts: a missing peer makes
``mx.kv.create`` wait forever and a dead worker stalls the others. So the launcher watches instead:

- a process that exits with a non-zero status or dies from a signal ends the whole job at once, with one
  line ``error: worker 1 (pid N) was killed by SIGKILL; its last output: ...`` and status 1;
- the job must start within ``--start-timeout`` seconds, else the error says which roles never registered:
  the launcher sets ``PS_VERBOSE=2`` for the scheduler alone and reads its log (on stderr) for each
  registration and for ``the scheduler is connected to N workers and M servers``; the rest of that log is
  hidden unless you set ``PS_VERBOSE`` yourself;
- with ``--stall-timeout``, the job ends when no worker prints a line for that long;
- Ctrl-C or SIGTERM stops every process the launcher started (status 130 or 143).

With ``--max-restarts R`` a job that failed that way (but for a worker's exit status 2: its input cannot work)
is started again, up to R times, one line each (``restart 1 of 3: worker 1 (pid N) was killed by SIGKILL; ...;
starting 2 worker(s) again``); every process gets ``PARALLEL_RESTART=r`` (0 on the first start), which tells
``python -m parallel.train`` to resume from its ``--checkpoint-dir``. With ``-n MIN:MAX`` each start runs one
worker per available host (``--host-discovery-script``, or the hostfile's hosts that answer ssh), between MIN
and MAX. A watchdog process, fed the id of every process group the launcher starts, SIGKILLs them all if the
launcher itself dies without saying it is done: nothing of the job outlives the launcher.

"Stop" means SIGTERM to each process group, then SIGKILL after ``--grace`` seconds. When every worker has
exited with 0, the servers and the scheduler get ``--grace`` seconds to exit by themselves and the launcher
exits with 0. Input that cannot work (``-n 0``, a missing or empty hostfile, no command, a ``--port`` in use)
exits with status 2 and one ``error:`` line.

Each line a process prints is forwarded with its name: ``[scheduler] ``, ``[server i] ``, ``[worker i] ``,
where ``i`` is the launch order; ps-lite assigns the ranks (``kv.rank``) itself, by host and port, so worker
``i`` need not have rank ``i``. Workers get ``PYTHONUNBUFFERED=1`` (unless set) so that their lines arrive
as they are printed.

Local mode (the default) runs everything on 127.0.0.1, the scheduler and the servers as
``python -c "import mxnet"`` (importing MXNet with ``DMLC_ROLE`` set runs ps-lite's loop until the job ends),
and, unless ``OMP_NUM_THREADS`` is set, splits the cores between the workers and servers. Each process is
the leader of its own process group, so the launcher can stop what it spawns.

ssh mode runs the scheduler here and each worker and server on a host of the hostfile (round robin), as
``ssh -tt host 'cd <cwd> && exec env DMLC_...=... <command>'``; the hosts need this directory and this
Python at the same paths (a shared file system or identical images), and only the ``DMLC_*`` variables, the
``--env`` ones and ``PYTHONUNBUFFERED`` reach them. ``-tt`` gives the remote command a terminal, so that when
the launcher kills the local ssh the remote side gets SIGHUP and ends too (without it, it would run on); the
price is that a remote process's stderr arrives merged into its stdout.

The launcher itself never imports MXNet, so nothing in it can block in ps-lite.
"""
import argparse
import atexit
import collections
import contextlib
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from .cli import RESTART_ENV, USAGE_STATUS, Parser, UsageError

__all__ = ["main", "build_parser", "check_args", "parse_hostfile", "plan_processes", "ssh_argv", "UsageError",
           "START_LINE"]

#: What ps-lite's scheduler logs (on stderr, with ``PS_VERBOSE`` >= 1) once every node has registered:
#: ``... van.cc:97: the scheduler is connected to 2 workers and 1 servers``.
START_LINE = re.compile(r"the scheduler is connected to (\d+) workers and (\d+) servers")

# With PS_VERBOSE=2 the scheduler also logs each registration it receives, which tells who is missing:
# "... van.cc:419: ? => 1. Meta: request=0, timestamp=0, control={ cmd=ADD_NODE, node={ role=worker, ip=..., port=..."
_REGISTRATION = re.compile(r"=> 1\. Meta: .*cmd=ADD_NODE, node=\{ role=(\w+), ip=([^,]+), port=(\d+)")
# The rest of its PS_VERBOSE=2 log (binding, ranks, barriers, messages, stopping): hidden unless the user set
# PS_VERBOSE, since the launcher sets it only to watch the start.
_PS_CHATTER = re.compile(r"ps-lite/src/[\w./]+:\d+: (Bind to |assign rank=|Barrier count |\S+ => \S+\. Meta: |"
                         r"H\[\d+\] is stopp)")
# ssh's own note when a -tt session ends.
_SSH_CLOSED = re.compile(r"^Connection to \S+ closed\.$")

_TAIL_LINES = 20
_READER_JOIN_SECONDS = 2.0
_GROUP_GONE_SECONDS = 2.0
_DISCOVERY_TIMEOUT = 60.0


class _Failure(Exception):
    """The job ended badly; ``main`` prints ``error: <message>`` and returns ``status``."""

    def __init__(self, message, status=1, restartable=False):
        super().__init__(message)
        self.status, self.restartable = status, restartable


def build_parser():
    """The argument parser of ``python -m parallel.launch``."""
    parser = Parser(prog="python -m parallel.launch",
                     description="Start a distributed MXNet kvstore job (scheduler, servers, workers) and watch it: "
                                 "any process that fails, a start that does not complete, or a stall ends the "
                                 "whole job with one error line.")
    parser.add_argument("-n", "--num-workers", type=_worker_range, required=True, metavar="N|MIN:MAX",
                        help="number of workers (>= 1), or MIN:MAX (torchrun's --nnodes): at every start, as many "
                             "workers as there are available hosts (--host-discovery-script, or the hostfile's "
                             "reachable hosts), at least MIN, at most MAX")
    parser.add_argument("-s", "--num-servers", type=int, default=None,
                        help="number of servers (>= 1); default: as many as workers")
    parser.add_argument("--launcher", choices=["local", "ssh"], default="local",
                        help="local: every process on this machine; ssh: workers and servers on the hostfile's "
                             "hosts; default local")
    parser.add_argument("-H", "--hostfile", default=None,
                        help="ssh: a file with one host[:ssh port] a line (# comments and blank lines ignored)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME[:VALUE]",
                        help="set NAME to VALUE for every worker and server, or pass NAME's value from this "
                             "environment (needed for ssh, where only DMLC_* variables are sent); repeatable")
    parser.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                        help="ssh: an option passed as 'ssh -o KEY=VALUE', e.g. IdentityFile=~/.ssh/id_job; "
                             "repeatable")
    parser.add_argument("--scheduler-host", default=None,
                        help="ssh: the address of this machine the hosts can reach (default 127.0.0.1 when every "
                             "host is local, else the address of this machine's host name)")
    parser.add_argument("--port", type=int, default=None,
                        help="the scheduler's port (default: a free port the launcher picks)")
    parser.add_argument("--start-timeout", type=float, default=60.0, metavar="SEC",
                        help="end the job unless every worker and server has connected to the scheduler within "
                             "SEC seconds; default 60")
    parser.add_argument("--stall-timeout", type=float, default=0.0, metavar="SEC",
                        help="end the job when no worker has printed a line for SEC seconds; default 0 (off)")
    parser.add_argument("--grace", type=float, default=5.0, metavar="SEC",
                        help="when stopping processes: SIGTERM, then SIGKILL after SEC seconds; default 5")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="R",
                        help="when a process of the job fails or dies, stop the job and start it again, up to R "
                             "times (each worker gets PARALLEL_RESTART=r; python -m parallel.train then resumes "
                             "from its --checkpoint-dir); a worker that exits with status 2 (its input cannot "
                             "work) is not restarted; default 0")
    parser.add_argument("--host-discovery-script", default=None, metavar="COMMAND",
                        help="a shell command run at every start that prints the available hosts, one "
                             "host[:ssh port] a line, one worker each (Horovod's elastic discovery); with "
                             "--launcher local every host must be this machine")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command every worker runs, e.g. python my_kvstore_script.py --epochs 5")
    return parser


def check_args(args):
    """Check parsed ``args`` (and the files and port they name); raise ``UsageError`` naming the flag.

    Fills in ``args.num_servers`` (default: ``args.num_workers``), ``args.hosts`` (a list of
    ``(host, ssh port or None)``), ``args.port`` (a free one when not given) and ``args.scheduler_host``.
    """
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    args.min_workers, args.max_workers = args.num_workers
    if args.min_workers < 1 or args.max_workers < args.min_workers:
        raise UsageError(f"-n/--num-workers must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX, got "
                         f"{_format_range(args.num_workers)}")
    args.num_workers = args.max_workers
    args.elastic = args.min_workers < args.max_workers or args.host_discovery_script is not None
    args.fixed_servers = args.num_servers is not None
    if args.num_servers is None:
        args.num_servers = args.num_workers
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.host_discovery_script is not None and args.hostfile is not None:
        raise UsageError("give -H/--hostfile or --host-discovery-script, not both: the script names the hosts")
    if args.host_discovery_script is not None and not args.host_discovery_script.strip():
        raise UsageError("--host-discovery-script needs a command, got an empty string")
    if args.num_servers < 1:
        raise UsageError(f"-s/--num-servers must be >= 1 (MXNet's dist kvstores need a server), "
                         f"got {args.num_servers}")
    if not args.command:
        raise UsageError("no command given: put the command every worker runs after the options, "
                         "e.g. python -m parallel.launch -n 2 python my_kvstore_script.py")
    if not args.start_timeout > 0:
        raise UsageError(f"--start-timeout must be > 0 seconds, got {args.start_timeout}")
    if not args.stall_timeout >= 0:
        raise UsageError(f"--stall-timeout must be >= 0 seconds (0 turns it off), got {args.stall_timeout}")
    if not args.grace >= 0:
        raise UsageError(f"--grace must be >= 0 seconds, got {args.grace}")
    for item in args.env:
        name = item.split(":", 1)[0]
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UsageError(f"--env {item!r}: {name!r} is not an environment variable name")
    for option in args.ssh_option:
        if not re.fullmatch(r"[A-Za-z]+=.*", option):
            raise UsageError(f"--ssh-option {option!r} is not KEY=VALUE, e.g. IdentityFile=~/.ssh/id_job")
    if args.launcher == "ssh":
        if args.hostfile is None and args.host_discovery_script is None:
            raise UsageError("--launcher ssh needs -H/--hostfile, a file with one host[:port] a line (or "
                             "--host-discovery-script)")
        args.hosts = parse_hostfile(args.hostfile) if args.hostfile is not None else []
        if args.scheduler_host is None and args.hostfile is None:
            raise UsageError("--host-discovery-script with --launcher ssh needs --scheduler-host, an address of "
                             "this machine the hosts can reach")
        args.scheduler_host = args.scheduler_host or _default_scheduler_host(args.hosts)
    else:
        for flag, value in (("-H/--hostfile", args.hostfile), ("--ssh-option", args.ssh_option or None),
                            ("--scheduler-host", args.scheduler_host)):
            if value is not None:
                raise UsageError(f"{flag} applies to --launcher ssh; add --launcher ssh to run on other hosts")
        args.hosts, args.scheduler_host = [("127.0.0.1", None)], "127.0.0.1"
    args.fresh_port = args.port is None   # a restarted job gets a fresh port too
    if args.port is None:
        args.port = _free_port()
    else:
        _check_port(args.port)


def _worker_range(text):
    """``-n``: ``N`` or ``MIN:MAX`` as ``(MIN, MAX)``.

    >>> _worker_range("3"), _worker_range("1:4")
    ((3, 3), (1, 4))
    """
    low, sep, high = text.partition(":")
    try:
        return (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of workers N or a range MIN:MAX") from None


def _format_range(bounds):
    low, high = bounds
    return str(low) if low == high else f"{low}:{high}"


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


def _default_scheduler_host(hosts):
    if all(host in ("localhost", "127.0.0.1") for host, _ in hosts):
        return "127.0.0.1"
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise UsageError(f"cannot find this machine's address ({e}); give --scheduler-host, an address of this "
                         "machine the hosts can reach") from None


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _check_port(port):
    if not 1 <= port <= 65535:
        raise UsageError(f"--port must be between 1 and 65535, got {port}")
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as e:
            raise UsageError(f"--port {port} is not free ({e.strerror or e}); choose another, or leave --port out "
                             "and the launcher picks a free one") from None


def _omp_threads(num_processes):
    """Threads per worker or server when ``num_processes`` of them share this machine's cores (>= 1).

    >>> _omp_threads(1) >= 1, _omp_threads(10 ** 6)
    (True, 1)
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // num_processes)


def _user_wants_ps_log():
    """Whether the user set ``PS_VERBOSE`` >= 1: then the scheduler keeps that level and its log is forwarded
    as is; otherwise the launcher sets 2 for the scheduler alone and hides what it does not need."""
    level = os.environ.get("PS_VERBOSE", "").strip()
    return level.isdigit() and int(level) >= 1


class _Spec:
    """One process to start: its role, launch index, host (None: here), argv and extra environment."""

    def __init__(self, role, index, host, ssh_port, argv, env):
        self.role, self.index, self.host, self.ssh_port, self.argv, self.env = role, index, host, ssh_port, argv, env

    @property
    def name(self):
        return "scheduler" if self.role == "scheduler" else f"{self.role} {self.index}"


def _extra_env(args):
    """The ``--env`` variables: NAME:VALUE as given, NAME from this environment (skipped when unset)."""
    env = {}
    for item in args.env:
        name, sep, value = item.partition(":")
        if sep:
            env[name] = value
        elif name in os.environ:
            env[name] = os.environ[name]
    return env


def plan_processes(args):
    """The scheduler, servers and workers to start for checked ``args``, in that order.

    Returns
    -------
    list of _Spec
        Local ones (``host`` None) carry the variables to add to this environment; remote ones carry the
        whole ssh command line in ``argv``.
    """
    common = {"DMLC_PS_ROOT_URI": args.scheduler_host, "DMLC_PS_ROOT_PORT": str(args.port),
              "DMLC_NUM_SERVER": str(args.num_servers), "DMLC_NUM_WORKER": str(args.num_workers),
              RESTART_ENV: str(getattr(args, "restart", 0))}
    extra = _extra_env(args)
    scheduler_env = dict(common, DMLC_ROLE="scheduler", DMLC_NODE_HOST=args.scheduler_host, OMP_NUM_THREADS="1")
    if not _user_wants_ps_log():
        scheduler_env["PS_VERBOSE"] = "2"   # the start line, and each registration (to name who is missing)
    specs = [_Spec("scheduler", 0, None, None, [sys.executable, "-c", "import mxnet"], scheduler_env)]
    threads = {} if "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in extra else {
        "OMP_NUM_THREADS": str(_omp_threads(args.num_workers + args.num_servers))}
    unbuffered = {} if "PYTHONUNBUFFERED" in os.environ else {"PYTHONUNBUFFERED": "1"}
    for role, count, command in (("server", args.num_servers, [sys.executable, "-c", "import mxnet"]),
                                 ("worker", args.num_workers, list(args.command))):
        for i in range(count):
            host, ssh_port = args.hosts[i % len(args.hosts)]
            env = dict(common, DMLC_ROLE=role, DMLC_NODE_HOST=host, **unbuffered)
            if args.launcher == "local":
                specs.append(_Spec(role, i, None, None, command, dict(env, **threads, **extra)))
            else:
                argv = ssh_argv(host, ssh_port, dict(env, **extra), command, os.getcwd(), args.ssh_option)
                specs.append(_Spec(role, i, host, ssh_port, argv, {}))
    return specs


def ssh_argv(host, port, env, command, cwd, options=()):
    """The ssh command line that runs ``command`` in ``cwd`` on ``host`` with ``env``, every word quoted.

    ``-tt`` forces a terminal on the remote side: when the local ssh is killed, the remote command gets
    SIGHUP and ends (without a terminal it would keep running). ``options`` (``KEY=VALUE``) come first, so they
    override the defaults ``BatchMode=yes`` (never prompt) and ``StrictHostKeyChecking=accept-new``.

    >>> ssh_argv("node1", 2222, {"DMLC_ROLE": "worker"}, ["python", "my script.py"], "/home/me/job")[-2:]
    ['node1', "cd /home/me/job && exec env DMLC_ROLE=worker python 'my script.py'"]
    """
    argv = ["ssh", "-tt"]
    for option in options:
        argv += ["-o", option]
    argv += ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new"]
    if port is not None:
        argv += ["-p", str(port)]
    assignments = [shlex.quote(f"{name}={value}") for name, value in env.items()]
    remote = " ".join([f"cd {shlex.quote(cwd)} && exec env", *assignments, *map(shlex.quote, command)])
    return argv + [host, remote]


def _describe_status(returncode):
    """``exited with status 3`` or ``was killed by SIGKILL``.

    >>> _describe_status(3), _describe_status(-9)
    ('exited with status 3', 'was killed by SIGKILL')
    """
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


def _kill_group(pid, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_group_gone(pgid, timeout=_GROUP_GONE_SECONDS):
    """Wait (up to ``timeout``) until no process of group ``pgid`` is left; a killed grandchild is reaped by
    init, which may take a moment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.02)


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


class _Watchdog:
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
        self._send(f"+{pgid}")

    def forget(self, pgid):
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


class _Child:
    """A started process: the thread that reaps it, the threads that forward its output, its last lines."""

    def __init__(self, spec, job):
        self.spec, self.job = spec, job
        self.tail = collections.deque(maxlen=_TAIL_LINES)
        self.done = threading.Event()
        self.returncode = None
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
        return f"{self.spec.name} (pid {self.pid}{where})"

    def _forward(self, pipe, out):
        prefix = f"[{self.spec.name}] "
        is_scheduler = self.spec.role == "scheduler"
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if is_scheduler and self.job.watch_line(line):
                continue
            if self.spec.host is not None and _SSH_CLOSED.match(line):
                continue
            if self.spec.role == "worker":
                self.job.last_worker_line = time.monotonic()
            self.tail.append(line)
            self.job.write(out, prefix + line)
        pipe.close()

    def _reap(self):
        self.returncode = self.process.wait()
        _kill_group(self.pid, signal.SIGKILL)   # anything it left in its group (the group id is still reserved)
        _wait_group_gone(self.pid)
        self.job.watchdog.forget(self.pid)
        for reader in self.readers:
            reader.join(_READER_JOIN_SECONDS)
        self.done.set()
        self.job.exits.put(self)


_WRITE_LOCK = threading.Lock()


def _write_line(out, line):
    """One line to stdout or stderr, whole (the reader threads write at once)."""
    with _WRITE_LOCK:
        stream = sys.stdout if out == "stdout" else sys.stderr
        try:
            stream.write(line + "\n")
            stream.flush()
        except (OSError, ValueError):   # our output is gone (a closed pipe): keep draining the children
            pass


class _Job:
    """The processes of one job and the watchdog over them (``run``)."""

    def __init__(self, args, signals, watchdog):
        self.args, self.signals, self.watchdog = args, signals, watchdog
        self.children = []
        self.exits = queue.SimpleQueue()
        self.connected = threading.Event()
        self.registered = {"worker": set(), "server": set()}
        self.last_worker_line = time.monotonic()
        self.quiet_scheduler = not _user_wants_ps_log()

    def write(self, out, line):
        _write_line(out, line)

    def watch_line(self, line):
        """Note what the scheduler's log says; True if the line is ps-lite chatter not to forward."""
        if not self.connected.is_set():
            found = _REGISTRATION.search(line)
            if found and found.group(1) in self.registered:
                self.registered[found.group(1)].add((found.group(2), found.group(3)))
            if START_LINE.search(line):
                self.connected.set()
                return False
        return self.quiet_scheduler and bool(_PS_CHATTER.search(line))

    def start(self):
        for spec in plan_processes(self.args):
            try:
                self.children.append(_Child(spec, self))
            except OSError as e:
                raise _Failure(f"{spec.name} could not start: {e.strerror or e}: {spec.argv[0]!r}") from None

    def run(self):
        """Start the processes and watch them until the job ends; returns 0 or raises ``_Failure``."""
        args = self.args
        started = time.monotonic()
        self.start()
        workers = [c for c in self.children if c.spec.role == "worker"]
        while True:
            try:
                child = self.exits.get(timeout=0.1)
            except queue.Empty:
                child = None
            if self.signals.signum is not None:
                name = signal.Signals(self.signals.signum).name
                raise _Failure(f"interrupted by {name}; stopped the {len(self.children)} processes of the job",
                               128 + self.signals.signum)
            if child is not None and child.returncode != 0:
                raise self._child_failure(child)
            if all(w.done.is_set() for w in workers):
                return self._wind_down()
            now = time.monotonic()
            if not self.connected.is_set() and now - started > args.start_timeout:
                raise _Failure(self._start_timeout_message(), restartable=True)
            if args.stall_timeout and now - self.last_worker_line > args.stall_timeout:
                raise _Failure(f"no worker printed a line for {args.stall_timeout:g} s (--stall-timeout); the job "
                               "is stuck or silent (a worker waiting for a dead or hung peer never returns)",
                               restartable=True)

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
        return 0

    def _child_failure(self, child):
        """The failure of ``child``; restartable unless it exited with ``USAGE_STATUS`` (its input cannot work,
        and would fail the same way again)."""
        return _Failure(self._failure_message(child), restartable=child.returncode != USAGE_STATUS)

    def _failure_message(self, child):
        lines = [line.strip() for line in child.tail if line.strip()]
        output = f"its last output: {' | '.join(lines)}" if lines else "it printed nothing"
        return f"{child.describe()} {_describe_status(child.returncode)}; {output}"

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
        running = [c for c in self.children if not c.done.is_set()]
        for child in running:
            _kill_group(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.args.grace
        for child in running:
            child.done.wait(max(0.0, deadline - time.monotonic()))
        for child in running:
            if not child.done.is_set():
                _kill_group(child.pid, signal.SIGKILL)
        for child in running:
            child.done.wait(_READER_JOIN_SECONDS + _GROUP_GONE_SECONDS + 5)

    def kill_now(self):
        """``atexit`` backstop: SIGKILL whatever is still running (the launcher is going away)."""
        for child in self.children:
            if not child.done.is_set():
                _kill_group(child.pid, signal.SIGKILL)


class _Signals:
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


def _local_names():
    names = {"localhost", "127.0.0.1", socket.gethostname()}
    with contextlib.suppress(OSError):
        names.add(socket.getfqdn())
    return names


def _discover(args):
    """The hosts the ``--host-discovery-script`` prints now, one worker slot a line; ``[]`` if it fails."""
    try:
        result = subprocess.run(args.host_discovery_script, shell=True, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=_DISCOVERY_TIMEOUT, start_new_session=True)
    except subprocess.TimeoutExpired:
        return []
    if result.returncode != 0:
        return []
    try:
        hosts = _parse_host_lines(result.stdout.splitlines())
    except ValueError as e:
        raise _Failure(f"--host-discovery-script printed a bad {e}") from None
    if args.launcher == "local":
        names = _local_names()
        for host, _ in hosts:
            if host not in names:
                raise _Failure(f"--host-discovery-script named the host {host!r}, but --launcher local runs every "
                               "process on this machine; print localhost, or use --launcher ssh")
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


def _available_slots(args):
    """The hosts available for workers now (one slot a line), or None when the job's hosts are fixed."""
    if args.host_discovery_script is not None:
        return _discover(args)
    if args.elastic and args.launcher == "ssh":
        return _reachable(args, parse_hostfile(args.hostfile))
    return None


def _plan_start(args, restart, signals):
    """The arguments of one start of the job: its number of workers and servers, its hosts, its port. With
    ``-n MIN:MAX``, waits (up to ``--start-timeout``) for at least MIN available hosts."""
    start = argparse.Namespace(**vars(args))
    start.restart = restart
    if restart and args.fresh_port:
        start.port = _free_port()
    deadline = time.monotonic() + args.start_timeout
    while True:
        slots = _available_slots(args)
        if slots is None or len(slots) >= args.min_workers:
            break
        if time.monotonic() > deadline or signals.signum is not None:
            raise _Failure(f"only {len(slots)} host(s) available, -n asks for at least {args.min_workers} (waited "
                           f"{args.start_timeout:g} s, --start-timeout)")
        time.sleep(1.0)
    if slots is not None:
        start.num_workers = min(args.max_workers, len(slots))
        start.hosts = slots[:start.num_workers]
        if not args.fixed_servers:
            start.num_servers = start.num_workers
    return start


def main(argv=None):
    """Entry point of ``python -m parallel.launch``; returns the process exit status.

    0 when every worker exited with 0; 1 with one ``error:`` line on stderr when a process failed, the job did
    not start within ``--start-timeout`` or stalled (after ``--max-restarts`` restarts, one line each); 2 with
    one ``error:`` line for input that cannot work; 130 or 143 after Ctrl-C or SIGTERM. In every case the
    processes it started are gone when it returns, and if the launcher itself is killed, its watchdog ends them.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
        check_args(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_STATUS
    watchdog = _Watchdog()
    jobs = []
    def kill_now():   # atexit backstop: SIGKILL whatever is still running (the launcher is going away)
        for job in jobs:
            job.kill_now()
    atexit.register(kill_now)
    try:
        with _Signals() as signals:
            failure = None
            for restart in range(args.max_restarts + 1):
                job = None
                try:
                    start = _plan_start(args, restart, signals)
                    if failure is not None:
                        _write_line("stderr", f"restart {restart} of {args.max_restarts}: {failure}; starting "
                                              f"{start.num_workers} worker(s) again")
                    job = _Job(start, signals, watchdog)
                    jobs.append(job)
                    return job.run()
                except _Failure as e:
                    if job is not None:
                        job.stop()   # first, so that the error is the last line
                    if e.restartable and restart < args.max_restarts and signals.signum is None:
                        failure = e
                        continue
                    _write_line("stderr", f"error: {e}")
                    return e.status
                finally:
                    if job is not None:
                        job.stop()   # also when the launcher itself fails; a no-op when everything is stopped
    finally:
        atexit.unregister(kill_now)
        watchdog.close()


if __name__ == "__main__":
    sys.exit(main())
