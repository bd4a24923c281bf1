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
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402

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
    """One sample in this fresh process: ``--warmup`` steps, then the ms per step of ``--steps``, as JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", choices=SETTINGS)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int)
    args = parser.parse_args(argv)
    import mxnet as mx
    import parallel
    from parallel.threads import omp_threads, set_omp_threads

    ctx = mx.cpu(0)
    if args.setting == "api":
        set_omp_threads(args.threads, [ctx])
    X, y = harness.random_batch(args.batch_size, ctx=ctx)
    device_params = [parallel.get_params(parallel.init_lenet_params(seed=0), ctx)]

    def step():
        parallel.train_batch(X, y, device_params, [ctx], 0.1)
    harness.warm_up([step], args.warmup)
    ms = harness.timed(step, args.steps) * 1000   # no host sync inside the timed steps
    print(json.dumps({"ms": ms, "worker_omp_threads": omp_threads(ctx),
                      "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset")}), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
# Parent: one fresh process per sample, round-robin over the settings
# ----------------------------------------------------------------------------------------------

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
    out, _ = harness.run_process(command, env=env, timeout=SAMPLE_TIMEOUT)
    return json.loads(out.strip().splitlines()[-1])


def run(args):
    import mxnet as mx

    samples = harness.interleave(lambda setting: sample(setting, args), SETTINGS, args.repeats, "rotate",
                                 progress="repeat")
    median = {s: harness.median(x["ms"] for x in samples[s]) for s in SETTINGS}
    results = [{"setting": s, "label": LABELS[s].format(n=args.threads),
                "OMP_NUM_THREADS": samples[s][0]["OMP_NUM_THREADS"],
                "worker_omp_threads": [x["worker_omp_threads"] for x in samples[s]],
                "ms": [x["ms"] for x in samples[s]], "median_ms": median[s]} for s in SETTINGS]
    for name, field in (("unset", "ratio_to_unset"), ("env", "ratio_to_env")):
        harness.add_ratios(results, group=lambda r: 0, reference=lambda r, name=name: r["setting"] == name,
                           field=field)
    return {
        "command": "python benchmarks/threads.py " + " ".join(args.argv),
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "mxnet": mx.__version__,
                    "MXNET_CPU_WORKER_NTHREADS": os.environ.get("MXNET_CPU_WORKER_NTHREADS", "unset (1)")},
        "settings": {"threads": args.threads, "batch_size": args.batch_size, "steps_per_sample": args.steps,
                     "warmup": args.warmup, "repeats": args.repeats, "quick": args.quick, "context": "cpu(0)",
                     "network": "lenet_cached", "order": "one fresh process per sample, round-robin, rotating"},
        "results": results,
    }


def render_table(result):
    lines = harness.markdown_table(
        ["setting", "worker threads", "median ms/step", "x unset", "x env"],
        [[r["label"], ",".join(str(t) for t in sorted(set(r["worker_omp_threads"]))), f"{r['median_ms']:.1f}",
          f"{r['ratio_to_unset']:.2f}", f"{r['ratio_to_env']:.2f}"] for r in result["results"]])
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
    harness.add_out(parser, "threads.json")
    return parser


def parse_args(argv):
    """The driver's arguments (``--quick`` applied; ``args.argv``: the command's words, for the JSON)."""
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.quick:
        args.steps, args.warmup, args.repeats, args.batch_size = 2, 1, 1, 32
    return args


def _check(args):
    """The arguments' values (``ValueError`` naming the flag); the JSON's path, checked writable."""
    from parallel.threads import recommended_omp_threads
    harness.check_minimum([("--threads", args.threads), ("--batch-size", args.batch_size),
                           ("--steps", args.steps), ("--repeats", args.repeats)])
    harness.check_minimum([("--warmup", args.warmup)], minimum=0)
    if args.threads > recommended_omp_threads():
        raise ValueError(f"--threads {args.threads} is more than the {recommended_omp_threads()} cores "
                         "this process may run on")
    return harness.results_path(args.out, "threads.json")


def _run_and_write(args, json_path):
    result = run(args)
    harness.write_json(json_path, result)
    print(f"{result['command']}\nmachine: {result['machine']}\nsettings: {result['settings']}\n")
    print(render_table(result))


def main(argv=None):
    """Run the benchmark; 0 on success, 1 when a worker failed, 2 for bad arguments."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == WORKER_FLAG:
        return worker_main(argv[1:])
    args = parse_args(argv)
    return harness.command_status(lambda: _check(args), lambda json_path: _run_and_write(args, json_path))


if __name__ == "__main__":
    sys.exit(harness.command(main))
