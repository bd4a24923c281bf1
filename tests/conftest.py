"""Shared fixtures and helpers of the tests: data, contexts, tolerances, and the processes a test starts.

The tests' own MXNet runs one OpenMP thread per operator on every machine (what MXNet's default gives on this
project's 2 cores): results that K contexts must reproduce do not depend on the machine, and the float64 tests
on several contexts never run two multi-threaded OpenBLAS products at once, which hangs MXNet 1.9.1's bundled
OpenBLAS (docs/threads.md). That variable is set only while MXNet is imported, which is when MXNet reads it: the
processes the tests start see it as it was.
"""
import importlib.util
import os
import threading

_THREADS = os.environ.get("OMP_NUM_THREADS")
os.environ["OMP_NUM_THREADS"] = "1"
# The CLI's other engine settings (parallel.threads.engine_settings), which MXNet reads when it first needs them
# (its scratch memory, its first backward pass), not at import: they stay set, for this process and the processes
# the tests start (which the CLI would give them anyway).
for _name, _value in (("MXNET_CPU_TEMP_COPY", "64"), ("MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD", "2")):
    os.environ.setdefault(_name, _value)
# MXNet's import reads distutils (mxnet.numpy_dispatch_protocol), which setuptools' shim (installed at each
# interpreter's start, where setuptools is) answers by importing setuptools and pkg_resources: 0.4 s of a core in
# every process the tests start that imports MXNet, which the standard library's distutils (Python <= 3.11) does
# not cost. Set for the processes the tests start; this one's shim is already in place.
os.environ.setdefault("SETUPTOOLS_USE_DISTUTILS", "stdlib")
import mxnet as mx  # noqa: E402
if _THREADS is None:
    del os.environ["OMP_NUM_THREADS"]
else:
    os.environ["OMP_NUM_THREADS"] = _THREADS
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from parallel.job import Job  # noqa: E402

# Property-based tests (Hypothesis, marked ``property``): how many examples each draws comes from a profile, never
# from the test. The fast tier's default draws a few new ones every run; the slow tier's command loads "full"
# (``--hypothesis-profile=full``): many examples, derived from each test's name, so that a failure reproduces.
settings.register_profile("default", max_examples=10, deadline=None)
settings.register_profile("full", max_examples=100, deadline=None, derandomize=True, print_blob=True)
settings.load_profile("default")


# ---- tests that need something of the machine: reported by every run, required where CI says so --------------
#
# A test that needs root (a simulated cluster: network namespaces, tc), a private sshd (ssh mode) or Horovod (a
# peer, never a dependency) is marked ``needs_root``, ``needs_sshd`` or ``needs_horovod`` (by the fixture it uses,
# or by hand) and skips, with the reason, where the machine lacks it. Each run ends with a line saying how many of
# each ran and how many skipped; ``PARALLEL_MUST_RUN`` (comma-separated: root, sshd, horovod), which .ci/run sets
# for what its machine has, makes a skip of one of those fail the run, so that a skip cannot hide a regression.

NEEDS = ("root", "sshd", "horovod")
_NEEDED_BY_FIXTURE = {"make_cluster": "root", "sshd": "sshd"}
_NEEDS_SEEN = {need: {"ran": 0, "skipped": []} for need in NEEDS}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, need in _NEEDED_BY_FIXTURE.items():
            if isinstance(item, pytest.Function) and fixture in item.fixturenames:
                item.add_marker(getattr(pytest.mark, f"needs_{need}"))


def pytest_runtest_logreport(report):
    """Count each marked test once: skipped (at setup or in its body: against the need its reason names, ``needs
    root: ...``, or every need it is marked with) or ran (its body passed or failed). Runs in the controller of
    ``-n 2`` too, which gets every worker's reports."""
    marked = [need for need in NEEDS if f"needs_{need}" in report.keywords]
    if report.skipped and report.when in ("setup", "call") and marked:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        named = [need for need in marked if f"needs {need}" in reason]
        for need in named or marked:
            _NEEDS_SEEN[need]["skipped"].append(report.nodeid)
    elif report.when == "call":
        for need in marked:
            _NEEDS_SEEN[need]["ran"] += 1


def _must_run():
    return [need for need in os.environ.get("PARALLEL_MUST_RUN", "").split(",") if need.strip()]


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("PYTEST_XDIST_WORKER"):   # an xdist worker: the controller says it
        return
    parts = [f"{need}: {seen['ran']} ran, {len(seen['skipped'])} skipped" for need, seen in _NEEDS_SEEN.items()]
    terminalreporter.write_line("tests that need root, sshd or Horovod: " + "; ".join(parts) +
                                (f" (PARALLEL_MUST_RUN={','.join(_must_run())})" if _must_run() else ""))
    for need in _must_run():
        if need not in NEEDS:
            terminalreporter.write_line(f"error: PARALLEL_MUST_RUN names {need!r}; the needs are {', '.join(NEEDS)}")
            continue
        for nodeid in _NEEDS_SEEN[need]["skipped"]:
            terminalreporter.write_line(f"error: {nodeid} needs {need}, which this machine has "
                                        "(PARALLEL_MUST_RUN), and was skipped")


def pytest_sessionfinish(session, exitstatus):
    unknown = [need for need in _must_run() if need not in NEEDS]
    skipped = [nodeid for need in _must_run() if need in NEEDS for nodeid in _NEEDS_SEEN[need]["skipped"]]
    if (unknown or skipped) and session.exitstatus == 0:
        session.exitstatus = 1   # a test this machine can run was skipped: it may hide a regression


def contexts(k):
    """K distinct CPU contexts: each gets its own worker thread in MXNet's engine."""
    return [mx.cpu(i) for i in range(k)]


def diagonal(*axes):
    """``pytest.param``s of the product of ``axes`` (each a list of values), for one ``parametrize`` of as many
    names: the fast tier runs a diagonal of the product (case ``t`` takes value ``t mod len(axis)`` of every axis,
    ``t < max(len(axis))``), so that every value of every axis is tried once; the slow tier runs the rest."""
    import itertools
    n = max(len(axis) for axis in axes)
    diagonal_cases = {tuple(t % len(axis) for axis in axes) for t in range(n)}
    indices = list(itertools.product(*(range(len(axis)) for axis in axes)))
    return fast_only([tuple(axis[i] for axis, i in zip(axes, index)) for index in indices],
                     fast={k for k, index in enumerate(indices) if index in diagonal_cases})


def pairwise(*axes, fast_axes=None):
    """Cases (tuples, one value of each axis) in which every pair of values of two axes meets at least once: a
    covering array of strength 2, built greedily (each case the first of the product that covers the most pairs not
    yet covered), so far fewer cases than the product when the axes' effects interact at most two at a time.
    ``pytest.param``s: a few of the cases that together hold every value of every axis (of the first ``fast_axes``
    axes if given; chosen greedily, each adding the most values not yet held) run in the fast tier, the others slow.

    >>> cases = [p.values for p in pairwise([0, 1, 2], "ab", "xyz")]
    >>> len(cases), all(any(c[i] == u and c[j] == v for c in cases) for i, j in ((0, 1), (0, 2), (1, 2))
    ...                     for u in ([0, 1, 2], "ab", "xyz")[i] for v in ([0, 1, 2], "ab", "xyz")[j])
    (9, True)
    >>> [p.values for p in pairwise([0, 1], "ab") if not p.marks]   # a and b each once, 0 and 1 each once
    [(0, 'a'), (1, 'b')]
    """
    import itertools
    axes = [list(axis) for axis in axes]
    uncovered = {((i, u), (j, v)) for i, j in itertools.combinations(range(len(axes)), 2)
                 for u in range(len(axes[i])) for v in range(len(axes[j]))}

    def pairs(index):
        return {((i, index[i]), (j, index[j])) for i, j in itertools.combinations(range(len(axes)), 2)}
    chosen = []
    while uncovered:
        best = max(itertools.product(*(range(len(axis)) for axis in axes)), key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    unseen, fast, held = {(i, u) for i, axis in enumerate(axes[:fast_axes]) for u in range(len(axis))}, set(), set()
    while unseen:   # ties go to the case holding more values of the other axes not yet held
        n = max(range(len(chosen)), key=lambda n: (len(set(enumerate(chosen[n])) & unseen),
                                                   len(set(enumerate(chosen[n])) - held)))
        fast.add(n)
        unseen -= set(enumerate(chosen[n]))
        held |= set(enumerate(chosen[n]))
    return [pytest.param(*(axis[i] for axis, i in zip(axes, index)), marks=() if n in fast else pytest.mark.slow)
            for n, index in enumerate(chosen)]


def fast_only(cases, fast):
    """``cases`` (each a value, or a tuple of the values of a ``parametrize`` of several names) as ``pytest.param``s:
    those at the indices ``fast`` in the fast tier, the others slow (the fast tier's time budget, docs/testing.md)."""
    return [pytest.param(*(case if isinstance(case, tuple) else (case,)),
                         marks=() if i in fast else pytest.mark.slow) for i, case in enumerate(cases)]


def make_batches(sizes, seed=0, dtype="float32"):
    """Random LeNet batches (X, y) of the given sizes, on the CPU."""
    rng = np.random.RandomState(seed)
    return [(mx.nd.array(rng.rand(n, 1, 28, 28), dtype=dtype),
             mx.nd.array(rng.randint(0, 10, n), dtype=dtype)) for n in sizes]


def assert_same_parameters(got, want, dtype):
    """Parameters trained on K contexts equal those trained on one, to a relative 1e-5.

    float64: elementwise, since only rounding can differ. float32: relative to each array's scale, since
    summing the shards in another order moves values near zero by ~1e-7 absolute.
    """
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        atol = 0 if np.dtype(dtype) == np.float64 else 1e-5 * np.abs(w).max()
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=atol)


def lenet_strategy(ctx_list, seed=0, name="data", reducer=None, **layout):
    """A strategy of LeNet seeded with ``seed`` (``make_strategy``, the one place names become objects)."""
    from parallel import init_model, make_strategy
    return make_strategy(name, init_model("lenet", seed), ctx_list, reducer=reducer, **layout)


def small_cnn(batchnorm=False, dtype="float64", seed=0):
    """A small gluon CNN of 8x8 one-channel images, initialized and run once (shapes known): 5 children, 7 with
    BatchNorm."""
    from mxnet.gluon import nn
    mx.random.seed(seed)
    net = nn.HybridSequential()
    net.add(nn.Conv2D(4, 3, padding=1))
    if batchnorm:
        net.add(nn.BatchNorm())
    net.add(nn.Activation("relu"), nn.MaxPool2D(2), nn.Dense(16, activation="relu"))
    if batchnorm:
        net.add(nn.BatchNorm())
    net.add(nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net.cast(dtype)
    net(mx.nd.zeros((1, 1, 8, 8), dtype=dtype))
    return net


@pytest.fixture
def rng():
    return np.random.RandomState(1234)


def easy_dataset(num_train=2000, num_test=300, seed=0):
    """A small, clearly separable MNIST-format set: each class is a bright block in its own place.

    LeNet with the textbook's N(0, 0.01) init sits at chance for ~150-250 SGD steps whatever the data;
    on this set it then learns within a few dozen steps, so a short CLI run shows accuracy rising.
    """
    from parallel.data import Dataset

    def draw(n, rng):
        labels = (np.arange(n) % 10).astype(np.uint8)
        rng.shuffle(labels)
        images = rng.randint(0, 60, (n, 28, 28))
        for c in range(10):
            row, col = divmod(c, 4)
            images[labels == c, row * 9 + 1:row * 9 + 9, col * 7:col * 7 + 7] += 180
        return np.clip(images, 0, 255).astype(np.uint8), labels

    rng = np.random.RandomState(seed)
    return Dataset(*draw(num_train, rng), *draw(num_test, rng))


def _closed_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def no_network_downloads(monkeypatch):
    """Tests never touch the network: any download goes to a closed loopback port and fails at once,
    in this process and in subprocesses (through the environment variable)."""
    mirror = f"http://127.0.0.1:{_closed_port()}/"
    monkeypatch.setenv("PARALLEL_FASHION_MNIST_MIRRORS", mirror)
    monkeypatch.setattr("parallel.data.fashion_mnist.FASHION_MNIST_MIRRORS", [mirror])
    monkeypatch.setenv("MXNET_HOME", "/nonexistent-mxnet-home-for-tests")


# Operators the package calls through mx.nd (LeNet's layers, the loss, the update, the reductions).
_STRICT_OPS = ["Convolution", "Pooling", "Activation", "relu", "dot", "FullyConnected", "transpose", "broadcast_add",
               "flatten", "log_softmax", "pick",
               "add_n", "concat", "sgd_update", "elemwise_add", "argmax", "stack"]
_STRICT_METHODS = ["__add__", "__iadd__", "__sub__", "__isub__", "__mul__", "__imul__", "__truediv__",
                   "__itruediv__", "__eq__", "__setitem__"]


def _contexts_of(values):
    found = set()
    for value in values:
        if isinstance(value, mx.nd.NDArray):
            found.add(value.context)
        elif isinstance(value, (list, tuple)):
            found |= _contexts_of(value)
    return found


@pytest.fixture
def strict_contexts(monkeypatch):
    """Fail when one operator receives arrays on two contexts.

    CPU contexts share memory, so MXNet quietly accepts such mixes there, while GPUs reject them; this
    fixture makes the CPU tests as strict as GPUs about explicit copies.
    """
    def guard(name, fn):
        def checked(*args, **kwargs):
            found = _contexts_of(list(args) + list(kwargs.values()))
            if len(found) > 1:
                raise AssertionError(f"{name} mixes contexts {sorted(map(str, found))}: a copy is missing")
            return fn(*args, **kwargs)
        return checked

    for name in _STRICT_OPS:
        monkeypatch.setattr(mx.nd, name, guard(f"mx.nd.{name}", getattr(mx.nd, name)))
    for name in _STRICT_METHODS:
        monkeypatch.setattr(mx.nd.NDArray, name, guard(f"NDArray.{name}", getattr(mx.nd.NDArray, name)))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_benchmark(name):
    """The script ``benchmarks/<name>.py`` as a module (benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def make_cluster():
    """``make_cluster(hosts=2, rate="1gbit")``: a started simulated cluster (``benchmarks/cluster.py``: a network
    namespace a host, each with its own address, host name, shaped link and ssh), closed with everything on it when
    the test ends; the test is skipped, with the reason, where one cannot be made (not root, no ``ip``/``tc``)."""
    module = load_benchmark("cluster")
    reason = module.unavailable()
    if reason:
        pytest.skip(f"needs root: a simulated cluster {reason}")
    made = []

    def make(hosts=2, rate="1gbit"):
        cluster = module.Cluster(hosts, rate)
        made.append(cluster)
        cluster.start()
        return cluster
    yield make
    for cluster in made:
        cluster.close()


# Runs python -m parallel.train, SIGKILLing itself where argv[1] says: "none", or plans joined by "+", each
# "START/step:N:R" (once its N-th training step of that start of the job is queued, before any checkpoint after it,
# on rank R), "START/grow:N:R" (the same step, writing the discovery file and pausing 5 s instead of dying: an
# elastic launcher sees the hosts change while the job waits), "START/raise:N:R" (the same step, raising an
# exception instead: a worker that fails with a traceback) or "START/write:N"
# (inside rank 0's N-th checkpoint write of that start, after the arrays, before the manifest that commits them),
# optionally with "/HOST,HOST" to write into the discovery file argv[2] first. Other starts train normally.
FAULT_WRAPPER = """
import os, signal, sys
plans, hosts_file = sys.argv[1], sys.argv[2]
sys.argv = [sys.argv[0]] + sys.argv[3:]
restart = int(os.environ["PARALLEL_RESTART"])
plan = [p.split("/") for p in plans.split("+") if p != "none" and int(p.split("/")[0]) == restart]

def list_hosts(hosts):
    if hosts:
        with open(hosts_file, "w") as f:
            f.write(hosts.replace(",", "\\n") + "\\n")

def die(hosts):
    list_hosts(hosts)
    os.kill(os.getpid(), signal.SIGKILL)

def grow(hosts):
    import time
    list_hosts(hosts)
    time.sleep(5)

import parallel.checkpoint, parallel.report
if plan:
    _, where, *hosts = plan[0]
    kind, n, *rank = where.split(":")
    count = [0]
    if kind in ("step", "grow", "raise"):   # fit's on_step (the report's) runs once a step is queued
        step = parallel.report.Report.step
        def counted(self, epoch, batch):
            count[0] += 1
            if count[0] == int(n) and self.strategy.job.rank == int(rank[0]):
                if kind == "raise":
                    raise RuntimeError(f"a failure planned at step {n}")
                (die if kind == "step" else grow)(hosts and hosts[0])
            return step(self, epoch, batch)
        parallel.report.Report.step = counted
    else:   # the manifest, the commit point, is written through atomic_write once the arrays are
        atomic_write = parallel.checkpoint.atomic_write
        def counted(path, mode):
            count[0] += 1
            if count[0] == int(n):
                die(hosts and hosts[0])
            return atomic_write(path, mode)
        parallel.checkpoint.atomic_write = counted
from parallel.train import main_in_job
sys.exit(main_in_job())
"""


def write_idx_files(directory, dataset):
    """Write ``dataset`` as the four raw IDX files of an MNIST-format directory; return the directory."""
    from parallel import write_idx
    from parallel.data import FILES
    for role, name in FILES.items():
        write_idx(os.path.join(directory, name), getattr(dataset, role))
    return directory


def job_processes(mark_name, mark, role=None):
    """Pids of live processes of a kvstore job (``DMLC_ROLE`` in their environment, optionally this role)
    whose environment has ``mark_name=mark``: other jobs on the machine are not ours to judge."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        roles = [v[len(b"DMLC_ROLE="):].decode() for v in env if v.startswith(b"DMLC_ROLE=")]
        if roles and f"{mark_name}={mark}".encode() in env and role in (None, roles[0]):
            found.append(int(pid))
    return found


# ---- processes a test starts: each in its own process group, each with a timeout, none left behind ----------

def stop_process(process, grace=10):
    """End ``process`` and everything in its process group: SIGTERM (a launcher then stops what it started), and
    SIGKILL after ``grace`` seconds. A no-op for a group that is gone."""
    import signal
    import subprocess
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 30)):
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            process.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:   # what the group may still hold once its leader exited
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_process(argv, timeout, input=None, **kwargs):
    """``subprocess.run(argv, capture_output=True, text=True, input=input)`` in a process group of its own; on a
    timeout (or any interruption) the whole group is stopped before ``subprocess.TimeoutExpired`` propagates."""
    import subprocess
    stdin = subprocess.PIPE if input is not None else kwargs.pop("stdin", None)
    process = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, **kwargs)
    try:
        out, err = process.communicate(input=input, timeout=timeout)
    except BaseException:
        stop_process(process)
        raise
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


_STARTED = []   # every process start_process started in the current test


def start_process(argv, **kwargs):
    """``subprocess.Popen(argv, ...)`` in a process group of its own; whatever is still running when the test
    ends is stopped with its group (``stop_process``), however the test ends."""
    import subprocess
    process = subprocess.Popen(argv, start_new_session=True, **kwargs)
    _STARTED.append(process)
    return process


@pytest.fixture(autouse=True)
def _stop_started_processes():
    yield
    while _STARTED:
        process = _STARTED.pop()
        if process.poll() is None:
            stop_process(process)


# ---- a timeline's lanes (parallel.trace), as the tests read them ---------------------------------------------

def trace_operators(timeline, lane):
    """A lane's operators (thread 0), in time order."""
    return [e for e in timeline.events if e.get("ph") == "X" and e["pid"] == lane and e["tid"] == 0]


def trace_brackets(timeline, lane):
    """A lane's brackets (thread 1): what each issuer queued."""
    return [e for e in timeline.events if e.get("ph") == "X" and e["pid"] == lane and e["tid"] == 1]


def labels_hold(timeline):
    """What makes a label true: every operator named after an issuer ran inside a bracket that issuer queued on its
    lane, and is one that issuer runs (an allreduce runs no transpose); backward operators are MXNet's."""
    from parallel.trace import ISSUED_OPS
    for lane in range(len(timeline.lanes)):
        brackets = trace_brackets(timeline, lane)
        for e in trace_operators(timeline, lane):
            if e["cat"] in ISSUED_OPS and e["cat"] != "forward":
                assert e["args"]["op"].startswith(ISSUED_OPS[e["cat"]]), e
                assert any(b["cat"] == e["cat"] and b["ts"] <= e["ts"] and e["ts"] + e["dur"] <= b["ts"] + b["dur"]
                           for b in brackets), e
            elif e["cat"] == "backward":
                assert "_backward" in e["args"]["op"], e
            elif e["cat"] == "other":
                assert e["name"] == e["args"]["op"].split(",")[0], e


def stop_before(call):
    """A ``fit`` ``stop()`` that answers True at its ``call``-th question (fit asks before every batch)."""
    asked = [0]

    def stop():
        asked[0] += 1
        return asked[0] == call
    return stop


# A distributed job in threads: each thread a worker with its own parallel.job.Job over ThreadKV, a kvstore whose
# "servers" sum the pushes in numpy (in the pushed dtype) as ps-lite's do, key by key.
class ThreadServers:
    """What ps-lite's servers do for a synchronous job: each key's pushes summed (in the pushed dtype) round by round
    (a worker's n-th push of a key joins the key's n-th round; its n-th pull waits until every worker pushed to that
    round), the keys independent of each other; the bytes each push carries are recorded. ``abort()`` releases every
    waiting pull with ``threading.BrokenBarrierError``."""

    def __init__(self, num_workers, timeout=60):
        self.num_workers, self.timeout = num_workers, timeout
        self.pushed, self.cond, self.aborted = [], threading.Condition(), False
        self.rounds = {}   # (key, n) -> [sum, pushes, pulls]
        self.counts = {}   # (key, rank, "push" or "pull") -> how many so far

    def _next(self, key, rank, kind):
        n = self.counts.get((key, rank, kind), 0)
        self.counts[(key, rank, kind)] = n + 1
        return n

    def abort(self):
        with self.cond:
            self.aborted = True
            self.cond.notify_all()

    def push(self, key, rank, value):
        with self.cond:
            entry = self.rounds.setdefault((key, self._next(key, rank, "push")), [None, 0, 0])
            entry[0] = value if entry[0] is None else entry[0] + value
            entry[1] += 1
            self.pushed.append((key, value.nbytes))
            self.cond.notify_all()

    def pull(self, key, rank):
        with self.cond:
            where = (key, self._next(key, rank, "pull"))
            summed = self.cond.wait_for(lambda: self.aborted or self.rounds[where][1] == self.num_workers,
                                        self.timeout)
            if self.aborted or not summed:
                raise threading.BrokenBarrierError(f"key {key}'s round {where[1]} was not summed")
            entry = self.rounds[where]
            entry[2] += 1
            if entry[2] == self.num_workers:
                del self.rounds[where]
            return entry[0]


class ThreadKV:
    type = "threads"

    def __init__(self, servers, rank, num_workers):
        self.servers, self.rank, self.num_workers = servers, rank, num_workers

    def init(self, key, value):
        pass

    def push(self, key, array, priority=0):
        self.servers.push(key, self.rank, array.asnumpy())

    def pull(self, key, out, priority=0):
        out[:] = self.servers.pull(key, self.rank)

    def pushpull(self, key, value, out=None, priority=0):
        self.push(key, value, priority)
        self.pull(key, value if out is None else out, priority)


def in_threads(num_workers, work):
    """Run ``work(job, rank)`` for every rank at once, each in its own thread with its own Job; their results."""
    servers = ThreadServers(num_workers)
    results, errors = [None] * num_workers, []

    def run(rank):
        try:
            results[rank] = work(Job(ThreadKV(servers, rank, num_workers)), rank)
        except BaseException as error:   # reported below, with the others released
            errors.append(error)
            servers.abort()
    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(num_workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    return results, servers


@pytest.fixture
def threads_reduce_at_once(monkeypatch):
    """Workers in threads (``in_threads``) that reduce through a Reducer, each on contexts of its own: let them queue
    their reductions at once (one thread holding the process's reduction lock while it waits in ThreadKV's pull
    would stop the other)."""
    import contextlib
    from parallel.comm import algorithms
    monkeypatch.setattr(algorithms.BUFFERS, "lock", contextlib.nullcontext())


def assert_same_arrays(got, want):
    """Two lists of lists of arrays (a run's trained arrays, its running statistics) equal, bit for bit."""
    for arrays_got, arrays_want in zip(got, want):
        assert len(arrays_got) == len(arrays_want)
        for g, w in zip(arrays_got, arrays_want):
            np.testing.assert_array_equal(g, w)


@pytest.fixture(scope="session")
def easy_dir(tmp_path_factory):
    """A small MNIST-format directory of ``easy_dataset`` (256 train, 64 test examples) for CLI runs."""
    return write_idx_files(tmp_path_factory.mktemp("easy"), easy_dataset(num_train=256, num_test=64, seed=1))


def assert_refused(status, capsys, says):
    """A refusal of ``python -m parallel.train``'s ``main``: exit status 2 and one line on stderr that says ``says``,
    no traceback."""
    err = capsys.readouterr().err
    assert status == 2 and says in err and err.count("\n") == 1 and "Traceback" not in err, err


def assert_close_to_scale(got, want, rtol):
    """Each array of ``got`` within ``rtol`` of its ``want``'s scale (the largest magnitude in it): how the tests
    compare a model trained one way with one context's, where an element near zero has no relative error."""
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=rtol * np.abs(w).max())


def small_resnet():
    """A gluon HybridSequential shaped as ResNet-18 is (a stem, a stage of blocks with BatchNorm, pooling and a dense
    head), small enough for the fast tier."""
    from mxnet import gluon
    from parallel.models.resnet import Residual
    net = gluon.nn.HybridSequential(prefix="small_")
    with net.name_scope():
        stem = gluon.nn.HybridSequential()
        stem.add(gluon.nn.Conv2D(4, kernel_size=3, padding=1), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"))
        stage = gluon.nn.HybridSequential()
        stage.add(Residual(4), Residual(8, use_1x1conv=True, strides=2))
        net.add(stem, stage, gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(10))
    mx.random.seed(0)
    net.initialize(mx.init.Normal(sigma=0.1))
    net(mx.nd.zeros((1, 1, 28, 28)))
    return net
