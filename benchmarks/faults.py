"""What a job on two simulated hosts does under each fault: whether it survives, how soon the launcher notices, what
it costs, and what is left on each host afterwards.

Every run is one LeNet job of ``python -m parallel.train --devices cpu:1`` on ``--data-dir`` under
``python -m parallel.launch --launcher ssh -n 1:2`` on a new two-host cluster of ``benchmarks/cluster.py`` (a
network namespace a host, a 1 Gbit/s link each, the stand-in ssh; root only): a worker and a server a host, the
scheduler with the launcher on host 1, hosts named by ``--host-discovery-script "cat FILE"``, ``--max-restarts 2``,
``--host-timeout``, a checkpoint every 10 steps into a shared ``--checkpoint-dir`` and the model exported at the end.
First the job uninterrupted (the reference), then once per scenario, the fault injected once the ``epoch 2,`` line
is printed. The job is elastic (``-n 1:2`` with a discovery script): its workers commit their state in memory at
every step, and the launcher starts the job again from a live worker's state when a host joins, leaves or fails.

- ``host-joined``: the job started on host 1 alone; discovery names host 2 too;
- ``host-lost``: discovery no longer names host 2, and every process on it is SIGKILLed, its link down;
- ``link-outage``: host 2's link down for ``--outage`` seconds (default half of ``--host-timeout``), then up
  again: a job that rides it out (no restart) exports the very model of the uninterrupted run;
- ``partition``: host 2's link down for good, its processes alive, discovery no longer naming it;
- ``server-killed``: the parameter server on host 2 (``DMLC_ROLE=server``) SIGKILLed, discovery naming both;
- ``scheduler-host-lost``: host 1 lost, the launcher and the scheduler with it; how long until nothing is left
  on host 2 (the sshd drops sessions whose client went silent), then a new launch on host 2 alone with
  ``--resume`` from the same checkpoint directory.

For each: the launcher's exit status, its restarts and its one-line reason, the checkpoint the job resumed from,
the seconds from the fault to the launcher's first line about it (``restart ...`` or ``error: ...``, printed once
it has stopped what was left of that start, ``--grace 2``), the job's seconds against the uninterrupted run's, and
the processes left on each host after the launcher exited (and how long until none was). Run from the repository
root, as root (about 4 minutes)::

    python benchmarks/digits_dataset.py --out digits
    python benchmarks/faults.py --data-dir digits
    python benchmarks/faults.py --data-dir digits --scenarios partition,server-killed --host-timeout 6

It writes ``faults.json`` to ``--out`` (default ``benchmarks/results``) and prints the table.
"""
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py and cluster.py, beside this script
import cluster as simulated  # noqa: E402
import harness  # noqa: E402
from harness import BenchmarkError  # noqa: E402

#: The faults, in the order they run.
SCENARIOS = ("host-joined", "host-lost", "link-outage", "partition", "server-killed", "scheduler-host-lost")
#: The run every scenario is compared with.
REFERENCE = "uninterrupted"
#: The training flags of every job (besides ``--data-dir`` and ``--epochs``): batches of 32 (16 a worker), a
#: checkpoint every 10 steps into ``ckpt``, the model exported as ``lenet``.
TRAIN = ["--devices", "cpu:1", "--batch-size", "32", "--lr", "0.1", "--momentum", "0.9", "--seed", "3",
         "--no-progress", "--checkpoint-dir", "ckpt", "--checkpoint-every", "10", "--export", "lenet"]
#: The exported parameters of a job (``--export lenet``).
PARAMS = "lenet-0000.params"
#: The line a fault waits for: epoch 2 ended.
EPOCH_2 = re.compile(r"\] epoch 2, loss ")
#: A worker's line that tells where a run resumed.
RESUMED = re.compile(r"resuming from [^:]+: epoch (\d+), after (\d+) batch")
#: The launcher's line when an elastic job's hosts changed (not a restart).
CHANGED = re.compile(r"^the job's hosts changed: ")
#: How long the hosts are watched for what is left after a job: three times what the stand-in sshd keeps a
#: session whose client went silent.
CLEANUP_SECONDS = 3 * simulated.CLIENT_ALIVE_SECONDS


class Launched:
    """The launcher started on host ``host`` of ``cluster`` in ``cwd``, in a session of its own: its output lines,
    each with the ``time.monotonic()`` it arrived at, as they come."""

    def __init__(self, cluster, argv, cwd, host=1):
        self.started = time.monotonic()
        self.process = cluster.popen(argv, host=host, env=harness.child_env(), cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines, self.closed, self.changed = [], 0, threading.Condition()
        self.ended = self.status = None
        self.readers = [threading.Thread(target=self._read, args=(pipe, name), daemon=True)
                        for pipe, name in ((self.process.stdout, "out"), (self.process.stderr, "err"))]
        for reader in self.readers:
            reader.start()

    def _read(self, pipe, name):
        for line in pipe:
            with self.changed:
                self.lines.append((time.monotonic(), name, line.rstrip("\n")))
                self.changed.notify_all()
        with self.changed:
            self.closed += 1
            self.changed.notify_all()

    def first(self, pattern, after=0.0, stream=None):
        """``(time, line)`` of the first line from ``after`` on that ``pattern`` (a regex) finds, on ``stream``
        (``"out"``, ``"err"``, None: either); None when there is none."""
        with self.changed:
            for at, name, line in self.lines:
                if at >= after and stream in (None, name) and re.search(pattern, line):
                    return at, line
        return None

    def wait_for(self, pattern, timeout):
        """The time of the first line that ``pattern`` finds, once it came.

        Raises
        ------
        BenchmarkError
            When none came within ``timeout`` seconds or before the launcher's output ended.
        """
        with self.changed:
            self.changed.wait_for(lambda: self.first(pattern) is not None or self.closed == 2, timeout)
        found = self.first(pattern)
        if found is None:
            tail = " | ".join(line for _, _, line in self.lines[-8:])
            raise BenchmarkError(f"the job printed no line like {pattern.pattern!r} within {timeout:g} s: {tail}")
        return found[0]

    def finish(self, timeout):
        """Wait for the launcher's exit (its process group stopped after ``timeout`` seconds: status None); its
        status, once its output ended too."""
        try:
            self.status = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            harness.stop_group(self.process)
        self.ended = time.monotonic()
        for reader in self.readers:
            reader.join(30)
        return self.status

    def stop(self):
        """Stop the launcher and its process group if it still runs (``harness.stop_group``)."""
        if self.process.poll() is None:
            harness.stop_group(self.process)


def write_discovery(path, cluster, hosts):
    """Write the discovery file ``path`` (``--host-discovery-script "cat PATH"``): the addresses of ``hosts``
    (their 1-based numbers)."""
    with open(path, "w") as f:
        f.write("".join(f"{cluster.host(i).address}\n" for i in hosts))


def launch(cluster, args, work, hosts, host=1, extra=()):
    """Start the job on ``cluster``: the launcher (and its scheduler) on host ``host``, the workers on ``hosts``
    (discovery), in directory ``work``; ``extra`` flags added to the training command. A ``Launched``."""
    discovery = os.path.join(work, f"discovered-h{host}")
    write_discovery(discovery, cluster, hosts)
    argv = [sys.executable, "-m", "parallel.launch", "--launcher", "ssh", "-n", "1:2", "--scheduler-host",
            cluster.host(host).address, "--host-discovery-script", f"cat {shlex.quote(discovery)}",
            "--max-restarts", "2", "--grace", "2", "--stall-timeout", "300", "--host-timeout",
            f"{args.host_timeout:g}", "--env", "PYTHONPATH",
            sys.executable, "-m", "parallel.train", "--data-dir", os.path.abspath(args.data_dir), "--epochs",
            str(args.epochs), *TRAIN, *extra]
    return Launched(cluster, argv, work, host)


def _command_of(pid):
    """Process ``pid``'s command line, shortened (``?`` when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().decode("utf-8", "replace").split("\0")
    except OSError:
        return "?"
    return harness.portable(" ".join(words).strip())[:100]


def left_behind(cluster, lost, since, limit=CLEANUP_SECONDS):
    """What is left on each host (but for its sshd) from ``since`` (a ``time.monotonic()``) on: for each host not
    in ``lost`` (its number: ``{"lost": True}``), the commands there at once (``at_start``), the seconds after
    ``since`` until none was (``gone_after_s``; None when some were still there ``limit`` seconds later) and what
    was left then (``still_left``)."""
    hosts = [i for i in range(1, len(cluster.hosts) + 1) if i not in lost]
    found = {f"h{i}": {"lost": True} for i in lost}
    for i in hosts:
        found[f"h{i}"] = {"at_start": [_command_of(pid) for pid in cluster.processes(i)], "gone_after_s": None}
    waiting = set(hosts)
    while waiting:
        for i in sorted(waiting):
            if not cluster.processes(i):
                found[f"h{i}"]["gone_after_s"] = max(0.0, time.monotonic() - since)
                waiting.discard(i)
        if not waiting or time.monotonic() - since > limit:
            break
        time.sleep(0.2)
    for i in waiting:
        found[f"h{i}"]["still_left"] = [_command_of(pid) for pid in cluster.processes(i)]
    return found


def outcome(job, fault):
    """What the finished ``job`` did, and when, counted from ``fault`` (a ``time.monotonic()``; None for the
    uninterrupted run): its status, restarts and their reason, where it resumed, and its seconds."""
    after = fault if fault is not None else job.started
    restarts = [line for at, name, line in job.lines if name == "err" and line.startswith("restart ")]
    changes = [line for at, name, line in job.lines if name == "err" and CHANGED.match(line)]
    noticed = job.first(r"^(restart |error: )|stopped answering|" + CHANGED.pattern, after, stream="err")
    resumed = job.first(RESUMED.pattern, after)
    record = {"status": job.status, "timed_out": job.status is None, "finished": job.status == 0,
              "restarts": len(restarts), "restart_lines": restarts, "changes": changes,
              "error": next((line for _, name, line in job.lines if name == "err" and line.startswith("error: ")),
                            None),
              "job_s": job.ended - job.started, "fault_at_s": None if fault is None else fault - job.started,
              "noticed_s": None, "noticed_line": None, "resumed_from": None, "resumed_s": None}
    if fault is not None:
        record["finished_after_fault_s"] = job.ended - fault
    if noticed is not None and fault is not None:
        record["noticed_s"], record["noticed_line"] = noticed[0] - fault, noticed[1]
    if resumed is not None:
        epoch, batch = RESUMED.search(resumed[1]).groups()
        record["resumed_from"] = {"epoch": int(epoch), "batch": int(batch),
                                  "in_memory": "committed in memory" in resumed[1]}
        record["resumed_s"] = resumed[0] - after
    record["timeline"] = [[round(at - job.started, 2), line] for at, _, line in job.lines
                          if re.search(r"\] epoch \d+, loss|^restart |^error: |resuming from|exported |"
                                       r"^took the state|" + CHANGED.pattern, line)]
    return record


# ---- the faults: each injects its own into a running job; the fault's time and what it adds to the record -----

def _host_joined(cluster, args, work):
    write_discovery(os.path.join(work, "discovered-h1"), cluster, [1, 2])
    return time.monotonic(), {}


def _host_lost(cluster, args, work):
    write_discovery(os.path.join(work, "discovered-h1"), cluster, [1])
    fault = time.monotonic()
    cluster.kill_host(2)
    return fault, {}


def _link_outage(cluster, args, work):
    outage = args.outage
    fault = time.monotonic()
    cluster.cut(2)
    time.sleep(outage)
    cluster.heal(2)
    return fault, {"outage_s": outage}


def _partition(cluster, args, work):
    write_discovery(os.path.join(work, "discovered-h1"), cluster, [1])
    fault = time.monotonic()
    cluster.cut(2)
    return fault, {"default_host_timeout_s": args.default_host_timeout}


def _server_killed(cluster, args, work):
    servers = [pid for pid in cluster.processes(2) if (harness.proc_environ(pid) or {}).get("DMLC_ROLE") == "server"]
    if len(servers) != 1:
        raise BenchmarkError(f"expected one server on h2, found {len(servers)}")
    fault = time.monotonic()
    os.kill(servers[0], signal.SIGKILL)
    return fault, {"server_pid": servers[0]}


def _scheduler_host_lost(cluster, args, work):
    fault = time.monotonic()
    cluster.kill_host(1)
    return fault, {}


#: Each scenario: its fault, and the hosts it loses for good (nothing is measured there afterwards).
FAULTS = {"host-joined": (_host_joined, set()), "host-lost": (_host_lost, {2}), "link-outage": (_link_outage, set()), "partition": (_partition, set()),
          "server-killed": (_server_killed, set()), "scheduler-host-lost": (_scheduler_host_lost, {1})}


def default_host_timeout():
    """``--host-timeout``'s default, as ``python -m parallel.launch --help`` gives it (seconds)."""
    out, _ = harness.run_process([sys.executable, "-m", "parallel.launch", "--help"], env=harness.child_env(),
                                 timeout=120)
    flag = re.search(r"^ +--host-timeout SEC(.*?)^ +-", out, re.S | re.M)   # its help, up to the next flag's
    found = flag and re.search(r"default\s+(\d+(?:\.\d+)?)", flag.group(1))
    if found is None:
        raise BenchmarkError("python -m parallel.launch --help gives no default of --host-timeout")
    return float(found.group(1))


def same_model(path, reference):
    """Whether the exported parameters at ``path`` equal the ``reference`` file's: ``(same bytes, the largest
    absolute difference of any element)``, the second None when a file is missing or they differ in names."""
    if not (os.path.exists(path) and os.path.exists(reference)):
        return False, None
    with open(path, "rb") as f, open(reference, "rb") as g:
        if f.read() == g.read():
            return True, 0.0
    import mxnet as mx
    got, want = mx.nd.load(path), mx.nd.load(reference)
    if sorted(got) != sorted(want):
        return False, None
    return False, max(float((got[name] - want[name]).abs().max().asscalar()) for name in want)


def resume_on_host_2(cluster, args, work):
    """After host 1 was lost: a new launch on host 2 alone (its scheduler there too) with ``--resume`` from the
    same checkpoint directory; what it did."""
    job = launch(cluster, args, work, [2], host=2, extra=["--resume"])
    try:
        job.finish(args.timeout)
    finally:
        job.stop()
    record = outcome(job, None)
    record["left"] = left_behind(cluster, {1}, time.monotonic())
    return record


def measure(args, name, keep):
    """One run: the job on a new two-host cluster, ``name``'s fault injected after epoch 2 (none for
    ``REFERENCE``); its record. The reference's exported parameters are kept in ``keep``."""
    inject, lost = FAULTS.get(name, (None, set()))
    with tempfile.TemporaryDirectory(prefix="faults-") as work, simulated.Cluster(2, "1gbit") as cluster:
        job, fault, extra = launch(cluster, args, work, [1] if name == "host-joined" else [1, 2]), None, {}
        try:
            if inject is not None:
                job.wait_for(EPOCH_2, args.timeout)
                fault, extra = inject(cluster, args, work)
            job.finish(args.timeout)
        finally:
            job.stop()
        record = {"scenario": name, **outcome(job, fault), **extra}
        since = fault if name == "scheduler-host-lost" else job.ended
        record["left_since"] = "the fault" if since == fault else "the job's end"
        record["left"] = left_behind(cluster, lost, since)
        for found in record["left"].values():
            if fault is not None and found.get("gone_after_s") is not None:
                found["gone_after_fault_s"] = found["gone_after_s"] + since - fault
        exported = os.path.join(work, PARAMS)
        if name == REFERENCE and os.path.exists(exported):
            shutil.copy(exported, os.path.join(keep, PARAMS))
        if name == "link-outage":
            record["same_model"], record["max_abs_difference"] = same_model(exported, os.path.join(keep, PARAMS))
        if name == "scheduler-host-lost":
            record["resume"] = resume_on_host_2(cluster, args, work)
            wait = record["left"]["h2"]["gone_after_s"]
            record["total_s"] = record["fault_at_s"] + (wait or 0.0) + record["resume"]["job_s"]
    return record


# ---- the table -------------------------------------------------------------------------------------------------

def _reason(line):
    """A restart or error line's reason, short: what ended the start, up to its first ``;``."""
    text = re.sub(r"^(restart \d+ of \d+|error): ", "", line)
    return text.split("; ")[0]


def describe(record):
    """The table's "what the job did" of one record."""
    if record.get("timed_out"):
        did = "timed out (stopped)"
    elif record["finished"]:
        did = "finished"
    else:
        did = f"failed (exit {record['status']})"
    if record["scenario"] == "scheduler-host-lost":
        did = f"launcher killed with h1 (exit {record['status']})"
    parts = [did] if "outage_s" not in record else [f"h2's link down {record['outage_s']:g} s", did]
    if record.get("changes"):
        parts.append(f"{len(record['changes'])} change(s) of hosts: "
                     + CHANGED.sub("", _reason(record["changes"][0])))
    if record["restarts"]:
        parts.append(f"{record['restarts']} restart(s): {_reason(record['restart_lines'][0])}")
    elif record["scenario"] != REFERENCE and record["scenario"] != "scheduler-host-lost" and not record.get("changes"):
        parts.append("no restart")
    if record.get("error") and not record["finished"]:
        parts.append(_reason(record["error"]))
    if record["resumed_from"]:
        parts.append("resumed from epoch {epoch}, batch {batch}".format(**record["resumed_from"])
                     + (" (a live worker's state)" if record["resumed_from"].get("in_memory") else ""))
    if "same_model" in record:
        parts.append("model " + ("byte-identical to uninterrupted" if record["same_model"] else
                                 f"differs (max abs {record['max_abs_difference']})"))
    resume = record.get("resume")
    if resume:
        where = "epoch {epoch}, batch {batch}".format(**resume["resumed_from"]) if resume["resumed_from"] else "?"
        parts.append(f"new launch on h2 with --resume from {where}: "
                     + ("finished" if resume["finished"] else f"exit {resume['status']}"))
    return "; ".join(parts).replace("|", "/")


def _noticed(record):
    """The table's "noticed after" of one record."""
    if record["scenario"] == "scheduler-host-lost":
        gone = record["left"]["h2"]["gone_after_s"]
        return "h2 emptied after " + ("never" if gone is None else f"{gone:.1f}") + " (no launcher)"
    if record["noticed_s"] is None:
        return "-"
    text = f"{record['noticed_s']:.1f}"
    if "default_host_timeout_s" in record and "stopped answering" in (record.get("noticed_line") or ""):
        text += f" (--host-timeout {record['host_timeout_s']:g}; the default {record['default_host_timeout_s']:g})"
    return text


def _seconds(record, reference):
    """The table's "job seconds (vs uninterrupted)" of one record; with a new launch after the fault, up to the
    fault, the wait until host 2 was empty and the new run."""
    seconds = record.get("total_s", record["job_s"])
    text = f"{seconds:.1f}"
    if reference and record["scenario"] != REFERENCE:
        text += f" ({seconds / reference['job_s']:.2f}x)"
    if record.get("resume"):
        wait = record["left"]["h2"]["gone_after_s"]
        text += (f": {record['fault_at_s']:.1f} to the fault + "
                 + ("(h2 never emptied)" if wait is None else f"{wait:.1f} until h2 was empty")
                 + f" + {record['resume']['job_s']:.1f} resumed")
    return text


def _left(record):
    """The table's "left behind" of one record."""
    cells = []
    for host, found in sorted(record["left"].items()):
        if found.get("lost"):
            cells.append(f"{host} lost")
        elif not found["at_start"]:
            cells.append(f"{host} none")
        elif found["gone_after_s"] is not None:
            after = f"gone {found['gone_after_s']:.1f} s after {record.get('left_since', 'the job ended')}"
            if "gone_after_fault_s" in found and record.get("left_since") != "the fault":
                after += f" ({found['gone_after_fault_s']:.1f} s after the fault)"
            cells.append(f"{host} {len(found['at_start'])} process(es), {after}")
        else:
            cells.append(f"{host} {len(found['still_left'])} process(es) still there after {CLEANUP_SECONDS} s")
    return "; ".join(cells)


def render(result):
    """The lines of the table: one row a run, the uninterrupted one first."""
    records = result["records"]
    reference = next((r for r in records if r["scenario"] == REFERENCE), None)
    rows = [[r["scenario"], describe(r), _noticed(r), _training_again(r), _seconds(r, reference), _left(r)]
            for r in records]
    return harness.markdown_table(["scenario", "what the job did", "noticed after (s)", "training again after (s)",
                                   "job seconds (vs uninterrupted)", "left behind"], rows)


def _training_again(record):
    """The table's "training again after": seconds from the fault to the line of the start that resumed (its
    first step follows it)."""
    if record["scenario"] == REFERENCE or record.get("resumed_s") is None or record.get("fault_at_s") is None:
        return "-"
    return f"{record['resumed_s']:.1f}"


# ---- the command -----------------------------------------------------------------------------------------------

def run(args, path):
    """The uninterrupted run, then each scenario; the JSON (at ``path``) and the table."""
    records = []
    args.default_host_timeout = default_host_timeout()
    with tempfile.TemporaryDirectory(prefix="faults-keep-") as keep:
        for name in [REFERENCE, *args.scenarios]:
            record = measure(args, name, keep)
            record["host_timeout_s"] = args.host_timeout
            records.append(record)
            print(f"{name}: done", file=sys.stderr, flush=True)
    result = {"command": "python benchmarks/faults.py " + shlex.join(args.argv), "rate": "1gbit", "hosts": 2,
              "epochs": args.epochs, "host_timeout_s": args.host_timeout, "outage_s": args.outage, "train": TRAIN,
              "client_alive_s": simulated.CLIENT_ALIVE_SECONDS, "records": records}
    harness.write_json(path, result)
    print("\n".join(render(result)))


def check_args(args):
    """Check the flags' values and the machine before any job: the results' path.

    Raises
    ------
    ValueError
        With the flag (or the machine's lack) named, in one line.
    """
    try:
        args.scenarios = harness.parse_list(args.scenarios, names=SCENARIOS)
    except ValueError as e:
        raise ValueError(f"--scenarios {e}") from None
    for flag, seconds in (("--host-timeout", args.host_timeout), ("--timeout", args.timeout)):
        if not 1 <= seconds <= 3600:
            raise ValueError(f"{flag} must be from 1 to 3600 seconds, got {seconds:g}")
    args.outage = args.host_timeout / 2 if args.outage is None else args.outage
    if not 0 < args.outage < args.host_timeout:
        raise ValueError(f"--outage must be more than 0 and less than --host-timeout ({args.host_timeout:g} s), got "
                         f"{args.outage:g}")
    harness.check_minimum([("--epochs", args.epochs)], 3)   # the faults come after epoch 2
    if args.data_dir is None:   # a given one was checked as it was parsed (harness.mnist_dir)
        raise ValueError(f"give --data-dir DIR, an MNIST-format directory ({harness.DIGITS_COMMAND} DIR makes one)")
    reason = simulated.unavailable()
    if reason:
        raise ValueError(f"simulated hosts {reason}")
    return harness.results_path(args.out, "faults.json")


def main(argv=None):
    """The command (see the module's docstring); its exit status."""
    parser = harness.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=harness.mnist_dir, default=None, help="an MNIST-format directory (digits_dataset.py's)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, of {', '.join(SCENARIOS)}; default all")
    parser.add_argument("--host-timeout", type=float, default=10.0,
                        help="the launcher's --host-timeout in every job; default 10")
    parser.add_argument("--outage", type=float, default=None,
                        help="seconds link-outage keeps host 2's link down (less than --host-timeout); default "
                             "half of --host-timeout")
    parser.add_argument("--epochs", type=int, default=10, help="epochs of each job (>= 3); default 10")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a job may take; default 300")
    harness.add_out(parser, "faults.json")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return harness.command_status(lambda: check_args(args), lambda path: run(args, path))


if __name__ == "__main__":
    sys.exit(harness.command(main, "the jobs were stopped and the simulated hosts removed"))
