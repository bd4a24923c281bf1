"""The processes of one start of the launcher's job: the plan (scheduler, servers, workers), their environment
and ssh command lines, and their process groups (signal one, wait until it is gone)."""
import os
import shlex
import sys
import time

from ..cli import RESTART_ENV
from ..flight import ENV as FLIGHT_ENV

__all__ = ["Spec", "plan_processes", "ssh_argv", "user_wants_ps_log", "kill_group", "wait_group_gone",
           "GROUP_GONE_SECONDS"]

GROUP_GONE_SECONDS = 2.0


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
    list of Spec
        Local ones (``host`` None) carry the variables to add to this environment; remote ones carry the
        whole ssh command line in ``argv``.
    """
    common = {"DMLC_PS_ROOT_URI": args.scheduler_host, "DMLC_PS_ROOT_PORT": str(args.port),
              "DMLC_NUM_SERVER": str(args.num_servers), "DMLC_NUM_WORKER": str(args.num_workers),
              RESTART_ENV: str(getattr(args, "restart", 0))}
    extra = _extra_env(args)
    scheduler_env = dict(common, DMLC_ROLE="scheduler", DMLC_NODE_HOST=args.scheduler_host, OMP_NUM_THREADS="1")
    if not user_wants_ps_log():
        scheduler_env["PS_VERBOSE"] = "2"   # the start line, and each registration (to name who is missing)
    specs = [Spec("scheduler", 0, None, None, [sys.executable, "-c", "import mxnet"], scheduler_env)]
    threads = {} if "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in extra else {
        "OMP_NUM_THREADS": str(_omp_threads(args.num_workers + args.num_servers))}
    unbuffered = {} if "PYTHONUNBUFFERED" in os.environ else {"PYTHONUNBUFFERED": "1"}
    for role, count, command in (("server", args.num_servers, [sys.executable, "-c", "import mxnet"]),
                                 ("worker", args.num_workers, list(args.command))):
        for i in range(count):
            host, ssh_port = args.hosts[i % len(args.hosts)]
            env = dict(common, DMLC_ROLE=role, DMLC_NODE_HOST=host, **unbuffered)
            if role == "worker":   # publish the flight record on stderr, for the launcher's diagnosis
                env[FLIGHT_ENV] = "1"
            if args.launcher == "local":
                specs.append(Spec(role, i, None, None, command, dict(env, **threads, **extra)))
            else:
                argv = ssh_argv(host, ssh_port, dict(env, **extra), command, os.getcwd(), args.ssh_option)
                specs.append(Spec(role, i, host, ssh_port, argv, {}))
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
