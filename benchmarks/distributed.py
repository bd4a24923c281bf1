"""What does crossing processes cost? kvstore push+pull against memcpy, and LeNet images/s across processes.

Run from the repository root::

    python benchmarks/distributed.py                              # full run, a few minutes on 2 cores
    python benchmarks/distributed.py --quick --out /tmp/results   # smoke test, well under a minute
    python benchmarks/distributed.py --workers 2 --rounds 5 --steps 40 --out benchmarks/results

Every distributed job runs under ``python -m parallel.launch -n W -s W --stall-timeout SEC`` on this machine;
the launcher's own split of the cores (``OMP_NUM_THREADS``) applies, as a user of the launcher gets it, unless
``--job-threads`` sets it. One run measures:

1. **push+pull sweep** (one job, W workers, W servers): for 4 KB .. 64 MB of float32, the median seconds of
   ``kv.push(key, a); kv.pull(key, out=a); a.wait_to_read()`` (every worker making the same calls in the same
   order), and, in the same process, the local memory-copy bound: ``src.copyto(dst); dst.wait_to_read()`` into
   a persistent ``dst`` of the same size (every worker copies at the same time, as every worker pushes at the
   same time). GB/s = bytes / seconds (10^9 bytes). MXNet splits an array of at least
   ``MXNET_KVSTORE_BIGARRAY_BOUND`` elements (default 1,000,000) over the servers, a smaller one goes to one
   server: the bound in effect is recorded, and each size says whether it was split. Memcpy and push+pull
   blocks alternate, size by size, round by round (the size order rotates every round).
2. **LeNet's reduction per step** (the same job): median ms of ``allreduce_across(job, grads)`` (one
   push+pull of LeNet's flat gradient, 129,068 floats) against median ms of the whole
   ``train_batch(X, y, ..., reducer=Reducer(job=job))`` step on the global batch, each call timed alone (``waitall`` before
   and after), the two blocks alternating round by round.
3. **LeNet images/second**, in ``--rounds`` interleaved rounds (the order of a, b, c rotates every round):

   a. one process with every core (``OMP_NUM_THREADS`` = the number of cores), ``train_batch`` without a job
      on ``--local-k`` contexts (default 1);
   b. ``python -m parallel.launch -n W``: the from-scratch ``train_batch(..., reducer=Reducer(job=job))``, each worker one
      context, after ``broadcast_params``, in the job ``parallel.job.join()`` returns;
   c. the same launcher and process layout running MXNet's own ``gluon.Trainer(..., 'sgd',
      {'learning_rate': lr}, kvstore=<dist_sync>)`` on ``to_gluon(...)`` hybridized with
      ``static_alloc=True, static_shape=True``: each worker forwards/backwards its slice of the global batch
      and calls ``trainer.step(global_batch)``. Whether the Trainer updates on the kvstore (MXNet's default for
      dist_sync: the servers run the SGD) is recorded.

   b and c are separate jobs: the Trainer uses keys 0..7 and, updating on the kvstore, installs an optimizer
   on the servers that would apply to every key. Each measurement: ``--warmup`` steps, then ``--steps`` steps
   with no host sync in the loop (only what the kvstore needs), ``mx.nd.waitall()`` at the end;
   images/s = global batch x steps / seconds, from **rank 0's** time (every rank's is recorded). Reported:
   medians over rounds, and the ratios b/a, c/a, b/c of those medians (per-round ratios too), from one run.

The ``OMP_NUM_THREADS`` every process ran with is read from its environment (``/proc/PID/environ`` for the
launcher's scheduler, servers and workers; the workers also report their own) and stated in the JSON and in
the tables. The driver never imports MXNet and measures nothing itself: the worker processes do, one job or
process at a time. Each worker reports by printing one line ``RESULT {json}``, which arrives here through the
launcher as ``[worker i] RESULT {json}``. A job that fails or stalls ends the benchmark with status 1 and the
launcher's ``error:`` line. Writes ``distributed.json`` and ``distributed.png`` (atomically) to ``--out`` and
prints markdown tables.
"""
import argparse
import gc
import os
import platform
import queue
import re
import subprocess
import sys
import threading
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402
from harness import KB, MB, RESULT_PREFIX, BenchmarkError  # noqa: E402

THIS = os.path.abspath(__file__)
WORKER_FLAG = "--worker"
READY_LINE = "READY"

SIZES = [4 * KB, 16 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB]
QUICK_SIZES = [4 * KB, 1 * MB]
ITEMSIZE = 4                    # float32
SWEEP_KEY0 = 50000              # sweep keys 50000, 50001, ...: clear of the package's keys (below 2000)
DEFAULT_BIGARRAY_BOUND = 1000 * 1000   # MXNet's default for MXNET_KVSTORE_BIGARRAY_BOUND (kvstore_dist.h)
CONFIGS = ("a", "b", "c")
CONFIG_NAMES = {"a": "one process, every core", "b": "from scratch, launch -n W",
                "c": "gluon.Trainer dist_sync, launch -n W"}


def _cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _sweep_reps(nbytes, quick):
    """Timed calls per block for one size: many for small sizes, at least 3 for 64 MB."""
    return 3 if quick else max(3, min(30, int(10 * MB / nbytes)))


# ----------------------------------------------------------------------------------------------
# Workers: run inside a launched job (or alone, for configuration a); each prints one RESULT line
# ----------------------------------------------------------------------------------------------

def _environment():
    import mxnet as mx
    return {"pid": os.getpid(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
            "MXNET_CPU_WORKER_NTHREADS": os.environ.get("MXNET_CPU_WORKER_NTHREADS", "unset (1)"),
            "MXNET_KVSTORE_BIGARRAY_BOUND": int(os.environ.get("MXNET_KVSTORE_BIGARRAY_BOUND",
                                                               DEFAULT_BIGARRAY_BOUND)),
            "mxnet": mx.__version__}


def _seconds_of_steps(step, warmup, steps):
    """Seconds for ``steps`` calls of ``step`` after ``warmup`` calls; no host sync inside the timed steps."""
    harness.warm_up([step], warmup)
    return harness.timed(step, steps) * steps


def _checksum(arrays):
    return float(sum(float(a.abs().sum().asscalar()) for a in arrays))


def _clock(fn, *args):
    """Seconds that ``fn(*args)`` takes (it waits for its own work)."""
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


class _Sweep:
    """The push+pull sweep's arrays on one worker: a kvstore key, a pushed array and a memcpy pair per size
    (zeros: the sums stay zero); every worker makes the same keys in the same order."""

    def __init__(self, kv, sizes, ctx):
        import mxnet as mx
        self.kv, self.keys, self.arrays, self.sources, self.targets = kv, {}, {}, {}, {}
        for i, nbytes in enumerate(sizes):
            n = nbytes // ITEMSIZE
            self.keys[nbytes], self.arrays[nbytes] = SWEEP_KEY0 + i, mx.nd.zeros(n, ctx=ctx)
            kv.init(self.keys[nbytes], self.arrays[nbytes])
            self.sources[nbytes], self.targets[nbytes] = mx.nd.zeros(n, ctx=ctx), mx.nd.ones(n, ctx=ctx)

    def pushpull(self, nbytes):
        self.kv.push(self.keys[nbytes], self.arrays[nbytes])
        self.kv.pull(self.keys[nbytes], out=self.arrays[nbytes])
        self.arrays[nbytes].wait_to_read()

    def memcpy(self, nbytes):
        self.sources[nbytes].copyto(self.targets[nbytes])
        self.targets[nbytes].wait_to_read()

    def block(self, nbytes, reps):
        """``reps`` timed memcpys then ``reps`` timed push+pulls of ``nbytes``: their seconds."""
        with harness.no_gc():
            memcpy = [_clock(self.memcpy, nbytes) for _ in range(reps)]
            self.pushpull(nbytes)   # untimed: lines the workers up after their copies
            return memcpy, [_clock(self.pushpull, nbytes) for _ in range(reps)]


def _lenet_calls(job, opts, ctx):
    """LeNet's reduction (``allreduce_across`` of its flat gradient) and its whole step, each a function timed
    alone (``waitall`` before and after); and the replica whose gradient they sum."""
    from parallel import Reducer, get_params, init_lenet_params, train_batch
    from parallel.job import allreduce_across, broadcast_params
    device_params = [get_params(init_lenet_params(seed=0), ctx)]
    broadcast_params(job, device_params)
    X, y = harness.random_batch(opts.batch_size)

    def reduction():
        return harness.timed(lambda: allreduce_across(job, [params.grad for params in device_params]))

    def step():
        return harness.timed(lambda: train_batch(X, y, device_params, [ctx], opts.lr, reducer=Reducer(job=job)))
    return reduction, step, device_params[0]


def worker_kvstore(opts):
    """Parts 1 and 2: the push+pull sweep against memcpy, and LeNet's allreduce_across against its step."""
    import mxnet as mx
    from parallel.job import join

    job = join()
    print(READY_LINE, flush=True)
    ctx, sizes = mx.cpu(0), opts.sizes
    sweep = _Sweep(job.kv, sizes, ctx)
    reduction, step, replica = _lenet_calls(job, opts, ctx)
    for nbytes in sizes:   # warm-up: first touch, the servers' merge buffers
        sweep.memcpy(nbytes)
        sweep.pushpull(nbytes)
    for _ in range(max(1, opts.warmup)):
        step()
    reduction()
    lenet_reps = 3 if opts.quick else max(5, opts.steps // 4)
    samples = {"pushpull": {n: [] for n in sizes}, "memcpy": {n: [] for n in sizes}, "allreduce_across": [],
               "train_batch": []}
    for r, order in enumerate(harness.round_orders(sizes, opts.rounds, "rotate"), 1):   # the size order rotates
        for nbytes in order:
            memcpy, pushpull = sweep.block(nbytes, _sweep_reps(nbytes, opts.quick))
            samples["memcpy"][nbytes] += memcpy
            samples["pushpull"][nbytes] += pushpull
            print(f"round {r}: {harness.size_label(nbytes)} done", flush=True)   # progress for --stall-timeout
        replica.grad[:] = 0   # the sums stay zero (a pulled sum is pushed again by the next call)
        samples["allreduce_across"] += [reduction() for _ in range(lenet_reps)]
        samples["train_batch"] += [step() for _ in range(lenet_reps)]
        print(f"round {r}: LeNet done", flush=True)
    harness.report_result({
        "kind": "kvstore", "rank": job.rank, "num_workers": job.num_workers,
        "num_servers": int(os.environ.get("DMLC_NUM_SERVER", "0")), "kvstore": job.kv.type,
        "env": _environment(), "lenet_floats": int(replica.grad.size),
        "pushpull_s": {str(n): v for n, v in samples["pushpull"].items()},
        "memcpy_s": {str(n): v for n, v in samples["memcpy"].items()},
        "allreduce_across_s": samples["allreduce_across"], "train_batch_s": samples["train_batch"]})


def worker_local(opts):
    """Configuration a: one process, ``train_batch`` without a job on ``--local-k`` contexts."""
    import mxnet as mx
    from parallel import get_params, init_lenet_params, train_batch
    ctx_list = [mx.cpu(i) for i in range(opts.local_k)]
    device_params = [get_params(init_lenet_params(seed=0), c) for c in ctx_list]
    X, y = harness.random_batch(opts.batch_size)
    seconds = _seconds_of_steps(lambda: train_batch(X, y, device_params, ctx_list, opts.lr), opts.warmup,
                                opts.steps)
    harness.report_result({"kind": "local", "rank": 0, "num_workers": 1, "contexts": len(ctx_list),
                           "seconds": seconds, "env": _environment(), "params_checksum": _checksum(device_params[0])})


def worker_scratch(opts):
    """Configuration b: the from-scratch ``train_batch(..., reducer=Reducer(job=job))``, one context per worker."""
    import mxnet as mx
    from parallel import Reducer, get_params, init_lenet_params, train_batch
    from parallel.job import broadcast_params, join
    job = join()
    print(READY_LINE, flush=True)
    ctx_list = [mx.cpu(0)]
    device_params = [get_params(init_lenet_params(seed=0), ctx_list[0])]
    broadcast_params(job, device_params)
    X, y = harness.random_batch(opts.batch_size)
    seconds = _seconds_of_steps(
        lambda: train_batch(X, y, device_params, ctx_list, opts.lr, reducer=Reducer(job=job)), opts.warmup,
        opts.steps)
    harness.report_result({"kind": "scratch", "rank": job.rank, "num_workers": job.num_workers, "seconds": seconds,
                           "env": _environment(), "params_checksum": _checksum(device_params[0])})


def worker_gluon(opts):
    """Configuration c: MXNet's gluon.Trainer on a dist_sync kvstore, a hybridized gluon LeNet."""
    import mxnet as mx
    from mxnet import autograd, gluon
    from parallel import init_lenet_params, to_gluon
    from parallel.job import worker_slice
    from parallel.mxnet_compat import trainer_is_distributed, trainer_updates_on_kvstore
    # The Trainer takes "str or KVStore"; given the store itself (as MXNet's example/distributed_training does)
    # it takes the same path as with kvstore='dist_sync', and this worker knows its rank before the first step.
    kv = mx.kv.create("dist_sync")
    print(READY_LINE, flush=True)
    ctx = mx.cpu(0)
    net = to_gluon(init_lenet_params(seed=0), ctx)
    net.hybridize(static_alloc=True, static_shape=True)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": opts.lr}, kvstore=kv)
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    X, y = harness.random_batch(opts.batch_size)
    n = X.shape[0]
    start, stop = worker_slice(n, 1, kv.rank, kv.num_workers)

    def step():
        X_slice, y_slice = X[start:stop], y[start:stop]
        with autograd.record():
            l = loss(net(X_slice), y_slice)
        l.backward()
        trainer.step(n)   # the global batch: the servers sum the workers' gradients, then divide by n

    seconds = _seconds_of_steps(step, opts.warmup, opts.steps)
    params = [p.data(ctx) for p in net.collect_params().values()]
    harness.report_result({
        "kind": "gluon", "rank": kv.rank, "num_workers": kv.num_workers, "seconds": seconds, "env": _environment(),
        "params_checksum": _checksum(params), "kvstore": kv.type,
        # read after the first step, which decides them
        "update_on_kvstore": trainer_updates_on_kvstore(trainer), "distributed": trainer_is_distributed(trainer)})


WORKERS = {"kvstore": worker_kvstore, "local": worker_local, "scratch": worker_scratch, "gluon": worker_gluon}


def worker_main(argv):
    """A worker process of kind ``argv[0]``: measure, print one RESULT line; a failure ends it at once."""
    parser = argparse.ArgumentParser(prog="distributed.py --worker")
    parser.add_argument("kind", choices=sorted(WORKERS))
    parser.add_argument("--sizes", action=harness.CommaList, item=int, minimum=1, default=SIZES)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--local-k", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    opts = parser.parse_args(argv)
    try:
        WORKERS[opts.kind](opts)
        gc.collect()   # anything of MXNet's kept alive by a cycle goes now, before the interpreter's teardown
    except BaseException:
        # End at once with the traceback: leaving through the interpreter's exit would run ps-lite's shutdown,
        # a barrier of every worker, which waits forever for a peer still blocked on this worker's push.
        import traceback
        from parallel.job import abandon
        traceback.print_exc()
        abandon(1)
    return 0


# ----------------------------------------------------------------------------------------------
# Driver: launches the jobs and processes one at a time, parses their RESULT lines
# ----------------------------------------------------------------------------------------------

_WORKER_LINE = re.compile(r"^\[worker (\d+)\] (.*)$")


def _children_environments(ppid):
    """Role, pid and ``OMP_NUM_THREADS`` of every process of the job whose parent is ``ppid`` (the launcher), read
    from ``/proc/PID/environ``: the environment each one started with, which is what MXNet read. Children with no
    ``DMLC_ROLE`` (the launcher's watchdog) are left out."""
    found = []
    for entry in (name for name in os.listdir("/proc") if name.isdigit()):
        env = harness.proc_environ(entry) if harness.proc_parent(entry) == ppid else None
        if env is not None and "DMLC_ROLE" in env:   # not the launcher's watchdog, which is no process of the job
            found.append({"role": env["DMLC_ROLE"], "pid": int(entry),
                          "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "unset")})
    return sorted(found, key=lambda p: (["scheduler", "server", "worker"].index(p["role"])
                                        if p["role"] in ("scheduler", "server", "worker") else 3, p["pid"]))


def _drain(pipe, sink):
    for line in iter(pipe.readline, ""):
        sink.put(line.rstrip("\n"))
    pipe.close()
    sink.put(None)


def _stderr_tail(lines, count=15):
    return " | ".join(line.strip() for line in lines[-count:] if line.strip()) or "nothing on stderr"


def _worker_command(kind, args, **extra):
    argv = [sys.executable, THIS, WORKER_FLAG, kind, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch-size", str(args.batch_size), "--lr", str(args.lr)]
    for name, value in extra.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv + (["--quick"] if args.quick else [])


class _Launcher:
    """``python -m parallel.launch`` running one job, its stdout and stderr read by threads of their own."""

    def __init__(self, argv, env):
        self.process = subprocess.Popen(argv, cwd=harness.ROOT, env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out, self.err = queue.Queue(), queue.Queue()
        self.readers = [threading.Thread(target=_drain, args=(self.process.stdout, self.out), daemon=True),
                        threading.Thread(target=_drain, args=(self.process.stderr, self.err), daemon=True)]
        for reader in self.readers:
            reader.start()

    def worker_lines(self, started, timeout, label):
        """``(launch index, text)`` of each ``[worker i] text`` line it prints, until it closes its stdout;
        ``BenchmarkError`` once ``timeout`` seconds have passed since ``started`` (``time.perf_counter``)."""
        while True:
            try:
                line = self.out.get(timeout=1.0)
            except queue.Empty:
                if time.perf_counter() - started > timeout:
                    raise BenchmarkError(f"{label}: the job ran longer than {timeout:g} s; stopped it") from None
                continue
            if line is None:
                return
            match = _WORKER_LINE.match(line)
            if match:
                yield int(match.group(1)), match.group(2)

    def stop(self):
        """SIGTERM (the launcher stops every process it started), SIGKILL a minute later."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def stderr_lines(self):
        for reader in self.readers:
            reader.join(5)
        lines = []
        while not self.err.empty():
            line = self.err.get()
            if line is not None:
                lines.append(line)
        return lines


def _launcher_argv(command, workers, stall_timeout, job_threads):
    argv = [sys.executable, "-m", "parallel.launch", "-n", str(workers), "-s", str(workers),
            "--stall-timeout", str(stall_timeout)]
    if job_threads:
        argv += ["--env", f"OMP_NUM_THREADS:{job_threads}"]
    return argv + list(command)


def launch_job(label, command, workers, stall_timeout, job_threads=0, timeout=3600):
    """Run ``command`` on ``workers`` workers and as many servers under ``python -m parallel.launch``.

    Returns ``{"results": [RESULT dicts, by rank], "processes": [role, pid, OMP_NUM_THREADS of each], "seconds"}``;
    raises ``BenchmarkError`` with the launcher's ``error:`` line when the job fails or stalls, or when a worker
    reports nothing. ``job_threads`` 0 leaves ``OMP_NUM_THREADS`` to the launcher (it splits the cores).
    """
    env = harness.child_env()
    env.pop("OMP_NUM_THREADS", None)
    started = time.perf_counter()
    launcher = _Launcher(_launcher_argv(command, workers, stall_timeout, job_threads), env)
    results, processes = {}, []
    try:
        for index, text in launcher.worker_lines(started, timeout, label):
            if text == READY_LINE and not processes:   # every process of the job is up: read their settings
                processes = _children_environments(launcher.process.pid)
            elif text.startswith(RESULT_PREFIX):
                result = dict(harness.read_result(text), launch_index=index)
                results[result["rank"]] = result
        status = launcher.process.wait(timeout=120)
    except BaseException:
        launcher.stop()
        raise
    finally:
        err_lines = launcher.stderr_lines()
    if status != 0:
        errors = [line for line in err_lines if line.startswith("error:")]
        raise BenchmarkError(f"{label}: python -m parallel.launch exited with status {status}: "
                             f"{errors[-1] if errors else _stderr_tail(err_lines)}")
    if sorted(results) != list(range(workers)):
        raise BenchmarkError(f"{label}: expected a {RESULT_PREFIX.strip()} line from ranks 0..{workers - 1}, got "
                             f"{sorted(results)}; the launcher's stderr: {_stderr_tail(err_lines)}")
    return {"results": [results[r] for r in range(workers)], "processes": processes,
            "seconds": time.perf_counter() - started}


def run_local(command, threads, timeout=3600):
    """Configuration a: one process with ``OMP_NUM_THREADS=threads``; returns its RESULT dict."""
    out, _ = harness.run_process(command, env=harness.child_env(OMP_NUM_THREADS=str(threads)), timeout=timeout)
    return harness.read_result(out, "a (one process)")


def _omp_by_role(job):
    """``{"scheduler": [...], "server": [...], "worker": [...]}``: OMP_NUM_THREADS of each process."""
    roles = {}
    for p in job["processes"]:
        roles.setdefault(p["role"], []).append(p["OMP_NUM_THREADS"])
    if "worker" not in roles:   # /proc unreadable: the workers' own reports
        roles["worker"] = [r["env"]["OMP_NUM_THREADS"] for r in job["results"]]
    return roles


def _sweep_size(results, key, bound):
    """One size of the push+pull sweep: rank 0's medians, and every rank's."""
    rank0, nbytes = results[0], int(key)
    pushpull, memcpy = harness.median(rank0["pushpull_s"][key]), harness.median(rank0["memcpy_s"][key])
    floats = nbytes // ITEMSIZE
    return {"bytes": nbytes, "label": harness.size_label(nbytes), "floats": floats,
            "split_over_servers": bool(floats >= bound and rank0["num_servers"] > 1),
            "pushpull_s": pushpull, "memcpy_s": memcpy,
            "pushpull_gbps": nbytes / pushpull / 1e9, "memcpy_gbps": nbytes / memcpy / 1e9,
            "fraction_of_memcpy": memcpy / pushpull,
            "per_rank": [{"rank": r["rank"], "pushpull_s": harness.median(r["pushpull_s"][key]),
                          "memcpy_s": harness.median(r["memcpy_s"][key]),
                          "samples": {"pushpull_s": r["pushpull_s"][key], "memcpy_s": r["memcpy_s"][key]}}
                         for r in results]}


def summarize_kvstore(job, workers):
    results = job["results"]
    rank0 = results[0]
    bound = rank0["env"]["MXNET_KVSTORE_BIGARRAY_BOUND"]
    sizes = sorted((_sweep_size(results, key, bound) for key in rank0["pushpull_s"]), key=lambda s: s["bytes"])
    allreduce_ms = harness.median(rank0["allreduce_across_s"]) * 1000
    step_ms = harness.median(rank0["train_batch_s"]) * 1000
    lenet_floats = rank0["lenet_floats"]
    reduction = {
        "floats": lenet_floats, "bytes": lenet_floats * ITEMSIZE,
        "split_over_servers": bool(lenet_floats >= bound and rank0["num_servers"] > 1),
        "allreduce_across_ms": allreduce_ms, "train_batch_ms": step_ms, "fraction": allreduce_ms / step_ms,
        "per_rank": [{"rank": r["rank"], "allreduce_across_ms": harness.median(r["allreduce_across_s"]) * 1000,
                      "train_batch_ms": harness.median(r["train_batch_s"]) * 1000,
                      "samples_ms": {"allreduce_across": [s * 1000 for s in r["allreduce_across_s"]],
                                     "train_batch": [s * 1000 for s in r["train_batch_s"]]}} for r in results]}
    common = {"workers": workers, "servers": rank0["num_servers"], "kvstore": rank0["kvstore"],
              "MXNET_KVSTORE_BIGARRAY_BOUND": bound, "timings_from": "rank 0 (every rank in per_rank)",
              "omp_num_threads": _omp_by_role(job), "processes": job["processes"]}
    return {**common, "sizes": sizes}, {**common, **reduction}


def _measure_config(args, config, local_threads):
    """One round's measurement of configuration ``config`` (a, b or c): its images/s from rank 0's time, and
    what the JSON records of the round."""
    if config == "a":
        result = run_local(_worker_command("local", args, local_k=args.local_k), local_threads)
        ranks, omp = [result], {"process": [result["env"]["OMP_NUM_THREADS"]]}
    else:
        job = launch_job(f"{config} ({CONFIG_NAMES[config]})",
                         _worker_command("scratch" if config == "b" else "gluon", args), args.workers,
                         args.stall_timeout, args.job_threads)
        ranks, omp = job["results"], _omp_by_role(job)
    images = args.batch_size * args.steps / ranks[0]["seconds"]   # rank 0's time
    detail = {"images_per_second": images, "omp_num_threads": omp,
              "per_rank": [{"rank": x["rank"], "seconds": x["seconds"],
                            "images_per_second": args.batch_size * args.steps / x["seconds"],
                            "OMP_NUM_THREADS": x["env"]["OMP_NUM_THREADS"],
                            "params_checksum": x["params_checksum"]} for x in ranks]}
    if config == "c":
        detail["update_on_kvstore"] = ranks[0]["update_on_kvstore"]
    return images, detail


def _images_rounds(args, local_threads):
    """Configurations a, b, c in each of ``--rounds`` rounds (the order rotates every round): the images/s of
    each, what each round recorded, and the rounds' rows."""
    samples, detail, rounds = {c: [] for c in CONFIGS}, {c: [] for c in CONFIGS}, []
    for r, order in enumerate(harness.round_orders(CONFIGS, args.rounds, "rotate"), 1):
        row = {"round": r, "order": order}
        for config in order:
            row[config], measured = _measure_config(args, config, local_threads)
            samples[config].append(row[config])
            detail[config].append({"round": r, **measured})
        rounds.append(row)
        print(f"round {r}/{args.rounds}: " + ", ".join(f"{c} {row[c]:.0f} images/s" for c in CONFIGS),
              file=sys.stderr, flush=True)
    return samples, detail, rounds


def _images_summary(args, samples, detail, rounds):
    """The images/s part of the JSON: every configuration's medians and rounds, and the ratios of the medians."""
    medians = harness.medians(samples)
    ratio_pairs = {"b/a": ("b", "a"), "c/a": ("c", "a"), "b/c": ("b", "c")}
    configs = {}
    for c in CONFIGS:
        configs[c] = {"name": CONFIG_NAMES[c].replace("W", str(args.workers)), "images_per_second": medians[c],
                      "samples": samples[c], "omp_num_threads": detail[c][-1]["omp_num_threads"],
                      "rounds": detail[c],
                      "params_agree_across_ranks": all(len({p["params_checksum"] for p in d["per_rank"]}) == 1
                                                       for d in detail[c]),
                      "params_checksum": detail[c][0]["per_rank"][0]["params_checksum"],
                      "processes": (1 if c == "a" else f"{args.workers} workers + {args.workers} servers + scheduler"),
                      "contexts_per_process": args.local_k if c == "a" else 1}
    configs["c"]["update_on_kvstore"] = all(d["update_on_kvstore"] for d in detail["c"])
    return {
        "global_batch": args.batch_size, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "timing": "rank 0's seconds for the timed steps (every rank's in configs.<c>.rounds[].per_rank); images/s = "
                  "global batch x steps / seconds; medians over rounds",
        "configs": configs,
        "ratios": {name: medians[x] / medians[y] for name, (x, y) in ratio_pairs.items()},
        "ratios_per_round": {name: [row[x] / row[y] for row in rounds] for name, (x, y) in ratio_pairs.items()},
        "per_round": rounds}


def run(args):
    """The whole benchmark: the kvstore job (parts 1 and 2), then the images/s rounds (part 3); the JSON."""
    cores = _cores()
    local_threads = args.local_threads or cores
    print(f"kvstore job: push+pull sweep and LeNet reduction, {args.workers} workers ...", file=sys.stderr,
          flush=True)
    started = time.perf_counter()
    kv_job = launch_job("push+pull sweep job", _worker_command("kvstore", args, sizes=",".join(map(str, args.sizes)),
                                                                 rounds=args.rounds),
                        args.workers, args.stall_timeout, args.job_threads)
    kv_job_seconds = time.perf_counter() - started
    sweep, reduction = summarize_kvstore(kv_job, args.workers)
    images = _images_summary(args, *_images_rounds(args, local_threads))
    env0 = kv_job["results"][0]["env"]
    return {
        "command": "python benchmarks/distributed.py " + " ".join(args.argv),
        "machine": {"cores": cores, "cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "mxnet": env0["mxnet"],
                    "MXNET_CPU_WORKER_NTHREADS": env0["MXNET_CPU_WORKER_NTHREADS"]},
        "settings": {"workers": args.workers, "servers": args.workers, "rounds": args.rounds, "steps": args.steps,
                     "warmup": args.warmup, "batch_size": args.batch_size, "lr": args.lr, "local_k": args.local_k,
                     "local_threads": local_threads,
                     "job_threads": args.job_threads or "the launcher's split of the cores",
                     "sizes": args.sizes, "stall_timeout": args.stall_timeout, "quick": args.quick,
                     "MXNET_KVSTORE_BIGARRAY_BOUND": env0["MXNET_KVSTORE_BIGARRAY_BOUND"]},
        "omp_num_threads": {"pushpull_job": sweep["omp_num_threads"],
                            **{c: images["configs"][c]["omp_num_threads"] for c in CONFIGS}},
        "pushpull": sweep,
        "lenet_reduction": reduction,
        "images_per_second": images,
        "wall_seconds": {"kvstore_job": kv_job_seconds},
    }


def _omp_text(roles):
    """``workers 1,1; servers 1,1; scheduler 1`` or ``2`` for one process."""
    if "process" in roles:
        return roles["process"][0]
    names = {"worker": "workers", "server": "servers", "scheduler": "scheduler"}
    return "; ".join(f"{names.get(role, role)} {','.join(values)}" for role, values in
                     sorted(roles.items(), key=lambda kv: ["worker", "server", "scheduler"].index(kv[0])
                            if kv[0] in names else 3))


def _sweep_table(sweep):
    return [f"push+pull sweep: {sweep['workers']} workers, {sweep['servers']} servers ({sweep['kvstore']}), "
            f"MXNET_KVSTORE_BIGARRAY_BOUND={sweep['MXNET_KVSTORE_BIGARRAY_BOUND']}; OMP_NUM_THREADS: "
            f"{_omp_text(sweep['omp_num_threads'])}; rank 0's medians", ""] + harness.markdown_table(
        ["size", "floats", "split over servers", "push+pull ms", "push+pull GB/s", "memcpy ms", "memcpy GB/s",
         "push+pull / memcpy"],
        [[s["label"], f"{s['floats']:,}", "yes" if s["split_over_servers"] else "no", f"{s['pushpull_s'] * 1000:.3f}",
          f"{s['pushpull_gbps']:.3f}", f"{s['memcpy_s'] * 1000:.3f}", f"{s['memcpy_gbps']:.2f}",
          f"{s['fraction_of_memcpy']:.3f}"] for s in sweep["sizes"]])


def _reduction_table(reduction, images):
    return [f"LeNet's reduction per step (global batch {images['global_batch']}, {reduction['workers']} workers; "
            f"flat gradient {reduction['floats']:,} floats = {reduction['bytes'] / KB:.0f} KB, "
            f"{'split over' if reduction['split_over_servers'] else 'on one of'} the servers); rank 0's medians",
            ""] + harness.markdown_table(
        ["allreduce_across ms", "train_batch step ms", "allreduce / step"],
        [[f"{reduction['allreduce_across_ms']:.2f}", f"{reduction['train_batch_ms']:.2f}",
          f"{reduction['fraction']:.3f}"]])


def _images_table(images):
    rows = []
    for c in CONFIGS:
        cfg = images["configs"][c]
        extra = f", K={cfg['contexts_per_process']}" if c == "a" else ""
        if c == "c":
            extra += f", update_on_kvstore={cfg['update_on_kvstore']}"
        rows.append([f"({c}) {cfg['name']}{extra}", _omp_text(cfg["omp_num_threads"]),
                     f"{cfg['images_per_second']:.0f}", ", ".join(f"{v:.0f}" for v in cfg["samples"])])
    checksums = ", ".join(f"{c} {images['configs'][c]['params_checksum']:.6f}" for c in CONFIGS)
    agree = all(images["configs"][c]["params_agree_across_ranks"] for c in CONFIGS)
    return ([f"LeNet images/s, global batch {images['global_batch']}, {images['steps']} timed steps after "
             f"{images['warmup']} warm-up, median of {images['rounds']} interleaved round(s), rank 0's time", ""]
            + harness.markdown_table(["configuration", "OMP_NUM_THREADS of each process", "images/s", "per round"],
                                     rows)
            + ["", f"sum of |parameters| after the warm-up and timed steps (round 1, rank 0): {checksums}; "
                   f"the ranks of each job {'agree' if agree else 'DISAGREE'}",
               "ratios of the medians: " + ", ".join(f"{name} = {value:.2f}"
                                                     for name, value in images["ratios"].items())])


def render_table(result):
    """The three markdown tables of a run (the sweep, LeNet's reduction, the images/s), as one text."""
    images = result["images_per_second"]
    return "\n".join(_sweep_table(result["pushpull"]) + [""] + _reduction_table(result["lenet_reduction"], images)
                     + [""] + _images_table(images))


def plot(result, path):
    """Two panels: GB/s against size (push+pull and memcpy), and images/s of a, b, c; written atomically."""
    from matplotlib.ticker import FixedLocator, NullLocator

    sweep, images = result["pushpull"], result["images_per_second"]
    fig, (ax_bw, ax_img) = harness.figure(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    sizes = [s["bytes"] for s in sweep["sizes"]]
    ax_bw.plot(sizes, [s["pushpull_gbps"] for s in sweep["sizes"]], "o-",
               label=f"kvstore push + pull ({sweep['workers']} workers, {sweep['servers']} servers)")
    ax_bw.plot(sizes, [s["memcpy_gbps"] for s in sweep["sizes"]], "s--", label="memcpy (copyto, same process)")
    bound = sweep["MXNET_KVSTORE_BIGARRAY_BOUND"]
    if min(sizes) <= bound * ITEMSIZE <= max(sizes):
        ax_bw.axvline(bound * ITEMSIZE, color="gray", linestyle=":",
                      label=f"MXNET_KVSTORE_BIGARRAY_BOUND ({bound:,} floats): larger arrays split over the servers")
    ax_bw.set_xscale("log")
    ax_bw.set_yscale("log")
    ax_bw.xaxis.set_major_locator(FixedLocator(sizes))
    ax_bw.xaxis.set_minor_locator(NullLocator())
    ax_bw.set_xticklabels([harness.size_label(n) for n in sizes])
    ax_bw.set_xlabel("array size (float32)")
    ax_bw.set_ylabel("GB/s (10^9 bytes / s, median)")
    ax_bw.set_title(f"push+pull vs memcpy, OMP_NUM_THREADS: {_omp_text(sweep['omp_num_threads'])}", fontsize=9)
    ax_bw.grid(True, which="both", alpha=0.3)
    ax_bw.legend(fontsize=8, loc="lower right")
    labels, values = [], []
    for c in CONFIGS:
        cfg = images["configs"][c]
        labels.append(f"({c}) " + {"a": f"1 process\nK={cfg['contexts_per_process']}",
                                   "b": f"from scratch\n{sweep['workers']} workers",
                                   "c": f"gluon.Trainer\n{sweep['workers']} workers"}[c]
                      + f"\nOMP {_omp_text(cfg['omp_num_threads']).replace('; ', chr(10))}")
        values.append(cfg["images_per_second"])
    bars = ax_img.bar(range(len(values)), values, color=["tab:gray", "tab:blue", "tab:orange"])
    for bar, value in zip(bars, values):
        ax_img.annotate(f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom",
                        fontsize=8)
    ax_img.set_xticks(range(len(values)))
    ax_img.set_xticklabels(labels, fontsize=7)
    ax_img.set_ylabel(f"images / s (median of {images['rounds']} round(s))")
    ratios = ", ".join(f"{k} {v:.2f}" for k, v in images["ratios"].items())
    ax_img.set_title(f"LeNet, global batch {images['global_batch']}; {ratios}", fontsize=9)
    ax_img.grid(axis="y", alpha=0.3)
    ax_img.set_ylim(0, max(values) * 1.15)
    harness.save_figure(fig, path)


def build_parser():
    parser = argparse.ArgumentParser(prog="python benchmarks/distributed.py", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="workers (and servers) of every job; default 2")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians reported; default 5")
    parser.add_argument("--steps", type=int, default=40, help="timed LeNet steps per measurement; default 40")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each measurement; default 3")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch; default 256")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--local-k", type=int, default=1, help="contexts of configuration a; default 1")
    parser.add_argument("--local-threads", type=int, default=0,
                        help="OMP_NUM_THREADS of configuration a; default 0: every core")
    parser.add_argument("--job-threads", type=int, default=0,
                        help="OMP_NUM_THREADS of every worker and server of a job; default 0: the launcher's split")
    parser.add_argument("--sizes", action=harness.CommaList, item=int, minimum=1, default=None,
                        help="push+pull sizes in bytes, e.g. 4096,1048576; default 4 KB .. 64 MB")
    parser.add_argument("--stall-timeout", type=float, default=120.0,
                        help="the launcher's --stall-timeout for every job; default 120 s")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: 1 round, 3 steps, batch 32, sizes 4 KB and 1 MB")
    harness.add_out(parser, "distributed.json and distributed.png")
    return parser


def parse_args(argv):
    """The driver's arguments (``--quick`` applied; ``args.argv``: the command's words, for the JSON)."""
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.quick:
        args.rounds, args.steps, args.warmup, args.batch_size = 1, 3, 1, 32
        args.sizes = args.sizes or QUICK_SIZES
    args.sizes = args.sizes or SIZES
    return args


def _check(args):
    """The arguments' values (``ValueError`` naming the flag); the paths of the JSON (checked writable) and the
    PNG."""
    harness.check_minimum([("--workers", args.workers), ("--rounds", args.rounds), ("--steps", args.steps),
                           ("--batch-size", args.batch_size), ("--local-k", args.local_k)])
    if args.batch_size < args.workers:
        raise ValueError(f"--batch-size {args.batch_size} leaves a worker without an example; "
                         f"give at least --workers ({args.workers})")
    if any(n < ITEMSIZE or n % ITEMSIZE for n in args.sizes):
        raise ValueError(f"--sizes must be multiples of {ITEMSIZE} bytes (float32), got {args.sizes}")
    return harness.results_path(args.out, "distributed.json"), os.path.join(args.out, "distributed.png")


def _run_and_write(args, paths):
    result = run(args)
    harness.write_json(paths[0], result)
    plot(result, paths[1])
    print(f"{result['command']}\nmachine: {result['machine']}\n")
    print(render_table(result))


def main(argv=None):
    """Run the benchmark; 0 on success, 1 when a job or process failed, 2 for bad arguments."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == WORKER_FLAG:
        return worker_main(argv[1:])
    args = parse_args(argv)
    return harness.command_status(lambda: _check(args), lambda paths: _run_and_write(args, paths))


if __name__ == "__main__":
    sys.exit(harness.command(main))
