"""The processes of one start of the launcher's job: the plan (scheduler, servers, workers), their environment
and ssh command lines, and their process groups (signal one, wait until it is gone)."""
import collections
import os
import select
import shlex
import signal
import subprocess
import sys
import time

from ..cli import HOSTS_ENV, JOB_ENV, PROGRESS_ENV, RESTART_ENV
from ..flight import ENV as FLIGHT_ENV
from ..handover import ELASTIC_ENV, STATE_ENV

__all__ = ["Spec", "is_terminal", "plan_processes", "ssh_argv", "user_wants_ps_log", "kill_group",
           "wait_group_gone", "GROUP_GONE_SECONDS", "FORWARDED", "forwarded_env", "worker_hosts", "default_servers", "server_hosts",
           "keepalive_options", "SERVER_COMMAND", "van_type", "P3_BELOW_MBIT", "p3_suits", "probe_link",
           "link_probe_argv", "hosts_to_probe"]

GROUP_GONE_SECONDS = 2.0

#: The scheduler's and each server's command: ps-lite's loop through MXNet's C API (``parallel.launch.server``),
#: what ``python -c "import mxnet"`` runs at the end of MXNet's import, without the import's 2.5 s of a core.
SERVER_COMMAND = [sys.executable, "-m", "parallel.launch.server"]

#: What of the launcher's environment reaches every process on another host (ssh mode), where sshd starts each
#: command in a fresh environment: the variables that change how MXNet, its OpenMP, ps-lite and this package run
#: (names beginning so), as a local process inherits them. Everything else passes with ``--env`` only.
FORWARDED = ("MXNET_", "OMP_", "KMP_", "PS_", "DMLC_", "PARALLEL_", "PYTHONHASHSEED", "PYTHONUNBUFFERED")


def _omp_threads(num_processes):
    """Threads per worker or server when ``num_processes`` of them share this machine's cores (>= 1).

    >>> _omp_threads(1) >= 1, _omp_threads(10 ** 6)
    (True, 1)
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // num_processes)


def user_wants_ps_log():
    """Whether the user set ``PS_VERBOSE`` >= 1: then the scheduler keeps that level and its log is forwarded
    as is; otherwise the launcher sets 2 for the scheduler alone and hides what it does not need."""
    level = os.environ.get("PS_VERBOSE", "").strip()
    return level.isdigit() and int(level) >= 1


class Spec:
    """One process to start: its role, launch index, host (None: here), argv and extra environment."""

    def __init__(self, role, index, host, ssh_port, argv, env):
        self.role, self.index, self.host, self.ssh_port, self.argv, self.env = role, index, host, ssh_port, argv, env

    @property
    def name(self):
        return "scheduler" if self.role == "scheduler" else f"{self.role} {self.index}"


def forwarded_env(environ=None):
    """The variables of ``environ`` (default this process's) that ``FORWARDED`` sends to other hosts.

    >>> forwarded_env({"MXNET_CPU_TEMP_COPY": "64", "OMP_NUM_THREADS": "2", "HOME": "/root", "PATH": "/bin"})
    {'MXNET_CPU_TEMP_COPY': '64', 'OMP_NUM_THREADS': '2'}
    """
    environ = os.environ if environ is None else environ
    return {name: value for name, value in environ.items() if name.startswith(FORWARDED)}


def worker_hosts(hosts, num_workers):
    """Where each of ``num_workers`` workers runs: the hosts of a hostfile (or of discovery) in turn.

    >>> worker_hosts([("h1", None), ("h2", None)], 3)
    [('h1', None), ('h2', None), ('h1', None)]
    """
    return [hosts[i % len(hosts)] for i in range(num_workers)]


def default_servers(hosts, num_workers, launcher="ssh"):
    """How many servers a job of ``num_workers`` on ``hosts`` gets unless ``-s`` says: with ``launcher`` ssh one
    on each host that runs a worker (BytePS's and ps-lite's own placement: every host's link carries its share of
    the sums, and a host's workers reach one server without crossing it); local, as many as workers.

    >>> default_servers([("h1", None), ("h2", None)], 4), default_servers([("h1", None), ("h2", None)], 1)
    (2, 1)
    >>> default_servers([("127.0.0.1", None)], 3, "local")
    3
    """
    return len(set(worker_hosts(hosts, num_workers))) if launcher == "ssh" else num_workers


def server_hosts(hosts, num_servers):
    """Where each of ``num_servers`` servers runs: the distinct hosts of ``hosts`` (the workers', in order), one
    server each in turn, so that the servers of a job spread over its hosts.

    >>> server_hosts([("h1", None), ("h1", None), ("h2", 22)], 3)
    [('h1', None), ('h2', 22), ('h1', None)]
    """
    distinct = list(dict.fromkeys(hosts))
    return [distinct[i % len(distinct)] for i in range(num_servers)]


def keepalive_options(host_timeout, options=()):
    """The ``-o`` options that make ssh give up on a host that stops answering within ``host_timeout`` seconds:
    a probe every quarter of it, the fourth unanswered one ends ssh with status 255 (OpenSSH's
    ``ServerAliveInterval``/``ServerAliveCountMax``); none when it is 0 or the user gave ``ServerAliveInterval``.

    >>> keepalive_options(60)
    ['ServerAliveInterval=15', 'ServerAliveCountMax=3']
    >>> keepalive_options(60, ["ServerAliveInterval=5"]), keepalive_options(0)
    ([], [])
    """
    if not host_timeout or any(o.lower().startswith("serveraliveinterval=") for o in options):
        return []
    return [f"ServerAliveInterval={host_timeout / 4:g}", "ServerAliveCountMax=3"]


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


#: ``--van auto`` runs ``python -m parallel.train`` across hosts on MXNet's P3 when the slowest link the launcher
#: measured at the start carries less than this many Mbit/s, on ps-lite's ZeroMQ van otherwise. On two simulated
#: hosts (ResNet-18, benchmarks/README.md "P3 across hosts") P3's epoch was 0.72-0.77x ZeroMQ's at 100 Mbit/s and
#: 1.10-1.13x at 1 Gbit/s; nothing in between was measured, so the threshold sits between the two.
P3_BELOW_MBIT = 300

#: A link probe reads at most this many bytes from a host, for at most this many seconds once they flow.
PROBE_BYTES, PROBE_SECONDS = 16 << 20, 1.0


def van_type(args, hosts, extra, link_mbit=None):
    """The ``DMLC_PS_VAN_TYPE`` the launcher sets for a job on ``hosts`` hosts (``--van``), or None: the user's own
    (``DMLC_PS_VAN_TYPE`` in this environment or ``--env``, ``extra``), or ps-lite's default. ``auto``: for
    ``python -m parallel.train`` across several hosts, whose keys ``parallel.job.Job`` numbers for it, P3 unless
    ``link_mbit``, the slowest link measured (``probe_link``), is ``P3_BELOW_MBIT`` or more.

    >>> from types import SimpleNamespace as Args
    >>> train = ["python", "-m", "parallel.train"]
    >>> van_type(Args(van="auto", command=train), 2, {}), van_type(Args(van="auto", command=train), 1, {})
    ('p3', None)
    >>> van_type(Args(van="auto", command=train), 2, {}, 95.0), van_type(Args(van="auto", command=train), 2, {}, 940.0)
    ('p3', None)
    >>> van_type(Args(van="auto", command=["python", "x.py"]), 2, {}), van_type(Args(van="zmq", command=train), 2, {})
    (None, 'zmq')
    >>> van_type(Args(van="p3", command=train), 2, {"DMLC_PS_VAN_TYPE": "zmq"})
    """
    if "DMLC_PS_VAN_TYPE" in extra or "DMLC_PS_VAN_TYPE" in os.environ:
        return None
    if args.van != "auto":
        return args.van
    command = list(args.command)
    train = any(a == "-m" and b == "parallel.train" for a, b in zip(command, command[1:]))
    return "p3" if hosts > 1 and train and p3_suits(link_mbit) else None


def p3_suits(link_mbit):
    """Whether ``--van auto`` takes P3 for a slowest link of ``link_mbit`` Mbit/s (None: not measured, P3)."""
    return link_mbit is None or link_mbit < P3_BELOW_MBIT


def _places(args):
    """Where the job's servers and workers run (``{"server": [(host, ssh_port), ...], "worker": [...]}``), how many
    of them each host runs, and how many hosts the gradients cross between (1 for the local launcher)."""
    workers = worker_hosts(args.hosts, args.num_workers)
    places = {"server": server_hosts(workers, args.num_servers), "worker": workers}
    sharing = collections.Counter(host for role in places for host, _ in places[role])
    return places, sharing, (len(sharing) if args.launcher != "local" else 1)


def hosts_to_probe(args):
    """The distinct ``(host, ssh_port)`` whose links decide ``--van auto`` for this start (``van_type``), in order:
    none unless the job spans hosts and auto would choose by the link."""
    places, _, hosts = _places(args)
    if args.van != "auto" or van_type(args, hosts, _extra_env(args)) != "p3":
        return []
    return list(dict.fromkeys(places["server"] + places["worker"]))


def link_probe_argv(host, port, options=(), nbytes=PROBE_BYTES):
    """The ssh command line that has ``host`` send a line, then ``nbytes`` zero bytes (no terminal: ``-T``)."""
    return ["ssh", "-T", *_ssh_options(port, list(options) + ["ConnectTimeout=10"]), host,
            f"echo && head -c {int(nbytes)} /dev/zero"]


def probe_link(argv, nbytes=PROBE_BYTES, seconds=PROBE_SECONDS, connect_seconds=15.0):
    """Mbit/s of what ``argv`` (``link_probe_argv``) sends here after its first line: the bytes that came within
    ``seconds`` of it (at most ``nbytes``) over the time they took, so ssh's handshake is not counted. None when
    the command cannot start, sends no line within ``connect_seconds``, or nothing after it. The command runs in
    a process group of its own, killed before this returns.

    >>> import sys
    >>> sends = ("import sys, time; o = sys.stdout.buffer; o.write(bytes([10])); o.flush(); time.sleep(0.1); "
    ...          "o.write(bytes(1 << 20))")
    >>> probe_link([sys.executable, "-c", sends]) > 0
    True
    >>> probe_link([sys.executable, "-c", "raise SystemExit(255)"]) is None
    True
    """
    try:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        return None
    fd, received, started = process.stdout.fileno(), 0, None
    try:
        deadline = time.monotonic() + connect_seconds
        while received < nbytes:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                break
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            if started is None:   # the first line: the bytes come from now on (what came with it is not timed)
                if b"\n" in chunk:
                    started = time.monotonic()
                    deadline = started + seconds
                continue
            received += len(chunk)
        elapsed = time.monotonic() - started if started is not None else 0
        return received * 8 / elapsed / 1e6 if received and elapsed > 0 else None
    finally:
        kill_group(process.pid, signal.SIGKILL)
        process.stdout.close()
        process.wait()


def is_terminal(stream):
    """Whether ``stream`` is a terminal (False for one replaced by an object without ``isatty``, or closed)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # replaced or closed
        return False


def plan_processes(args):
    """The scheduler, servers and workers to start for checked ``args``, in that order.

    Returns
    -------
    list of Spec
        Local ones (``host`` None) carry the variables to add to this environment; remote ones carry the
        whole ssh command line in ``argv``.
    """
    places, sharing, hosts = _places(args)   # hosts: where the gradients travel, the workers' and servers'
    common = {"DMLC_PS_ROOT_URI": args.scheduler_host, "DMLC_PS_ROOT_PORT": str(args.port),
              "DMLC_NUM_SERVER": str(args.num_servers), "DMLC_NUM_WORKER": str(args.num_workers),
              RESTART_ENV: str(args.restart), JOB_ENV: args.job, HOSTS_ENV: str(hosts),
              PROGRESS_ENV: "1" if is_terminal(sys.stderr) else "0"}   # rank 0's bar, relayed to a terminal
    if args.elastic:   # every worker commits in memory and serves its commits; a start after a change resumes
        common[ELASTIC_ENV] = "1"
        if args.state_address is not None:
            common[STATE_ENV] = args.state_address
    extra = _extra_env(args)
    van = van_type(args, hosts, extra, args.link_mbit)
    if van is not None:   # every process of the job: the scheduler, the servers and the workers use one van
        common["DMLC_PS_VAN_TYPE"] = van
    scheduler_env = dict(common, DMLC_ROLE="scheduler", DMLC_NODE_HOST=args.scheduler_host, OMP_NUM_THREADS="1")
    if (van or extra.get("DMLC_PS_VAN_TYPE") or os.environ.get("DMLC_PS_VAN_TYPE")) == "p3":
        # The scheduler carries no gradients, only the job's control messages, and on P3 it can lose some: P3's
        # van queues every message for one sending thread, which takes equal priorities in any order (ps-lite's
        # ThreadsafePQueue compares with <=) and stops at the TERMINATE the scheduler sends itself as it ends, so
        # replies to the job's last barrier queued behind it are never sent. Seen once in a 100 Mbit/s benchmark:
        # the scheduler gone, every worker and server waiting in ps-lite's Finalize. P3's van is ZeroMQ's with
        # that queue in front: the two speak the same messages.
        scheduler_env["DMLC_PS_VAN_TYPE"] = "zmq"
    if not user_wants_ps_log():
        scheduler_env["PS_VERBOSE"] = "2"   # the start line, and each registration (to name who is missing)
    specs = [Spec("scheduler", 0, None, None, SERVER_COMMAND, scheduler_env)]
    threads = {} if "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in extra else {
        "OMP_NUM_THREADS": str(_omp_threads(args.num_workers + args.num_servers))}
    unbuffered = {} if "PYTHONUNBUFFERED" in os.environ else {"PYTHONUNBUFFERED": "1"}
    forwarded = forwarded_env()
    options = list(args.ssh_option) + keepalive_options(args.host_timeout, args.ssh_option)
    for role, command in (("server", SERVER_COMMAND), ("worker", list(args.command))):
        for i, (host, ssh_port) in enumerate(places[role]):
            env = dict(common, DMLC_ROLE=role, DMLC_NODE_HOST=host, **unbuffered)
            if role == "worker":   # publish the flight record on stderr, for the launcher's diagnosis
                env[FLIGHT_ENV] = "1"
            if args.launcher == "local":
                specs.append(Spec(role, i, None, None, command, dict(env, **threads, **extra)))
            else:
                remote = dict(forwarded, **env, **extra)
                argv = ssh_argv(host, ssh_port, remote, command, os.getcwd(), options,
                                share=None if "OMP_NUM_THREADS" in remote else sharing[host])
                specs.append(Spec(role, i, host, ssh_port, argv, {}))
    return specs


def _ssh_options(port, options=()):
    """ssh's options for every session the launcher opens: ``options`` (``KEY=VALUE``) first, so they override the
    defaults ``BatchMode=yes`` (never prompt) and ``StrictHostKeyChecking=accept-new``; then ``-p port``."""
    argv = []
    for option in list(options) + ["BatchMode=yes", "StrictHostKeyChecking=accept-new"]:
        argv += ["-o", option]
    return argv + (["-p", str(port)] if port is not None else [])


def ssh_argv(host, port, env, command, cwd, options=(), share=None):
    """The ssh command line that runs ``command`` in ``cwd`` on ``host`` with ``env``, every word quoted.

    ``-tt`` forces a terminal on the remote side: when the local ssh is killed, the remote command gets
    SIGHUP and ends (without a terminal it would keep running). ``options`` (``KEY=VALUE``) come first, so they
    override the defaults ``BatchMode=yes`` (never prompt) and ``StrictHostKeyChecking=accept-new``. With
    ``share`` (how many of the job's processes run on that host), ``OMP_NUM_THREADS`` is that host's cores
    (``nproc``, read there) divided between them, at least 1, as the local launcher divides its own.

    >>> ssh_argv("node1", 2222, {"DMLC_ROLE": "worker"}, ["python", "my script.py"], "my job")[-2:]
    ['node1', "cd 'my job' && exec env DMLC_ROLE=worker python 'my script.py'"]
    >>> ssh_argv("node1", None, {}, ["python"], "job", share=2)[-1]
    'cd job && exec env "OMP_NUM_THREADS=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))" python'
    """
    argv = ["ssh", "-tt", *_ssh_options(port, options)]
    assignments = [shlex.quote(f"{name}={value}") for name, value in env.items()]
    if share is not None:
        assignments.append(f'"OMP_NUM_THREADS=$(( $(nproc) / {int(share)} > 0 ? $(nproc) / {int(share)} : 1 ))"')
    remote = " ".join([f"cd {shlex.quote(cwd)} && exec env", *assignments, *map(shlex.quote, command)])
    return argv + [host, remote]


def kill_group(pid, sig):
    """Send ``sig`` to the process group ``pid`` leads, if it is still there."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_group_gone(pgid, timeout=GROUP_GONE_SECONDS):
    """Wait (up to ``timeout``) until no process of group ``pgid`` is left; a killed grandchild is reaped by
    init, which may take a moment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.02)
