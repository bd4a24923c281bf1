"""Jobs on many hosts: python -m parallel.launch --launcher ssh on the simulated cluster of benchmarks/cluster.py
(a network namespace a host, a shaped link each, ssh over it). The same model as one process on 2 and 3 hosts
with one server a host and each host's thread settings; a lost host healed from a live worker's state; elastic
jobs (no --checkpoint-dir) that grow, shrink, lose a rank at a planned step, leave out hosts that keep failing
and stop at a reset limit; a partition noticed within --host-timeout and healed; a slow but healthy host left
alone; P3's order across the link; nothing left on any host."""
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import mxnet as mx
import pytest

from parallel import RunConfig, fit, read_trace, reduction_order
from parallel.checkpoint import load_checkpoint
from parallel.models import LENET_PARAM_NAMES
from conftest import FAULT_WRAPPER, assert_same_parameters, easy_dataset, lenet_strategy, write_idx_files

TRAIN = ["--batch-size", "13", "--lr", "0.1", "--seed", "3", "--no-progress", "--devices", "cpu:1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """70 train examples: batches of 13, 6 a epoch, the last of 5."""
    dataset = easy_dataset(num_train=70, num_test=23, seed=6)
    return write_idx_files(tmp_path_factory.mktemp("idx"), dataset), dataset


class Launched:
    """The launcher started on host 1 of ``cluster``: its output lines as they come, and ``wait_for(text)``."""

    def __init__(self, cluster, launcher_flags, train_args, cwd, program=("-m", "parallel.train")):
        argv = [sys.executable, "-m", "parallel.launch", "--launcher", "ssh", "--scheduler-host",
                cluster.host(1).address, "--grace", "2", "--stall-timeout", "300", *launcher_flags,
                sys.executable, *program, *train_args]
        self.process = cluster.popen(argv, host=1, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.out, self.err, self.changed = [], [], threading.Condition()
        self.readers = [threading.Thread(target=self._read, args=(pipe, lines), daemon=True)
                        for pipe, lines in ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def _read(self, pipe, lines):
        for line in pipe:
            with self.changed:
                lines.append(line.rstrip("\n"))
                self.changed.notify_all()

    def wait_for(self, text, timeout=300):
        """Block until an output line holds ``text``."""
        with self.changed:
            assert self.changed.wait_for(lambda: any(text in line for line in self.out + self.err), timeout), \
                "\n".join(self.err[-30:])

    def finish(self, timeout=400):
        """The launcher's exit status, once it and its output ended."""
        status = self.process.wait(timeout=timeout)
        for reader in self.readers:
            reader.join(30)
        return status


def _exported(prefix):
    arrays = mx.nd.load(f"{prefix}-0000.params")
    return [arrays[f"arg:{name}"].asnumpy() for name in LENET_PARAM_NAMES]


def _left(cluster, i, timeout=30):
    """The processes still on host ``i`` besides its sshd, once they had ``timeout`` seconds to go."""
    deadline = time.monotonic() + timeout
    while cluster.processes(i) and time.monotonic() < deadline:
        time.sleep(0.1)
    return cluster.processes(i)


@pytest.mark.slow
@pytest.mark.parametrize("hosts", [2, 3])
def test_a_job_on_several_hosts_trains_the_same_model_as_one_process(hosts, make_cluster, tiny, tmp_path):
    """A worker and, by default, a server on each host (big arrays split over every server); each remote process
    gets its host's share of the cores (no --env); rank 0 alone writes; nothing is left on any host."""
    cluster = make_cluster(hosts)
    data_dir, dataset = tiny
    job = Launched(cluster, ["-n", str(hosts), "-H", cluster.hostfile, "--env", "MXNET_KVSTORE_BIGARRAY_BOUND:1000"],
                   ["--data-dir", str(data_dir), "--epochs", "2", *TRAIN, "--export", "lenet"], tmp_path)
    assert job.finish() == 0, "\n".join(job.err[-30:])
    assert any(f"connected to {hosts} workers and {hosts} servers" in line for line in job.err), job.err
    assert any(f"buckets of 5 MiB (the default for a job across {hosts} hosts" in line and
               "over MXNet's P3" not in line for line in job.out), job.out   # the defaults across hosts
    measured = [line for line in job.err if line.startswith("--van auto: the slowest link")]
    assert len(measured) == 1 and "the job runs on ps-lite's ZeroMQ van" in measured[0], job.err   # 1 Gbit/s
    threads = [line for line in job.out if "operator threads:" in line]
    assert len(threads) == 1 and "OMP_NUM_THREADS=1" in threads[0], threads   # 2 processes a host, 2 cores
    _, model = fit(dataset, lenet_strategy([mx.cpu(0)], seed=3), 0.1, RunConfig(epochs=2, batch_size=13, seed=3))
    assert_same_parameters(_exported(tmp_path / "lenet"), [p.asnumpy() for p in model[0]], "float32")
    for i in range(1, hosts + 1):
        assert _left(cluster, i) == [], f"left on h{i}"


def _healing_job(cluster, tmp_path, data_dir, hosts, extra=()):
    discovery = tmp_path / "discovered"
    discovery.write_text("".join(f"{a}\n" for a in cluster.addresses[:hosts]))
    return Launched(cluster, ["-n", f"1:{hosts}", "-s", "1", "--host-discovery-script", f"cat {discovery}",
                              "--max-restarts", "2", *extra],
                    ["--data-dir", str(data_dir), "--epochs", "12", *TRAIN, "--checkpoint-dir", "ckpt",
                     "--checkpoint-every", "4"], tmp_path), discovery


@pytest.mark.slow
def test_a_lost_host_is_healed_from_a_live_workers_state(make_cluster, tiny, tmp_path):
    """Every process on host 3 SIGKILLed and its link down, discovery no longer naming it: the job starts again
    on the two hosts left, from the state a live worker committed in memory (newer than the last checkpoint), and
    finishes. The discovery script is not polled while the job runs here (--discovery-interval 1000), so that the
    lost worker, not the new list, ends the start."""
    cluster = make_cluster(3)
    job, discovery = _healing_job(cluster, tmp_path, tiny[0], 3, ["--host-timeout", "10",
                                                                   "--discovery-interval", "1000"])
    job.wait_for("epoch 2,")
    discovery.write_text("".join(f"{a}\n" for a in cluster.addresses[:2]))
    cluster.kill_host(3)
    assert job.finish() == 0, "\n".join(job.err[-30:])
    restarts = [line for line in job.err if line.startswith("restart ")]
    assert len(restarts) == 1 and restarts[0].endswith("starting 2 worker(s) again"), job.err[-30:]
    assert any(line.startswith("took the state of step ") for line in job.err), job.err[-30:]
    assert any("resuming from the state a worker committed in memory" in line for line in job.out), job.out[-30:]
    assert load_checkpoint(tmp_path / "ckpt").state.epoch == 13
    assert _left(cluster, 1) == [] and _left(cluster, 2) == []


#: Epochs of the elastic jobs: long enough for a change after the first to land mid-run (an epoch of the tiny set
#: takes about 0.3 s here, a change about 5 s), short enough that float32 rounding (a batch split over 2 workers
#: or not) keeps the model within 1e-5 of each array's scale of one process's.
ELASTIC_EPOCHS = 10


def _elastic_job(cluster, tmp_path, data_dir, listed, epochs=ELASTIC_EPOCHS, launcher=(), plans=None, train=(),
                 hostfile=False):
    """A LeNet job with -n 1:2 on the hosts ``listed`` (1-based), no --checkpoint-dir: its state lives only in
    the workers' memory. The hosts are a discovery script's (``cat`` of a file), or with ``hostfile`` that file's
    as -H. With ``plans``, each worker runs under conftest's FAULT_WRAPPER, failing as they say. Returns the
    launcher and the file that lists the hosts."""
    discovery = tmp_path / "discovered"
    discovery.write_text("".join(f"{cluster.host(i).address}\n" for i in listed))
    program = ("-m", "parallel.train")
    if plans is not None:
        (tmp_path / "wrapper.py").write_text(FAULT_WRAPPER)
        program = (str(tmp_path / "wrapper.py"), plans, str(discovery))
    watch = ["-H", str(discovery)] if hostfile else ["--host-discovery-script", f"cat {discovery}"]
    return Launched(cluster, ["-n", "1:2", "-s", "1", *watch, "--discovery-interval", "0.2", "--max-restarts", "1",
                              *launcher],
                    ["--data-dir", str(data_dir), "--epochs", str(epochs), *TRAIN, "--export", "lenet",
                     "--metrics-json", "metrics.json", *train], tmp_path, program), discovery


def _check_elastic_end(cluster, job, tmp_path, dataset, epochs, workers):
    """The job ended well: every epoch trained once, the first and the last by ``workers`` (two numbers), the
    model the one a job of constant size trains (one process on one context, the same global batch), nothing left."""
    assert job.finish(timeout=300) == 0, "\n".join(job.err[-30:])
    assert any(line.startswith("took the state of step ") for line in job.err), job.err[-30:]
    assert not (tmp_path / "ckpt").exists()
    history = json.loads((tmp_path / "metrics.json").read_text())
    assert [m["epoch"] for m in history] == list(range(1, epochs + 1))
    assert (history[0]["workers"], history[-1]["workers"]) == workers, [m["workers"] for m in history]
    _, model = fit(dataset, lenet_strategy([mx.cpu(0)], seed=3), 0.1, RunConfig(epochs=epochs, batch_size=13, seed=3))
    assert_same_parameters(_exported(tmp_path / "lenet"), [p.asnumpy() for p in model[0]], "float32")
    for i in (1, 2):
        assert _left(cluster, i) == [], f"left on h{i}"


@pytest.mark.slow
@pytest.mark.parametrize("hostfile", [False, True], ids=["discovery-script", "hostfile"])
def test_an_elastic_job_grows_onto_a_host_listed_after_its_first_epoch(hostfile, make_cluster, tiny, tmp_path):
    """Started on host 1 alone; host 2 listed once epoch 1 ended (by the discovery script, or added to the
    hostfile): the launcher takes host 1's worker's state from its memory and starts 2 workers from it."""
    cluster = make_cluster(2)
    data_dir, dataset = tiny
    job, discovery = _elastic_job(cluster, tmp_path, data_dir, [1], hostfile=hostfile)
    job.wait_for("epoch 1,")
    discovery.write_text(f"{cluster.host(1).address}\n{cluster.host(2).address}\n")
    job.wait_for("connected to 2 workers")
    assert any(f"the job's hosts changed: {cluster.host(2).address} joined" in line for line in job.err), job.err
    _check_elastic_end(cluster, job, tmp_path, dataset, ELASTIC_EPOCHS, (1, 2))


@pytest.mark.slow
def test_an_elastic_job_shrinks_off_a_host_removed_and_killed(make_cluster, tiny, tmp_path):
    """Started on both hosts; after epoch 1 host 2 is no longer listed and its processes are SIGKILLed: the
    launcher takes the state from a live worker and starts 1 worker from it."""
    cluster = make_cluster(2)
    data_dir, dataset = tiny
    job, discovery = _elastic_job(cluster, tmp_path, data_dir, [1, 2])
    job.wait_for("epoch 1,")
    discovery.write_text(f"{cluster.host(1).address}\n")
    for pid in cluster.processes(2):
        os.kill(pid, signal.SIGKILL)
    _check_elastic_end(cluster, job, tmp_path, dataset, ELASTIC_EPOCHS, (2, 1))


@pytest.mark.slow
@pytest.mark.parametrize("kind, says", [("raise", "RuntimeError: a failure planned at step 9"),
                                        ("step", "exited with status 255 (ssh: killed by a signal there")])
def test_a_rank_failing_at_a_scheduled_step_restarts_from_a_live_workers_commit(kind, says, make_cluster, tiny,
                                                                                tmp_path):
    """Horovod's scenario of a rank failing at a scheduled (epoch, batch): rank 1 fails at its 9th step (epoch 2,
    batch 3), by an exception or by SIGKILL (which ssh reports as status 255), in a job on both hosts with no
    --checkpoint-dir. The launcher takes the state rank 0 committed at step 8 (--commit-every 4) from its memory and
    starts both again from it; one failure leaves no host out."""
    cluster = make_cluster(2)
    data_dir, dataset = tiny
    job, _ = _elastic_job(cluster, tmp_path, data_dir, [1, 2], epochs=3, plans=f"0/{kind}:9:1",
                          train=["--commit-every", "4"])
    _check_elastic_end(cluster, job, tmp_path, dataset, 3, (2, 2))
    restarts = [line for line in job.err if line.startswith("restart ")]
    assert len(restarts) == 1 and says in restarts[0] and restarts[0].endswith("starting 2 worker(s) again"), \
        job.err[-30:]
    assert any(line.startswith("took the state of step 8 ") for line in job.err), job.err[-30:]
    assert not any("left out" in line for line in job.err), job.err[-30:]


@pytest.mark.slow
def test_hosts_that_keep_failing_are_left_out_until_too_few_are_left_and_the_job_ends_saying_why(make_cluster,
                                                                                                tiny, tmp_path):
    """Rank 0 raises at its first step in every start: each host it ran on twice is left out for --host-cooldown
    (one line each), the next start runs on the host left, and once both are out the job waits --start-timeout for
    its minimum of one host and ends with status 1 and one line naming both; nothing is left on either host."""
    cluster = make_cluster(2)
    job, _ = _elastic_job(cluster, tmp_path, tiny[0], [1, 2], plans="+".join(f"{s}/raise:1:0" for s in range(4)),
                          launcher=["--max-restarts", "9", "--host-cooldown", "600", "--start-timeout", "10"])
    assert job.finish() == 1, "\n".join(job.err[-30:])
    restarts = [line for line in job.err if line.startswith("restart ")]
    assert len(restarts) == 4 and restarts[-1].endswith("a failure planned at step 1; too few hosts to start again")
    left = [line for line in job.err if "left out of the job for 600 s (--host-cooldown)" in line]
    assert sorted(line.split()[1] for line in left) == sorted(cluster.addresses[:2]), job.err[-30:]
    assert job.err[-1] == (f"error: only 0 host(s) available, 2 left out after failing "
                           f"({', '.join(sorted(cluster.addresses[:2]))}: --host-cooldown), -n asks for at least 1 "
                           "(waited 10 s, --start-timeout)"), job.err[-30:]
    assert _left(cluster, 1) == [] and _left(cluster, 2) == []


@pytest.mark.slow
def test_a_job_whose_hosts_keep_changing_ends_at_the_reset_limit(make_cluster, tiny, tmp_path):
    """--reset-limit 1: the job grows onto host 2 (one change), then host 2 is no longer listed (a second change):
    the launcher ends the job with status 1 and one line saying why, and nothing is left on either host."""
    cluster = make_cluster(2)
    job, discovery = _elastic_job(cluster, tmp_path, tiny[0], [1], epochs=200, launcher=["--reset-limit", "1"])
    job.wait_for("epoch 1,")
    discovery.write_text(f"{cluster.host(1).address}\n{cluster.host(2).address}\n")
    job.wait_for("connected to 2 workers")
    discovery.write_text(f"{cluster.host(1).address}\n")
    assert job.finish() == 1, "\n".join(job.err[-30:])
    assert job.err[-1].startswith(f"error: the job's hosts changed: {cluster.host(2).address} left"), job.err[-30:]
    assert job.err[-1].endswith("the job has changed hosts 1 time, --reset-limit 1"), job.err[-30:]
    assert _left(cluster, 1) == [] and _left(cluster, 2) == []


@pytest.mark.slow
def test_a_partition_is_noticed_within_the_host_timeout_and_healed(make_cluster, tiny, tmp_path):
    """Host 2's link down for good, its processes alive: ssh's keepalives go unanswered, the launcher ends the
    stalled start within --host-timeout with one line naming the host, and starts again on host 1 alone."""
    cluster = make_cluster(2)
    job, discovery = _healing_job(cluster, tmp_path, tiny[0], 2, ["--host-timeout", "4",
                                                                   "--discovery-interval", "1000"])
    job.wait_for("epoch 2,")
    discovery.write_text(f"{cluster.host(1).address}\n")
    cluster.cut(2)
    assert job.finish() == 0, "\n".join(job.err[-30:])
    restarts = [line for line in job.err if line.startswith("restart ")]
    assert len(restarts) == 1, job.err[-30:]
    assert (f"host {cluster.host(2).address} stopped answering: no reply to ssh's keepalives for 4 s "
            "(--host-timeout)") in restarts[0], restarts[0]
    assert "worker 1 there is cut off" in restarts[0] and restarts[0].endswith("starting 1 worker(s) again")
    assert load_checkpoint(tmp_path / "ckpt").state.epoch == 13
    assert _left(cluster, 1) == []
    assert cluster.processes(2)   # cut off, still running: nothing can reach them
    left = _left(cluster, 2, timeout=90)   # until the sshd drops the dead session (CLIENT_ALIVE_SECONDS)
    assert left == [], [open(f"/proc/{pid}/cmdline").read() for pid in left]


@pytest.mark.slow
def test_a_slow_but_healthy_host_never_trips_the_host_timeout(make_cluster, tiny, tmp_path):
    """Host 2's worker stopped (SIGSTOP) for three times --host-timeout, then continued: its sshd still answers,
    so the job waits for it and finishes without a restart."""
    cluster = make_cluster(2)
    job, _ = _healing_job(cluster, tmp_path, tiny[0], 2, ["--host-timeout", "2"])
    job.wait_for("epoch 2,")
    stopped = cluster.processes(2)
    for pid in stopped:
        subprocess.run(["kill", "-STOP", str(pid)], check=True, timeout=30)
    time.sleep(6)
    for pid in stopped:
        subprocess.run(["kill", "-CONT", str(pid)], check=True, timeout=30)
    assert job.finish() == 0, "\n".join(job.err[-30:])
    assert not [line for line in job.err if line.startswith("restart ") or "stopped answering" in line]


@pytest.mark.slow
@pytest.mark.parametrize("van", ["auto", "zmq"])
def test_across_the_link_the_first_layers_sums_land_first_under_p3_and_not_without(van, make_cluster, tiny,
                                                                                    tmp_path):
    """The timeline proves the order: a 2-host ResNet-18 job on a 100 Mbit/s link (a step's 43 MB queue behind
    it), its one server on host 1, traced (steps 2-4), each sum a push and then a pull (``PARALLEL_PUSHPULL=0``).
    The Reducer queues a step's 10 buckets last layers' first; under P3 (``--van auto``'s choice on a link it
    measures below 300 Mbit/s) the worker across the link gets its sums by priority: in the median step the
    buckets queued while the link is busy (all but the first two, which may leave before it is, and the last,
    queued as the backward pass ends) land in the reverse of the order queued, the first layers' first: 95-100% of
    their pairs reversed, measured with the machine's two cores kept busy by another process, and 44-100% over all
    the buckets then (75-98% when the machine was quiet). With ps-lite's zmq transport, no priority, they land in
    no order (38-48% of the pairs reversed). (P3 with every bucket at one
    priority, tried by hand, gave the first layers' sum last in every step; with the default, one pushpull a sum,
    4-7% of the pairs, in one run.) BatchNorm's statistics stay per worker here: with the job's (the default
    since issue 50), each BatchNorm's backward waits for a sum queued on the link behind the buckets, the pass
    stretches, and the buckets leave about as they are queued (5-10% of the pairs reversed under P3, in one
    run)."""
    cluster = make_cluster(2, rate="100mbit")
    job = Launched(cluster, ["-n", "2", "-s", "1", "-H", cluster.hostfile, "--van", van,
                             "--env", "PARALLEL_PUSHPULL:0"],
                   ["--data-dir", str(tiny[0]), "--model", "resnet18", "--epochs", "1", "--batch-size", "16",
                    "--lr", "0.05", "--no-progress", "--devices", "cpu:1", "--trace", "t.json",
                    "--batchnorm-stats", "worker"], tmp_path)
    assert job.finish() == 0, "\n".join(job.err[-30:])
    measured = [line for line in job.err if line.startswith("--van auto: the slowest link")]
    assert len(measured) == (van == "auto") and all("runs on MXNet's P3 van" in line for line in measured), job.err
    joined = [line for line in job.out + job.err if line.startswith("[worker 1] joined the job as rank ")]
    assert len(joined) == 1, job.out + job.err   # the launcher's worker 1 runs on host 2, across the link
    steps = reduction_order(read_trace(tmp_path / f"t.rank{joined[0].split()[7]}.json"))
    buckets = len(steps[0])
    assert len(steps) == 3 and buckets >= 8 and all(sorted(step) == list(range(buckets)) for step in steps), steps
    middle = [[b for b in step if 2 <= b <= buckets - 2] for step in steps]   # queued while the link is busy
    reversed_pairs = [sum(later < earlier for i, earlier in enumerate(m) for later in m[i + 1:])
                      / (len(m) * (len(m) - 1) / 2) for m in middle]
    assert (statistics.median(reversed_pairs) > 0.75) == (van == "auto"), (reversed_pairs, steps)
    assert _left(cluster, 1) == [] and _left(cluster, 2) == []
