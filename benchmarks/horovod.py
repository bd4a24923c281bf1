"""Against Horovod: a 2-worker ResNet-18 data-parallel epoch under this package's launcher and under Horovod, on
plain loopback, on a loopback shaped to 1 Gbit/s, and on simulated hosts (one a worker) at 1 Gbit/s or 100 Mbit/s.

Run from the repository root with the package's Python (Horovod lives in a venv of its own, ``--horovod-venv``, by
default ``../hvd-venv`` beside the repository; benchmarks/README.md, "Against Horovod", says how to make it; without
it the Horovod row is skipped and the table says why)::

    python benchmarks/horovod.py --data-dir digits --rounds 3
    python benchmarks/horovod.py --data-dir digits --rounds 3 \\
        --ours "default=" --ours "powersgd32=--compression powersgd:32"
    python benchmarks/horovod.py --dataset synthetic --train-size 64 --test-size 32 --batch-size 32 \\
        --networks plain --rounds 1 --out /tmp/results                   # a smoke run, a minute or two

Every configuration trains ResNet-18 (``parallel.models.resnet.init_resnet18(seed=0)``) for ``--epochs`` (1) on
the same data, in the same order, with the same global batch, SGD learning rate, momentum and weight decay, and
``OMP_NUM_THREADS=--threads`` (1) in every process:

- a row per ``--ours NAME=FLAGS`` (default ``default=``; FLAGS' leading ``VAR=VALUE`` words, as in a shell, set
  that row's environment, e.g. ``"p3=DMLC_PS_VAN_TYPE=p3 --bucket-mb 5"``): ``python -m parallel.launch -n W
  python -m parallel.train --model resnet18 --devices cpu:1 --data-dir DIR --epochs E --batch-size B --lr ..
  --momentum .. --wd .. --batchnorm-stats worker --no-progress --metrics-json PATH FLAGS`` (W workers and, the
  launcher's default, W servers; each worker's own BatchNorm statistics, as Horovod's, which has no SyncBatchNorm
  for MXNet); the
  epoch's seconds and images/s are those of rank 0's epoch line (``--metrics-json``);
- ``horovod``: ``horovodrun -np W --gloo -H localhost:W --network-interface lo PYTHON
  benchmarks/horovod_worker.py ... --compression C`` (``--horovod-venv``, or ``--horovodrun`` and
  ``--horovod-python``; ``--horovod-compression``), which trains the same model with
  ``horovod.mxnet.DistributedTrainer`` and counts the epoch the way ``parallel.fit`` does (its docstring says how
  each piece is matched);
- ``alone`` (``--alone``): the compute floor, ``--workers`` one-worker ``python -m parallel.train`` jobs at once
  (no launcher, no kvstore), each on its consecutive W-th of the training examples with batch B/W: what each
  worker of a data-parallel job computes, with nothing summed; its time is the slowest job's epoch, and it has no
  loss or accuracy (each job trains a model of its own).

Each ``--networks`` entry runs every configuration: ``plain`` on this machine's loopback; ``1gbit`` with the whole
job (launcher, scheduler, servers and workers, or horovodrun and its workers) inside a private network namespace
whose loopback is shaped: ``unshare -n sh -c 'ip link set lo up; tc qdisc add dev lo root tbf rate 1gbit burst
128kb latency 200ms; exec COMMAND'`` (needs root). That is one 1 Gbit/s pipe shared by every flow in both
directions, stricter than a full-duplex 1 Gbit/s link between two hosts. Before the first round a TCP stream of
100 MB through each network's loopback measures its rate (recorded and printed). ``hosts-1gbit`` and
``hosts-100mbit`` run each job on host 1 of a new simulated cluster (``benchmarks/cluster.py``, root: a network
namespace a host, each host's link shaped to that rate each way, a stand-in ssh over it): ours with ``--launcher
ssh`` (a worker and a server on each host), Horovod with ``-H ADDR:1,ADDR:1 --network-interface eth0`` over the
same ssh; each run records the bytes host 1's link carried each way (``link_bytes_host1``) and, for ours, the
launcher's ``--van auto:`` line (``launcher_said``: the link it measured and the transport it chose). On simulated
hosts the table gives each row's *link floor* (``link_floor``): the least seconds the timed epoch needs on a link of
that rate for the bytes every allreduce of that row's wire format must move, so that no schedule can beat it.
Configurations run in ``--rounds`` rounds, each round every (network, configuration) pair once in a fresh shuffled
order; the table gives medians over the rounds. Train loss and accuracy are the last epoch's (the runs are deterministic, so every
round gives the same).

Data: ``--data-dir`` (an MNIST-format directory, e.g. ``python benchmarks/digits_dataset.py --out digits``) or
``--dataset synthetic`` (``parallel.data.synthetic_dataset(seed=0)``, 60,000 + 10,000 examples);
``--train-size N``/``--batches N`` (N global batches) and ``--test-size M`` keep the first N/M examples, written
with ``parallel.data.write_idx`` to a temporary directory that both tools read.

Every job runs in a process group of its own, with ``--timeout`` seconds, and carries a unique marker in its
environment (inherited by everything it starts, also the processes horovodrun starts in sessions of their own):
on a timeout or an error the group is stopped (SIGTERM, SIGKILL after 10 s) and every process still carrying the
marker is SIGKILLed by its pid; after every run the driver gives the job's processes 10 s to be gone and SIGKILLs
any still there (recorded as ``left_behind``). While a job runs, the driver records every process of it with its
``DMLC_ROLE`` and ``OMP_NUM_THREADS``, and, read every ``POLL_SECONDS``, the CPU seconds they used by kind of role
(``cpu_seconds``) and the machine's over the run (``machine_cpu_seconds``, from ``/proc/stat``).
A job that fails ends the benchmark with status 1 and an ``error:`` line. Writes ``horovod.json`` (after every
run, atomically) to ``--out`` and prints a markdown table. Measures nothing itself and never imports MXNet.
"""
import argparse
import contextlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import cluster as simulated  # noqa: E402
import harness  # noqa: E402
from harness import BenchmarkError  # noqa: E402

THIS = os.path.abspath(__file__)
WORKER = os.path.join(harness.HERE, "horovod_worker.py")
#: Horovod's venv (``--horovod-venv``), relative to the repository's root: beside the repository.
HOROVOD_VENV = os.path.join(os.pardir, "hvd-venv")
#: How each network shapes its loopback (``tc qdisc add dev lo root ...``); None: the machine's loopback as it is.
LOOPBACKS = {"plain": None, "1gbit": "tbf rate 1gbit burst 128kb latency 200ms"}
#: Networks of simulated hosts (``benchmarks/cluster.py``): one host a worker, each link shaped to this rate each way.
HOSTS = {"hosts-1gbit": "1gbit", "hosts-100mbit": "100mbit"}
#: The same rates in bits a second, for the link floor (``link_floor``).
HOST_BITS = {"hosts-1gbit": 1e9, "hosts-100mbit": 1e8}
#: The most of a link's bytes that can be payload: TCP over IPv4 in the simulated hosts' 1500-byte-MTU Ethernet
#: frames carries at most 1460 bytes a 1514-byte frame (no TCP options; Linux's timestamps leave 1448), and tc counts
#: the whole frame against the rate.
PAYLOAD_SHARE = 1460 / 1514
#: Bytes on the wire per byte of float32 gradient, by compression (None, or another codec: not known here).
WIRE_SHARE = {"none": 1.0, "fp16": 0.5}
NETWORKS = [*LOOPBACKS, *HOSTS]
HOROVOD = "horovod"
#: The ``--alone`` row's name: each worker's compute with nothing summed (``alone_command``).
ALONE = "alone"
#: The environment variable that numbers an ``--alone`` job (the driver's record of its processes reads it).
ALONE_JOB = "PARALLEL_HOROVOD_BENCH_ALONE"
MARK = "PARALLEL_HOROVOD_BENCH_RUN"   # the environment variable that marks every process of one run
LINK_BYTES = 100 * 1000 * 1000
POLL_SECONDS = 0.5
#: Clock ticks a second, the unit of /proc's CPU times.
TICKS = os.sysconf("SC_CLK_TCK")
#: The fields of /proc/stat's ``cpu`` line the runs record (``machine_cpu``).
MACHINE_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
GRACE_SECONDS = 10.0


# ---- processes: a group each, a marker each, nothing left behind ------------------------------------------------

def _command(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def marked_processes(mark, known=None):
    """``{pid: {"role", "OMP_NUM_THREADS", "command"}}`` of the live processes whose environment holds
    ``MARK=mark`` (only this driver's runs set it): the launcher's scheduler, servers and workers carry their
    ``DMLC_ROLE``, Horovod's workers their ``HOROVOD_RANK``, ``--alone``'s jobs their number. ``known`` (a dict,
    updated): what an earlier call found of each pid (None: not marked) with its command line then, not read
    again while the command line stays the same (a process that ``exec``s, as the stand-in ssh's remote shell
    does into a worker, gets the environment and role of what it became)."""
    known = {} if known is None else known
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        pid, command = int(name), _command(name)
        if pid not in known or known[pid][0] != command:
            env = harness.proc_environ(name)
            if env is None:
                continue
            role = env.get("DMLC_ROLE") or ("horovod rank " + env["HOROVOD_RANK"] if "HOROVOD_RANK" in env else
                                            "alone job " + env[ALONE_JOB] if ALONE_JOB in env else "other")
            known[pid] = command, None if env.get(MARK) != mark else {
                "role": role, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "unset"), "command": command[:200]}
        if known[pid][1] is not None:
            found[pid] = known[pid][1]
    return found


def cpu_seconds(pid):
    """``(user, system)``: the CPU seconds process ``pid`` has used so far (``/proc/PID/stat``), or None when it is
    gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) / TICKS, int(fields[12]) / TICKS


def machine_cpu():
    """The CPU seconds this machine's cores have spent so far in each of ``MACHINE_FIELDS`` (``/proc/stat``)."""
    with open("/proc/stat") as f:
        values = f.readline().split()[1:1 + len(MACHINE_FIELDS)]
    return {field: int(value) / TICKS for field, value in zip(MACHINE_FIELDS, values)}


def _role_kind(role):
    """A process's role without its number: ``horovod rank 1`` -> ``horovod rank``."""
    return role.rstrip("0123456789").rstrip()


def cpu_by_role(processes, used):
    """``{role kind: {"user", "system", "processes"}}``: the CPU seconds ``used`` (``{pid: (user, system)}``) summed
    over the ``processes`` (``{pid: {"role", ...}}``) of each kind of role."""
    kinds = {}
    for pid, (user, system) in used.items():
        kind = kinds.setdefault(_role_kind(processes[pid]["role"]), {"user": 0.0, "system": 0.0, "processes": 0})
        kind["user"] += user
        kind["system"] += system
        kind["processes"] += 1
    return {role: dict(kind, user=round(kind["user"], 2), system=round(kind["system"], 2))
            for role, kind in kinds.items()}


def _kill_marked(mark, wait=0.0):
    """SIGKILL every process still carrying ``mark`` after ``wait`` seconds (those exiting by themselves, such as
    horovodrun's multiprocessing resource tracker once horovodrun is gone, get that long), by pid; returns what
    was killed."""
    deadline = time.monotonic() + wait
    left = marked_processes(mark)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = marked_processes(mark)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def stop(process, mark):
    """Stop a run: SIGTERM to its process group, SIGKILL after ``GRACE_SECONDS``, then SIGKILL by pid whatever
    still carries its marker (processes started in sessions of their own). Returns those processes."""
    harness.stop_group(process, GRACE_SECONDS)
    left = _kill_marked(mark)
    time.sleep(0.2 if left else 0)
    return left


def run_job(argv, env, cwd, timeout):
    """Run ``argv`` in a process group of its own with a fresh marker; returns its status, output, wall seconds,
    the processes seen while it ran and any left behind (ended), the CPU seconds its processes used by kind of role
    (``cpu_seconds``: each marked process's last reading, taken every ``POLL_SECONDS``, so a process's last
    fraction of a second is missed) and the machine's CPU seconds over the run by ``MACHINE_FIELDS``
    (``machine_cpu_seconds``: idle is what no process used). Raises ``BenchmarkError`` on a timeout."""
    mark = uuid.uuid4().hex
    env = dict(env, **{MARK: mark})
    seen, known, used = {}, {}, {}
    with open(os.path.join(cwd, "stdout.txt"), "w+") as out, open(os.path.join(cwd, "stderr.txt"), "w+") as err:
        started, machine = time.monotonic(), machine_cpu()
        process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        try:
            while True:
                try:
                    process.wait(timeout=POLL_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    seen.update(marked_processes(mark, known))
                    for pid in seen:
                        reading = cpu_seconds(pid)
                        if reading is not None:
                            used[pid] = reading
                    if time.monotonic() - started > timeout:
                        left = stop(process, mark)
                        raise BenchmarkError(f"{shlex.join(argv[:8])} ... timed out after {timeout:g} s (stopped its "
                                             f"process group, then ended {len(left)} process(es) outside it)"
                                             ) from None
        except BaseException:
            stop(process, mark)
            raise
        wall = time.monotonic() - started
        machine = {field: round(seconds - machine[field], 2) for field, seconds in machine_cpu().items()}
        left = _kill_marked(mark, wait=GRACE_SECONDS)
        out.seek(0)
        err.seek(0)
        return {"returncode": process.returncode, "stdout": out.read(), "stderr": err.read(), "wall_seconds": wall,
                "cpu_seconds": cpu_by_role(seen, used), "machine_cpu_seconds": machine,
                "processes": sorted(seen.values(), key=lambda p: p["role"]), "left_behind": list(left.values())}


# ---- networks -----------------------------------------------------------------------------------------------------

class Loopback:
    """Where a job of a loopback network runs: this machine (``wrap``, ``env``); it has no hosts."""

    hosts = None

    def __init__(self, network):
        self.network = network

    def wrap(self, argv):
        return wrap(self.network, argv)

    def env(self, env):
        return env

    def link_bytes(self):
        return None


class Hosts:
    """Where a job of a network of simulated hosts runs: host 1 of a new ``cluster.Cluster`` of ``workers`` hosts
    (a context manager), with the stand-in ssh on its ``PATH``; ``link_bytes`` is host 1's link's
    ``(sent, received)`` so far."""

    def __init__(self, network, workers):
        self.cluster = simulated.Cluster(workers, HOSTS[network])

    def __enter__(self):
        self.cluster.start()
        self.hosts = self.cluster.addresses
        self.hostfile = self.cluster.hostfile
        return self

    def __exit__(self, *exc):
        self.cluster.close()

    def wrap(self, argv):
        return self.cluster.wrap(argv, 1)

    def env(self, env):
        return self.cluster.env(env)

    def link_bytes(self):
        return self.cluster.link_bytes(1)


def place(network, workers):
    """A context manager giving where ``network``'s jobs run (``Loopback`` or ``Hosts``)."""
    return Hosts(network, workers) if network in HOSTS else contextlib.nullcontext(Loopback(network))


def wrap(network, argv):
    """``argv`` run inside ``network``: as it is for ``plain``, else in a new network namespace whose loopback is
    brought up and shaped with ``LOOPBACKS[network]``."""
    qdisc = LOOPBACKS[network]
    if qdisc is None:
        return list(argv)
    script = f'ip link set lo up && tc qdisc add dev lo root {qdisc} && exec "$@"'
    return ["unshare", "-n", "sh", "-c", script, "sh", *argv]


def network_problem(network):
    """Why ``network`` cannot be made here, or None."""
    if network in HOSTS:
        reason = simulated.unavailable()
        return None if reason is None else f"simulated hosts {reason}"
    if LOOPBACKS[network] is None:
        return None
    if os.geteuid() != 0:
        return "needs root (unshare -n, tc)"
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    return f"{', '.join(missing)} not found" if missing else None


def link_rate(nbytes):
    """Stream ``nbytes`` through a TCP connection on 127.0.0.1 (a sender thread, this receiver); the rate."""
    import socket
    import threading
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def send():
        with socket.create_connection(server.getsockname()) as s:
            chunk, sent = b"\0" * (1 << 20), 0
            while sent < nbytes:
                s.sendall(chunk[:nbytes - sent])
                sent += min(len(chunk), nbytes - sent)

    sender = threading.Thread(target=send)
    started = time.perf_counter()
    sender.start()
    connection, _ = server.accept()
    received = 0
    while True:
        data = connection.recv(1 << 20)
        if not data:
            break
        received += len(data)
    seconds = time.perf_counter() - started
    sender.join()
    connection.close()
    server.close()
    return {"bytes": received, "seconds": seconds, "gbit_per_s": received * 8 / seconds / 1e9}


def measure_link(network, env, tmp):
    """The loopback rate inside ``network`` (``link_rate`` run there), or ``{"skipped": reason}``."""
    problem = network_problem(network)
    if problem is not None:
        return {"skipped": problem}
    if network in HOSTS:   # each run counts the bytes on host 1's link instead
        return {"shaped": HOSTS[network] + " each way, a link a host"}
    cwd = tempfile.mkdtemp(prefix=f"link-{network}-", dir=tmp)
    result = run_job(wrap(network, [sys.executable, THIS, "--link-test", str(LINK_BYTES)]), env, cwd, 120)
    try:
        if result["returncode"] == 0:
            return harness.read_result(result["stdout"], "the link test")
    except BenchmarkError:
        pass
    return {"skipped": f"the network could not be made: {result['stderr'].strip()[-300:] or 'no result'}"}


# ---- data ---------------------------------------------------------------------------------------------------------

def prepare_data(args, tmp):
    """The MNIST-format directory both tools read, and its sizes: ``--data-dir`` as it is, or the first
    ``--train-size``/``--test-size`` examples of it (or of the synthetic set) written to ``tmp``."""
    from parallel.data import Dataset, load_idx_dataset, synthetic_dataset
    train_size = args.batches * args.batch_size if args.batches else args.train_size
    if args.data_dir is not None and train_size is None and args.test_size is None:
        dataset = load_idx_dataset(args.data_dir)
        return os.path.abspath(args.data_dir), len(dataset.train_labels), len(dataset.test_labels)
    if args.data_dir is not None:
        full = load_idx_dataset(args.data_dir)
    else:
        full = synthetic_dataset(num_train=train_size or 60000, num_test=args.test_size or 10000, seed=0)
    dataset = Dataset(full.train_images[:train_size], full.train_labels[:train_size],
                      full.test_images[:args.test_size], full.test_labels[:args.test_size])
    if not len(dataset.train_labels) or not len(dataset.test_labels):
        raise BenchmarkError("the data left no training or no test example")
    directory = harness.write_dataset(os.path.join(tmp, "data"), dataset)
    return directory, len(dataset.train_labels), len(dataset.test_labels)


def prepare_shards(args, data_dir, tmp):
    """The ``--alone`` jobs' directories: the training examples cut into ``--workers`` equal runs of consecutive
    examples (the last ``N mod W`` left out), each with the whole test set."""
    from parallel.data import Dataset, load_idx_dataset
    full, directories = load_idx_dataset(data_dir), []
    share = len(full.train_labels) // args.workers
    if not share:
        raise BenchmarkError(f"--alone: {len(full.train_labels)} training examples leave none to each of "
                             f"{args.workers} workers")
    for worker in range(args.workers):
        part = slice(worker * share, (worker + 1) * share)
        directories.append(harness.write_dataset(os.path.join(tmp, f"alone-{worker}"), Dataset(
            full.train_images[part], full.train_labels[part], full.test_images, full.test_labels)))
    return directories


# ---- the two tools' jobs ------------------------------------------------------------------------------------------

def _training_flags(args, data_dir):
    return ["--data-dir", data_dir, "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
            "--lr", repr(args.lr), "--momentum", repr(args.momentum), "--wd", repr(args.wd)]


def ours_command(args, data_dir, flags, metrics, where=None):
    """The package's job: the launcher with ``--workers`` workers, each ``parallel.train`` on one CPU context; on
    simulated hosts (``where``) with ``--launcher ssh``, a worker and a server on each host."""
    # over ssh the launcher sends only its own variables (parallel.launch.processes.FORWARDED): --env PYTHONPATH
    # makes each host's worker and server import this work tree's package (harness.child_env), not the one the
    # venv installed, which a checkout of other code (a worktree, a patch applied there) would silently leave out
    hosts = [] if where is None or where.hosts is None else [
        "--launcher", "ssh", "-H", where.hostfile, "--scheduler-host", where.hosts[0], "--env", "PYTHONPATH"]
    # each worker's own BatchNorm statistics, as Horovod's MXNet trainer has (it has no SyncBatchNorm for MXNet): the
    # same model on both sides; what the job's statistics cost is benchmarks/batchnorm.py's (a row may pass
    # --batchnorm-stats job, which comes later and wins)
    return [sys.executable, "-m", "parallel.launch", "-n", str(args.workers), *hosts, sys.executable, "-m",
            "parallel.train", "--model", "resnet18", "--devices", "cpu:1", *_training_flags(args, data_dir),
            "--batchnorm-stats", "worker", "--no-progress", "--metrics-json", metrics, *flags]


#: The ``--alone`` row's driver: ``python -c ALONE_DRIVER ARGVS_JSON`` starts every argv at once (each numbered in
#: ``ALONE_JOB``), waits for them all and exits with the first nonzero status.
ALONE_DRIVER = ("import json, os, subprocess, sys; "
                "jobs = [subprocess.Popen(argv, env=dict(os.environ, " + ALONE_JOB + "=str(n))) "
                "for n, argv in enumerate(json.loads(sys.argv[1]))]; "
                "codes = [job.wait() for job in jobs]; sys.exit(next((c for c in codes if c), 0))")


def alone_command(args, shards, metrics):
    """The ``--alone`` row's job: ``--workers`` single-worker ``parallel.train`` jobs at once (no launcher, no
    kvstore), job ``w`` on ``shards[w]`` with batch ``--batch-size / --workers`` and ``--metrics-json
    metrics[w]``: each does what one worker of a data-parallel job computes (its share of every global batch,
    forward, backward and the whole update), with nothing summed."""
    flags = _training_flags(args, "DATA")
    flags[flags.index("--batch-size") + 1] = str(args.batch_size // args.workers)
    argvs = [[sys.executable, "-m", "parallel.train", "--model", "resnet18", "--devices", "cpu:1",
              *[shard if flag == "DATA" else flag for flag in flags], "--no-progress", "--metrics-json", path]
             for shard, path in zip(shards, metrics)]
    return [sys.executable, "-c", ALONE_DRIVER, json.dumps(argvs)]


def horovod_command(args, data_dir, where=None):
    """Horovod's job: horovodrun (Gloo, on lo) with ``--workers`` workers, each ``horovod_worker.py``; on simulated
    hosts (``where``) one worker a host over ssh, on their links (``eth0``)."""
    hosts, interface = f"localhost:{args.workers}", "lo"
    if where is not None and where.hosts is not None:
        hosts, interface = ",".join(f"{address}:1" for address in where.hosts), "eth0"
    return [args.horovodrun, "-np", str(args.workers), "--gloo", "-H", hosts, "--network-interface", interface,
            "--start-timeout", "120", args.horovod_python, WORKER, *_training_flags(args, data_dir),
            "--compression", args.horovod_compression]


def horovod_problem(args):
    """Why the Horovod row cannot run here, or None."""
    if args.no_horovod:
        return "--no-horovod"
    for flag, path in (("--horovodrun", args.horovodrun), ("--horovod-python", args.horovod_python)):
        if not os.access(path, os.X_OK):
            return (f"{path} not found ({flag}): make Horovod's venv (--horovod-venv) as benchmarks/README.md says "
                    "('Against Horovod')")
    return None


def job_env(args):
    """The environment of every job: this one, the package on ``PYTHONPATH``, ``OMP_NUM_THREADS=--threads``, and
    the MXNet engine settings ``python -m parallel.train`` sets (``parallel.engine_settings``: 64 scratch copies,
    backward bulks of 2; a value already in the environment is kept), so that Horovod's workers run MXNet's engine
    as ours do."""
    from parallel.threads import engine_settings   # imports no MXNet
    env = harness.child_env(PYTHONUNBUFFERED="1")
    for name, value in engine_settings().items():
        if name != "OMP_NUM_THREADS":   # --threads sets it below
            env.setdefault(name, value)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def _epochs_of(config, result, metrics):
    """The job's per-epoch metrics: rank 0's ``--metrics-json`` (ours) or its ``RESULT`` line (Horovod); for
    ``--alone``, every epoch of the slowest job's seconds, with no loss or accuracy (each job trains a model of its
    own), and each job's epochs."""
    if config == ALONE:
        if result["returncode"] != 0 or not all(os.path.exists(path) for path in metrics):
            return None, {}
        jobs = []
        for path in metrics:
            with open(path) as f:
                jobs.append(json.load(f))
        epochs = [{"epoch": rows[0]["epoch"], "seconds": max(row["seconds"] for row in rows),
                   "images_per_second": None, "train_loss": None, "train_acc": None, "test_acc": None}
                  for rows in zip(*jobs)]
        return epochs, {"jobs": jobs}
    if config != HOROVOD:
        if result["returncode"] == 0 and os.path.exists(metrics):
            with open(metrics) as f:
                return json.load(f), {}
        return None, {}
    try:
        found = harness.read_result(result["stdout"], "horovod")
    except BenchmarkError:
        return None, {}
    return found.pop("epochs"), found


def run_config(args, network, config, data_dir, tmp):
    """One job of ``config`` in ``network``; its record. ``BenchmarkError`` when it fails."""
    cwd = tempfile.mkdtemp(prefix=f"{network}-{config}-", dir=tmp)
    metrics = os.path.join(cwd, "metrics.json")
    if config == ALONE:
        metrics = [os.path.join(cwd, f"metrics-{worker}.json") for worker in range(args.workers)]
    with place(network, args.workers) as where:
        if config == HOROVOD:
            argv = horovod_command(args, data_dir, where)
        elif config == ALONE:   # on host 1 of simulated hosts too: the jobs use no link
            argv = alone_command(args, args.shards, metrics)
        else:
            argv = ours_command(args, data_dir, args.ours[config][1], metrics, where)
        env = {**job_env(args), **(args.ours[config][0] if config in args.ours else {})}
        before = where.link_bytes()
        result = run_job(where.wrap(argv), where.env(env), cwd, args.timeout)
        after = where.link_bytes()
    link = None if before is None else {"sent": after[0] - before[0], "received": after[1] - before[1]}
    epochs, extra = _epochs_of(config, result, metrics)
    if result["returncode"] != 0 or not epochs:
        raise BenchmarkError(f"{config} on {network} failed (status {result['returncode']}): "
                             f"{(result['stderr'] + result['stdout']).strip()[-3000:]}")
    last = epochs[-1]
    record = {"network": network, "config": config, "argv": argv, "link_bytes_host1": link, "epochs": epochs,
              "seconds": last["seconds"], "images_per_second": last["images_per_second"],
              "train_loss": last["train_loss"], "train_acc": last["train_acc"], "test_acc": last["test_acc"],
              "wall_seconds": result["wall_seconds"], "cpu_seconds": result["cpu_seconds"],
              "machine_cpu_seconds": result["machine_cpu_seconds"], "processes": result["processes"],
              "left_behind": result["left_behind"], "worker_report": extra,
              "launcher_said": [line for line in result["stderr"].splitlines() if line.startswith("--van auto:")]}
    if result["left_behind"]:
        print(f"warning: {config} on {network} left {len(result['left_behind'])} process(es) behind; ended them",
              file=sys.stderr, flush=True)
    return record


# ---- the table ----------------------------------------------------------------------------------------------------

def summarize(result):
    """One row per (network, configuration): medians over the rounds, the time against Horovod's on the same
    network, or why the row was skipped."""
    rows, n_train = [], result["data"]["train_examples"]
    for network in result["settings"]["networks"]:
        link = result["links"][network]
        if "skipped" in link:
            rows.append({"network": network, "config": "every configuration", "skipped": link["skipped"]})
            continue
        for config in result["configs"]:
            runs = [run for run in result["runs"] if run["network"] == network and run["config"] == config]
            if config == HOROVOD and result["horovod_skipped"]:
                rows.append({"network": network, "config": config, "skipped": result["horovod_skipped"]})
                continue
            seconds = harness.median(run["seconds"] for run in runs)
            rows.append({"network": network, "config": config, "runs": len(runs), "seconds": seconds,
                         "images_per_second": n_train / seconds, "link_floor": link_floor(result, network, config),
                         **{key: None if config == ALONE else harness.median(run[key] for run in runs)
                            for key in ("train_loss", "train_acc", "test_acc")}})
    harness.add_ratios([row for row in rows if "seconds" in row], group=lambda row: row["network"],
                       reference=lambda row: row["config"] == HOROVOD, value="seconds", field="vs_horovod")
    return rows


def _wire_share(result, config):
    """What share of the float32 gradients ``config`` sends (``WIRE_SHARE``), or None where its codec's bytes
    depend on more than the codec (top-k, PowerSGD, a warm-up before compressing)."""
    if config == HOROVOD:
        return WIRE_SHARE.get(result["settings"].get("horovod_compression", "none"))
    flags = result["settings"]["ours"][config][1]
    codec = flags[flags.index("--compression") + 1] if "--compression" in flags else "none"
    return None if "--compression-warmup" in flags and codec != "none" else WIRE_SHARE.get(codec)


def link_floor(result, network, config):
    """The least seconds host 1's link needs to carry the timed epoch's sums one way, or None: for each sum every
    worker must send, and receive, 2 (W - 1) / W of the gradients' bytes (a bandwidth-optimal allreduce's share: a
    ring's, or a parameter server's with one server a host), at the link's shaped rate (``HOST_BITS``) of which at
    most ``PAYLOAD_SHARE`` is payload. The epoch, timed as ``parallel.fit`` times it (and the Horovod worker as
    fit), ends when its last step's loss is read, before that step's gradients are summed: it holds one sum fewer
    than steps, each needed before the next step's forward. No schedule of the same bytes can end it sooner. The
    gradients' bytes are read from a row of ours (``--metrics-json``'s memory: its gradients, which a cross barrier's
    split parameters do not double), the same model as every row's; None
    off simulated hosts, or for a codec whose bytes are not known here (``_wire_share``)."""
    share = _wire_share(result, config) if network in HOST_BITS and config != ALONE else None
    if share is None:
        return None
    sizes = [run["epochs"][-1]["memory"][0]["gradients"] for run in result["runs"]
             if run["network"] == network and run["config"] != HOROVOD and run["epochs"][-1].get("memory")]
    if not sizes:
        return None
    settings = result["settings"]
    workers, steps = settings["workers"], math.ceil(result["data"]["train_examples"] / settings["batch_size"])
    return (steps - 1) * 2 * (workers - 1) / workers * sizes[0] * share * 8 / (HOST_BITS[network] * PAYLOAD_SHARE)


def format_table(result):
    """The markdown table of ``result["rows"]``, with the links' measured rates and the threads seen."""
    rounds = result["settings"]["rounds"]
    lines = [f"| link (measured) | configuration | s/epoch (median of {rounds}) | images/s | time vs Horovod | "
             f"link floor, s | train loss | train acc | test acc |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        link = result["links"][row["network"]]
        where = row["network"] + (f" ({link['gbit_per_s']:.2f} Gbit/s)" if "gbit_per_s" in link else "")
        if "skipped" in row:
            lines.append(f"| {where} | {row['config']} | skipped: {row['skipped']} | | | | | | |")
            continue
        ratio = f"{row['vs_horovod']:.2f}x" if "vs_horovod" in row else "n/a"
        floor = "n/a" if row.get("link_floor") is None else f"{row['link_floor']:.2f}"
        model = " | ".join("n/a" if row[key] is None else f"{row[key]:.3f}"
                           for key in ("train_loss", "train_acc", "test_acc"))
        lines.append(f"| {where} | {row['config']} | {row['seconds']:.2f} | {row['images_per_second']:.1f} | "
                     f"{ratio} | {floor} | {model} |")
    threads = {}
    for run in result["runs"]:
        for process in run["processes"]:
            if process["role"] == "worker" or process["role"].startswith(("horovod rank", "alone job")):
                threads.setdefault(run["config"], set()).add(process["OMP_NUM_THREADS"])
    seen = "; ".join(f"{config}: {', '.join(sorted(values))}" for config, values in threads.items())
    data = result["data"]
    lines.append("")
    lines.append(f"{result['settings']['workers']} workers, ResNet-18, {data['train_examples']} training examples "
                 f"({data['source']}), global batch {result['settings']['batch_size']}, {result['settings']['epochs']}"
                 f" epoch(s); time vs Horovod: s/epoch over Horovod's on the same link (below 1: faster); link "
                 f"floor: the least s/epoch any schedule of the row's bytes needs on the link (2 (W-1)/W of the "
                 f"gradients each way for each sum the epoch waits for, one fewer than its steps, at the shaped "
                 f"rate, at most 1460 bytes of each 1514-byte frame; n/a off simulated hosts or for a codec whose "
                 f"bytes vary); "
                 + (f"{ALONE}: {result['settings']['workers']} one-worker jobs at once, each on its share of the "
                    f"examples and of each batch, nothing summed (the slowest job's epoch; each trains a model of its "
                    f"own); " if ALONE in result["configs"] else "") +
                 f"OMP_NUM_THREADS seen in the workers: {seen or 'none recorded'}; Horovod's compression: "
                 f"{result['settings'].get('horovod_compression', 'none')}")
    return "\n".join(lines)


def write_json(result, out):
    """Write ``result`` to ``out/horovod.json`` atomically; return the path."""
    return harness.write_json(os.path.join(out, "horovod.json"), result)


# ---- the command --------------------------------------------------------------------------------------------------

_ENV_WORD = re.compile(r"[A-Z_][A-Z0-9_]*=")


def _ours(text):
    """``NAME=FLAGS`` as ``(name, (env, flags))``: FLAGS' leading ``VAR=VALUE`` words (as a shell reads them)
    set the job's environment, the rest are ``parallel.train`` flags."""
    name, sep, flags = text.partition("=")
    if not sep or not name.strip() or name.strip() in (HOROVOD, ALONE):
        raise argparse.ArgumentTypeError(f"expected NAME=FLAGS with a NAME other than {HOROVOD!r} and {ALONE!r}, e.g. "
                                         f"'powersgd32=--compression powersgd:32', got {text!r}")
    words, env = shlex.split(flags), {}
    while words and _ENV_WORD.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return name.strip(), (env, words)


def parse_args(argv=None):
    """The benchmark's arguments (``--ours`` become ``{name: (env, flags)}``, default ``{"default": ({}, [])}``)."""
    parser = harness.ArgumentParser(description=__doc__.split("\n")[0])
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--data-dir", type=harness.mnist_dir, help="an MNIST-format directory, e.g. the digits (benchmarks/digits_dataset.py)")
    data.add_argument("--dataset", choices=["synthetic"], help="parallel.data.synthetic_dataset(seed=0)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--train-size", type=int, default=None, metavar="N", help="keep the first N training examples")
    size.add_argument("--batches", type=int, default=None, metavar="N", help="keep N global batches of them")
    parser.add_argument("--test-size", type=int, default=None, metavar="M", help="keep the first M test examples")
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch (default 64)")
    parser.add_argument("--lr", type=float, default=0.02, help="SGD's learning rate (default 0.02)")
    parser.add_argument("--momentum", type=float, default=0.9, help="default 0.9")
    parser.add_argument("--wd", type=float, default=0.0, help="weight decay (default 0)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs a job (default 1); the table times the last")
    parser.add_argument("--workers", type=int, default=2, help="workers a job (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process (default 1; 0 "
                                                               "leaves the environment's)")
    parser.add_argument("--networks", action=harness.CommaList, names=NETWORKS, default=list(NETWORKS),
                        metavar="NAME,...",
                        help=f"of {', '.join(NETWORKS)} (default all)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--ours", type=_ours, action="append", default=None, metavar="NAME=FLAGS",
                        help="a row of the package: its name and its extra parallel.train flags (repeatable; "
                             "default: 'default=')")
    parser.add_argument("--horovod-venv", default=None, metavar="DIR",
                        help=f"Horovod's venv (benchmarks/README.md says how to make it); default {HOROVOD_VENV} "
                             "beside the repository, wherever the command runs")
    parser.add_argument("--horovodrun", default=None, help="default: bin/horovodrun in --horovod-venv")
    parser.add_argument("--horovod-python", default=None, help="default: python beside --horovodrun")
    parser.add_argument("--no-horovod", action="store_true", help="skip the Horovod row")
    parser.add_argument("--alone", action="store_true",
                        help=f"add a row {ALONE!r}: --workers one-worker jobs at once, each on its share of the "
                             "examples and of each batch, nothing summed: the compute every data-parallel schedule "
                             "does on this machine")
    parser.add_argument("--horovod-compression", choices=["none", "fp16"], default="none",
                        help="the Horovod row's gradient compression (hvd.Compression; default none): fp16 to set "
                             "it against an --ours row with --compression fp16")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds a job may take (default 7200)")
    harness.add_out(parser, "horovod.json")
    parser.add_argument("--link-test", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.link_test is None:
        _check_args(parser, args)
    return args


def _check_args(parser, args):
    if args.data_dir is None and args.dataset is None:
        parser.error("give --data-dir DIR or --dataset synthetic")
    for flag in ("train_size", "batches", "test_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if min(args.batch_size, args.epochs, args.workers, args.rounds) < 1 or args.threads < 0 or args.timeout <= 0:
        parser.error("--batch-size, --epochs, --workers and --rounds must be >= 1, --threads >= 0, --timeout > 0")
    if args.alone and args.batch_size % args.workers:
        parser.error(f"--alone: --batch-size {args.batch_size} must be a multiple of --workers {args.workers}")
    ours = args.ours or [("default", ({}, []))]
    if len({name for name, _ in ours}) != len(ours):
        parser.error("every --ours needs a name of its own")
    args.ours = dict(ours)
    args.horovod_venv = os.path.abspath(args.horovod_venv or os.path.join(harness.ROOT, HOROVOD_VENV))
    args.horovodrun = os.path.abspath(args.horovodrun or os.path.join(args.horovod_venv, "bin", "horovodrun"))
    args.horovod_python = os.path.abspath(args.horovod_python or os.path.join(os.path.dirname(args.horovodrun),
                                                                              "python"))


def run_rounds(args, result, data_dir, tmp):
    """Every (network, configuration) pair once a round, in a fresh shuffled order; JSON after every run."""
    pairs = [(network, config) for network in args.networks if "skipped" not in result["links"][network]
             for config in result["configs"] if not (config == HOROVOD and result["horovod_skipped"])]
    for number, order in enumerate(harness.round_orders(pairs, args.rounds), 1):
        result["order"].append([f"{network}/{config}" for network, config in order])
        for network, config in order:
            record = run_config(args, network, config, data_dir, tmp)
            result["runs"].append(dict(record, round=number))
            write_json(result, args.out)
            loss = "" if record["train_loss"] is None else f", loss {record['train_loss']:.3f}"
            print(f"round {number}/{args.rounds}: {config} on {network}: {record['seconds']:.2f} s/epoch{loss}",
                  file=sys.stderr, flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.link_test is not None:
        harness.report_result(link_rate(args.link_test))
        return 0
    from importlib.metadata import version
    result = {"command": "python benchmarks/horovod.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
              "settings": {key: value for key, value in vars(args).items() if key != "link_test"},
              "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                          "mxnet": version("mxnet")},
              "configs": list(args.ours) + [ALONE] * args.alone + [HOROVOD], "links": {}, "order": [], "runs": [],
              "horovod_skipped": harness.portable(horovod_problem(args))}   # the table shows a reader's path
    try:
        with tempfile.TemporaryDirectory(prefix="horovod-bench-") as tmp:
            data_dir, n_train, n_test = prepare_data(args, tmp)
            args.shards = prepare_shards(args, data_dir, tmp) if args.alone else []
            result["data"] = {"source": args.data_dir or args.dataset, "train_examples": n_train,
                              "test_examples": n_test}
            for network in args.networks:
                result["links"][network] = measure_link(network, job_env(args), tmp)
            run_rounds(args, result, data_dir, tmp)
    except BenchmarkError as e:
        result["error"] = str(e)
        write_json(result, args.out)
        print(f"error: {e}", file=sys.stderr)
        return 1
    result["rows"] = summarize(result)
    result["table"] = format_table(result)
    path = write_json(result, args.out)
    print(result["table"])
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(harness.command(main))
