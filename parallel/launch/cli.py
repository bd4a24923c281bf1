"""The command ``python -m parallel.launch``: its parser and argument types (``-n N|MIN:MAX``), ``check_args``,
and ``main``, which starts the job and starts it again for as long as ``restarts.decide`` says."""
import argparse
import atexit
import os
import re
import sys
import uuid

from ..cli import USAGE_STATUS, Parser, UsageError
from ..files import MANIFEST as CHECKPOINT_MANIFEST
from ..handover import StateServer
from .hosts import check_port, default_scheduler_host, free_port, parse_hostfile
from .job import Job, Signals, plan_start, write_line
from .processes import default_servers
from .restarts import HOSTS_CHANGED, INTERRUPTED, PROCESS_FAILED, SUCCESS, Cooldowns, Failure, decide
from .watchdog import Watchdog

__all__ = ["main", "build_parser", "check_args", "MAX_SECONDS"]

#: The longest time a SEC flag takes (about 11 days): a wait of inf or 1e12 seconds cannot be waited for (Python's
#: waits overflow past threading.TIMEOUT_MAX), and so long a wait could not tell a stuck job anyway.
MAX_SECONDS = 1e6


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
                        help="number of servers (>= 1); default: as many as workers, or with --launcher ssh one on "
                             "each host that runs a worker")
    parser.add_argument("--launcher", choices=["local", "ssh"], default="local",
                        help="local: every process on this machine; ssh: workers and servers on the hostfile's "
                             "hosts; default local")
    parser.add_argument("--van", choices=["auto", "zmq", "p3"], default="auto",
                        help="ps-lite's transport: p3 (MXNet's P3: every key cut in slices sent by priority, the "
                             "first layers' first) or zmq (ps-lite's default); auto: for python -m parallel.train on "
                             "several hosts, each host's link is measured over ssh at the start (16 MiB, at most "
                             "1 s a host), p3 if the slowest carries under 300 Mbit/s, where it was measured "
                             "faster, zmq otherwise and for other commands (P3 refuses MXNet's own server-side "
                             "updates and compression); DMLC_PS_VAN_TYPE in the environment or --env wins; "
                             "default auto")
    parser.add_argument("-H", "--hostfile", default=None,
                        help="ssh: a file with one host[:ssh port] a line (# comments and blank lines ignored); "
                             "with -n MIN:MAX it is read again every --discovery-interval seconds while the job "
                             "runs, and a host added (within MAX) or removed starts the job again")
    parser.add_argument("--env", action="append", default=[], metavar="NAME[:VALUE]",
                        help="set NAME to VALUE for every worker and server, or pass NAME's value from this "
                             "environment (with ssh, for a variable not sent by itself: only MXNET_*, OMP_*, "
                             "KMP_*, PS_*, DMLC_*, PARALLEL_* and PYTHONHASHSEED/PYTHONUNBUFFERED are); repeatable")
    parser.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                        help="ssh: an option passed as 'ssh -o KEY=VALUE', e.g. IdentityFile=~/.ssh/id_job; "
                             "repeatable")
    parser.add_argument("--scheduler-host", default=None,
                        help="ssh: the address of this machine the hosts can reach (default 127.0.0.1 when every "
                             "host is local, else the address of this machine's host name)")
    parser.add_argument("--port", type=int, default=None,
                        help="the scheduler's port (default: a free port the launcher picks)")
    _add_watch_flags(parser)
    parser.add_argument("--host-discovery-script", default=None, metavar="COMMAND",
                        help="a shell command that prints the available hosts, one host[:ssh port] a line, one "
                             "worker each (Horovod's elastic discovery): run at every start and every "
                             "--discovery-interval seconds while the job runs; a host that joins (within -n "
                             "MIN:MAX) or leaves starts the job again on the hosts listed, from the state a live "
                             "worker committed in memory; with --launcher local every host must be this machine")
    parser.add_argument("--discovery-interval", type=float, default=1.0, metavar="SEC",
                        help="how often the --host-discovery-script runs (or an elastic job's hostfile is read) "
                             "while the job runs; default 1")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command every worker runs, e.g. python my_kvstore_script.py --epochs 5")
    parser.set_defaults(restart=0)   # which start of the job the arguments plan (plan_start sets it)
    parser.set_defaults(link_mbit=None)   # the slowest link this start measured (Job.measure_links), if any
    parser.set_defaults(state_address=None)   # an elastic job: where the launcher serves the state taken last
    return parser


def _add_watch_flags(parser):
    """How the launcher watches the job: its timeouts, the grace of a stop, the restarts."""
    parser.add_argument("--start-timeout", type=float, default=60.0, metavar="SEC",
                        help="end the job unless every worker and server has connected to the scheduler within "
                             "SEC seconds (at most 1000000); default 60")
    parser.add_argument("--stall-timeout", type=float, default=0.0, metavar="SEC",
                        help="end the job when no worker has printed a line for SEC seconds (at most 1000000); "
                             "default 0 (off). Workers whose collectives disagree (one a step short) end the job "
                             "without it, with a diagnosis from their flight records")
    parser.add_argument("--host-timeout", type=float, default=60.0, metavar="SEC",
                        help="ssh: end the job when a host has not answered ssh's keepalives for SEC seconds (a host "
                             "lost or cut off; a busy host still answers); with --max-restarts the job starts again "
                             "on the hosts that answer; 0 turns it off (at most 1000000); default 60")
    parser.add_argument("--grace", type=float, default=5.0, metavar="SEC",
                        help="when stopping processes: SIGTERM, then SIGKILL after SEC seconds (at most 1000000; inf "
                             "is refused); default 5")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="R",
                        help="when a process of the job fails or dies, stop the job and start it again, up to R "
                             "times (each worker gets PARALLEL_RESTART=r; python -m parallel.train then resumes "
                             "from its --checkpoint-dir); a worker that exits with status 2 (its input cannot "
                             "work) is not restarted; default 0")
    parser.add_argument("--host-cooldown", type=float, default=60.0, metavar="SEC",
                        help="ssh: a host whose processes failed twice is left out of the job for SEC seconds, "
                             "twice as long each time again (Horovod's blacklist cooldown); 0 never leaves a host "
                             "out; default 60")
    parser.add_argument("--reset-limit", type=int, default=None, metavar="N",
                        help="end an elastic job once its hosts changed N times (Horovod's --reset-limit); "
                             "default no limit")


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
    if args.reset_limit is not None and args.reset_limit < 0:
        raise UsageError(f"--reset-limit must be >= 0, got {args.reset_limit}")
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
    _check_seconds(args)
    for item in args.env:
        name = item.split(":", 1)[0]
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UsageError(f"--env {item!r}: {name!r} is not an environment variable name")
        _warn_if_unset(item)
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
        args.scheduler_host = args.scheduler_host or default_scheduler_host(args.hosts)
        if not args.fixed_servers and args.hosts:
            args.num_servers = default_servers(args.hosts, args.num_workers)
    else:
        for flag, value in (("-H/--hostfile", args.hostfile), ("--ssh-option", args.ssh_option or None),
                            ("--scheduler-host", args.scheduler_host)):
            if value is not None:
                raise UsageError(f"{flag} applies to --launcher ssh; add --launcher ssh to run on other hosts")
        args.hosts, args.scheduler_host = [("127.0.0.1", None)], "127.0.0.1"
    args.job = uuid.uuid4().hex[:16]   # the same at every start (JOB_ENV)
    args.cooldowns = Cooldowns(args.host_cooldown)   # hosts left out after failing, shared by every start
    args.fresh_port = args.port is None   # a restarted job gets a fresh port too
    if args.port is None:
        args.port = free_port()
    else:
        check_port(args.port)


def _check_seconds(args):
    """Raise ``UsageError`` unless the SEC flags are waits the launcher can make: 0 .. ``MAX_SECONDS``."""
    if not args.start_timeout > 0:
        raise UsageError(f"--start-timeout must be > 0 seconds, got {args.start_timeout}")
    if not args.stall_timeout >= 0:
        raise UsageError(f"--stall-timeout must be >= 0 seconds (0 turns it off), got {args.stall_timeout}")
    if not args.host_timeout >= 0:
        raise UsageError(f"--host-timeout must be >= 0 seconds (0 turns it off), got {args.host_timeout}")
    if not args.discovery_interval > 0:
        raise UsageError(f"--discovery-interval must be > 0 seconds, got {args.discovery_interval}")
    if not args.host_cooldown >= 0:
        raise UsageError(f"--host-cooldown must be >= 0 seconds (0 never leaves a host out), got {args.host_cooldown}")
    if not args.grace >= 0:
        raise UsageError(f"--grace must be >= 0 seconds, got {args.grace}")
    for flag, seconds in (("--start-timeout", args.start_timeout), ("--stall-timeout", args.stall_timeout),
                          ("--host-timeout", args.host_timeout), ("--grace", args.grace),
                          ("--discovery-interval", args.discovery_interval), ("--host-cooldown", args.host_cooldown)):
        if not seconds <= MAX_SECONDS:
            raise UsageError(f"{flag} must be at most {MAX_SECONDS:.0f} seconds (11 days), got {seconds}")


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


def main(argv=None):
    """Entry point of ``python -m parallel.launch``; returns the process exit status.

    0 when every worker exited with 0; 1 with one ``error:`` line on stderr when a process failed, the job did
    not start within ``--start-timeout`` or stalled (after ``--max-restarts`` restarts, one line each); 2 with
    one ``error:`` line for input that cannot work, the launcher's or a worker's (a process that exits with 2,
    ``python -m parallel.train``'s status for bad input, is not restarted); 130 or 143 after Ctrl-C or SIGTERM.
    In every case the processes it started are gone when it returns, and if the launcher itself is killed, its
    watchdog ends them.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
        check_args(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_STATUS
    watchdog = Watchdog()
    jobs = []
    def kill_now():   # atexit backstop: SIGKILL whatever is still running (the launcher is going away)
        for job in jobs:
            job.kill_now()
    atexit.register(kill_now)
    relay = StateServer() if args.elastic else None   # the state taken from a live worker, for the next start
    try:
        with Signals() as signals:
            return _run(args, signals, watchdog, jobs, relay)
    finally:
        atexit.unregister(kill_now)
        watchdog.close()
        if relay is not None:
            relay.close()


def _run(args, signals, watchdog, jobs, relay=None):
    """Start the job, and again after each start that ``restarts.decide`` restarts; returns the exit status.
    Every start is stopped before the next line is printed, so that an error is the last line. In an elastic job
    (``relay``, a ``StateServer``), the newest state a live worker committed is taken before a start that did not
    succeed is stopped, and the next start resumes from it."""
    starts, restarts, changes, decision = 0, 0, 0, None
    while True:
        job, ending = None, None
        try:
            try:
                start = plan_start(args, starts, signals)
            except Failure:
                if decision is not None:   # what ended the last start, before the line that ends the job
                    write_line("stderr", f"{decision.line}; too few hosts to start again")
                raise
            if decision is not None:
                write_line("stderr", decision.restart_line(start.num_workers))
            job = Job(start, signals, watchdog)
            jobs.append(job)
            ending = job.run()
        except Failure as e:
            ending = e.ending
        finally:
            if job is not None:
                if relay is not None and ending is not None and ending.kind != SUCCESS and signals.signum is None:
                    _keep_state(job, relay, args)
                job.stop()   # also when the launcher itself fails; a no-op when everything is stopped
        decision = decide(ending, restarts, args.max_restarts, interrupted=signals.signum is not None,
                          changes=changes, reset_limit=args.reset_limit)
        left_out = args.cooldowns.failed(ending.host) if ending.kind == PROCESS_FAILED else None
        if left_out is not None and decision.restart:
            write_line("stderr", left_out)
        if not decision.restart:
            if decision.line is not None:
                hint = resume_hint(args.command) if ending.kind == INTERRUPTED else None
                write_line("stderr", decision.line + (f"; {hint}" if hint else ""))
            return decision.status
        starts += 1
        changes += ending.kind == HOSTS_CHANGED
        restarts += ending.kind != HOSTS_CHANGED   # a change of hosts is the job working, not a failure


def _warn_if_unset(item):
    """One line for ``--env NAME`` where NAME is not set here: it passes nothing (a typo, or a missing export)."""
    if ":" not in item and item not in os.environ:
        print(f"warning: --env {item}: {item} is not set here, so nothing is passed; give {item}:VALUE to set it",
              file=sys.stderr, flush=True)


def resume_hint(command):
    """For ``python -m parallel.train`` with a ``--checkpoint-dir`` that holds a checkpoint (seen from here), how
    to go on from it; None for any other command.

    >>> resume_hint(["python", "-m", "parallel.train", "--checkpoint-dir", "/nonexistent"]) is None
    True
    """
    try:
        if command[command.index("-m") + 1] != "parallel.train":
            return None
    except (ValueError, IndexError):   # no -m, or nothing after it
        return None
    directory = None   # read by hand: the launcher sits below parallel.train and may not import its parser
    for i, word in enumerate(command):
        if word == "--checkpoint-dir" and i + 1 < len(command):
            directory = command[i + 1]
        elif word.startswith("--checkpoint-dir="):
            directory = word.split("=", 1)[1]
    if directory is None or not os.path.isfile(os.path.join(directory, CHECKPOINT_MANIFEST)):
        return None
    how = "run the same command again" if "--resume" in command else "add --resume to the training command"
    return f"the checkpoint in {directory} goes on from where it stopped: {how}"


def _keep_state(job, relay, args):
    """Take the newest state a live worker of ``job`` committed into ``relay``, and point the next starts at it
    (``args.state_address``); keep the one taken before if no worker gives one."""
    taken = job.hand_over()
    if taken is not None:
        relay.commit(*taken)
        args.state_address = f"{args.scheduler_host}:{relay.port}"
