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
``i`` need not have rank ``i``. Once a worker prints ``joined the job as rank R of W`` (``python -m
parallel.train`` does), its lines are ``[rank R] `` instead. A text a worker ends with a lone carriage return
(a progress bar redrawn) is drawn in place when the launcher's output is a terminal, and dropped otherwise;
workers get ``PARALLEL_PROGRESS=1`` or ``0`` to say which, and ``python -m parallel.train`` draws rank 0's bar
alone, only when it is 1. Workers get ``PYTHONUNBUFFERED=1`` (unless set) so that their lines arrive
as they are printed.

Local mode (the default) runs everything on 127.0.0.1, the scheduler and the servers as ``python -m
parallel.launch.server`` (ps-lite's loop, what ``python -c "import mxnet"`` runs with ``DMLC_ROLE`` set, through
MXNet's C API without importing its Python package: ``parallel.launch.server``), and, unless ``OMP_NUM_THREADS``
is set, splits the cores between the workers and servers. Each process is the leader of its own process group,
so the launcher can stop what it spawns.

ssh mode runs the scheduler here and each worker and server on a host of the hostfile (round robin), as ``ssh
-tt host 'cd <cwd> && exec env DMLC_...=... <command>'``; the hosts need this directory and this Python, with
this package, at the same paths (a shared file system or identical images), and only the ``DMLC_*`` variables,
the ``--env`` ones and ``PYTHONUNBUFFERED`` reach them. ``-tt`` gives the remote command a terminal, so that
when the launcher kills the local ssh the remote side gets SIGHUP and ends too (without it, it would run on);
the price is that a remote process's stderr arrives merged into its stdout.

The launcher itself never imports MXNet, so nothing in it can block in ps-lite.

The package: ``cli`` (the parser, ``check_args``, ``main``), ``hosts`` (hostfile, discovery script, reachable
hosts, the scheduler's address and port), ``processes`` (the plan of each start, ssh command lines, process
groups), ``server`` (a scheduler's or server's process), ``watchdog``, ``job`` (one start of the job,
supervised) and ``restarts`` (the restart policy, a pure function); ``python -m parallel.launch`` runs
``__main__``. The names re-exported here load their module on first use (``parallel.lazy``), as the other
packages' do."""
from ..cli import UsageError
from ..lazy import lazy_exports

_SOURCES = {
    "cli": ["main", "build_parser", "check_args"],
    "hosts": ["parse_hostfile"],
    "processes": ["plan_processes", "ssh_argv"],
    "job": ["START_LINE"],
}
__all__ = [name for names in _SOURCES.values() for name in names] + ["UsageError"]
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
