"""Does ``set_omp_threads`` after ``import mxnet`` give the CLI's speed? LeNet's step in four thread settings.

Run from the repository root::

    python benchmarks/threads.py                  # full run, about two minutes on 2 cores
    python benchmarks/threads.py --quick          # smoke test, seconds
    python benchmarks/threads.py --repeats 9 --steps 20 --out benchmarks/results

Measures the median ms per ``parallel.train_batch`` step of LeNet (the default cached network and
allreduce, one context ``mx.cpu(0)``, ``get_params(init_lenet_params(), mx.cpu(0))``, a synthetic batch of
``--batch-size`` 256) in three settings of the operator threads:

- ``unset``: ``OMP_NUM_THREADS`` unset, MXNet's default (half the cores), what ``import parallel`` in a
  notebook gets;
- ``env``: ``OMP_NUM_THREADS=--threads`` (default: every core, ``recommended_omp_threads()``) set before
  MXNet is imported, what ``python -m parallel.train`` does;
- ``api``: ``OMP_NUM_THREADS`` unset, ``parallel.threads.set_omp_threads(--threads)`` called after
  ``import mxnet``, before the first step.

The same call after the warm-up steps is not measured: changing the threads of a context that has run
operators corrupted the heap (aborts and hangs), so ``set_omp_threads`` refuses it with a ``RuntimeError``.

Every sample is a fresh process (the settings are process-wide and MXNet reads the environment once):
``--warmup`` steps, then ``--steps`` steps with no host sync in the loop and ``mx.nd.waitall()`` at the end.
The samples run one at a time, round-robin over the settings, the order rotating every repeat; reported are
the medians over ``--repeats`` and the ratios of the medians. Each process also reports the thread count
its context's worker thread ends with (``omp_threads``). Writes ``threads.json`` (atomically) to ``--out``
and prints a markdown table.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_FLAG = "--worker"
SETTINGS = ("unset", "env", "api")
LABELS = {
    "unset": "OMP_NUM_THREADS unset (MXNet default)",
    "env": "OMP_NUM_THREADS={n} before import",
    "api": "unset + set_omp_threads({n}) after import, before the first step",
}


# ----------------------------------------------------------------------------------------------
# Worker: one process, one setting, one sample
# ----------------------------------------------------------------------------------------------

def worker_main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", choices=SETTINGS)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int)
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    import mxnet as mx
    import numpy as np
    import parallel
    from parallel.threads import omp_threads, set_omp_threads

    ctx = mx.cpu(0)
    if args.setting == "api":
        set_omp_threads(args.threads, [ctx])
    rng = np.random.RandomState(0)
    X = mx.nd.array(rng.rand(args.batch_size, 1, 28, 28), ctx=ctx)
    y = mx.nd.array(rng.randint(0, 10, args.batch_size), ctx=ctx)
    device_params = [parallel.get_params(parallel.init_lenet_params(seed=0), ctx)]
    for _ in range(args.warmup):
        parallel.train_batch(X, y, device_params, [ctx], 0.1)
    mx.nd.waitall()
    start = time.perf_counter()
    for _ in range(args.steps):
        parallel.train_batch(X, y, device_params, [ctx], 0.1)   # no host sync inside the timed loop
    mx.nd.waitall()
    ms = (time.perf_counter() - start) / args.steps * 1000
    print(json.dumps({"ms": ms, "worker_omp_threads": omp_threads(ctx),
                      "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset")}), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
# Parent: one fresh process per sample, round-robin over the settings
# ----------------------------------------------------------------------------------------------

class BenchmarkError(RuntimeError):
    """A worker process failed."""


#: Seconds one sample (a fresh process: import, warm-up, timed steps) may take before it counts as failed.
SAMPLE_TIMEOUT = 600


def sample(setting, args):
    """One worker process: its JSON answer (ms per step, the worker thread's final thread count)."""
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if setting == "env":
        env["OMP_NUM_THREADS"] = str(args.threads)
    command = [sys.executable, os.path.abspath(__file__), WORKER_FLAG, "--setting", setting,
               "--threads", str(args.threads), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
    try:
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=SAMPLE_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise BenchmarkError(f"worker for setting {setting!r} did not finish within {SAMPLE_TIMEOUT} s") from None
    if done.returncode != 0:
        raise BenchmarkError(f"worker for setting {setting!r} exited with {done.returncode}:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args):
    import mxnet as mx

    samples = {s: [] for s in SETTINGS}
    for repeat in range(args.repeats):
        order = SETTINGS[repeat % len(SETTINGS):] + SETTINGS[:repeat % len(SETTINGS)]   # rotate the order
        for setting in order:
            samples[setting].append(sample(setting, args))
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    median = {s: statistics.median(x["ms"] for x in samples[s]) for s in SETTINGS}
    return {
        "command": "python benchmarks/threads.py " + " ".join(args.argv),
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "mxnet": mx.__version__,
                    "MXNET_CPU_WORKER_NTHREADS": os.environ.get("MXNET_CPU_WORKER_NTHREADS", "unset (1)")},
        "settings": {"threads": args.threads, "batch_size": args.batch_size, "steps_per_sample": args.steps,
                     "warmup": args.warmup, "repeats": args.repeats, "quick": args.quick, "context": "cpu(0)",
                     "network": "lenet_cached", "order": "one fresh process per sample, round-robin, rotating"},
        "results": [{"setting": s, "label": LABELS[s].format(n=args.threads),
                     "OMP_NUM_THREADS": samples[s][0]["OMP_NUM_THREADS"],
                     "worker_omp_threads": [x["worker_omp_threads"] for x in samples[s]],
                     "ms": [x["ms"] for x in samples[s]], "median_ms": median[s],
                     "ratio_to_unset": median[s] / median["unset"], "ratio_to_env": median[s] / median["env"]}
                    for s in SETTINGS],
    }


def render_table(result):
    lines = ["| setting | worker threads | median ms/step | x unset | x env |", "|---|---|---|---|---|"]
    for r in result["results"]:
        threads = ",".join(str(t) for t in sorted(set(r["worker_omp_threads"])))
        lines.append(f"| {r['label']} | {threads} | {r['median_ms']:.1f} | {r['ratio_to_unset']:.2f} | "
                     f"{r['ratio_to_env']:.2f} |")
    by = {r["setting"]: r for r in result["results"]}
    lines.append(f"\nunset / env = {by['unset']['median_ms'] / by['env']['median_ms']:.2f}x, "
                 f"unset / api = {by['unset']['median_ms'] / by['api']['median_ms']:.2f}x, "
                 f"api / env = {by['api']['ratio_to_env']:.2f}")
    return "\n".join(lines)


def build_parser():
    from parallel.threads import recommended_omp_threads

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=recommended_omp_threads(),
                        help="threads per operator for the env and api settings (default: every core)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per sample")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (graph caching, memory pools)")
    parser.add_argument("--repeats", type=int, default=7, help="samples per setting (median taken)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: tiny sizes, seconds")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    return parser


def main(argv=None):
    """Run the benchmark; 0 on success, 1 when a worker failed, 2 for bad arguments."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == WORKER_FLAG:
        return worker_main(argv[1:])
    sys.path.insert(0, ROOT)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.quick:
        args.steps, args.warmup, args.repeats, args.batch_size = 2, 1, 1, 32
    from parallel.files import atomic_write, check_writable
    from parallel.threads import recommended_omp_threads
    try:
        for flag, value in (("--threads", args.threads), ("--batch-size", args.batch_size),
                            ("--steps", args.steps), ("--repeats", args.repeats)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if args.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
        if args.threads > recommended_omp_threads():
            raise ValueError(f"--threads {args.threads} is more than the {recommended_omp_threads()} cores "
                             "this process may run on")
        os.makedirs(args.out, exist_ok=True)
        json_path = os.path.join(args.out, "threads.json")
        check_writable(json_path, "benchmark results")
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run(args)
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    with atomic_write(json_path) as f:
        json.dump(result, f, indent=2)
    print(f"{result['command']}\nmachine: {result['machine']}\nsettings: {result['settings']}\n")
    print(render_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
