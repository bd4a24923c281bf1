"""BatchNorm across the workers of a job: what it changes in the model, and what it costs on a link.

Two parts, each a table and a results file:

- ``accuracy``: issue 50's runs, ResNet-18 on the held-out digits (``benchmarks/digits_dataset.py``), batch 64,
  lr 0.05, 3 epochs, one operator thread: one process on 2 contexts (statistics over the whole batch: the model the
  job must equal), a 2-worker job of one context each with the statistics over every worker's slice (the default,
  ``--batchnorm-stats job``), and the same job with each worker's own (``--batchnorm-stats worker``, the way before).
  Each epoch's train loss and test accuracy, from the runs' ``--metrics-json``, for each of ``--seeds`` (the
  initialization and the order of the examples), and their means over the seeds. One process on 1 context is the
  same model as on 2 in exact arithmetic: how far the two part in float32 is the yardstick of rounding (this
  initialization amplifies it) that the job's distance from one process is read against; the last epoch's test
  accuracy moves by several points from one seed to the next, so the distances are read between the means.
- ``cost``: the same 2-worker job on two simulated hosts (``benchmarks/cluster.py``: network namespaces, each link
  shaped each way) at each ``--rates``, ``--steps`` steps of ResNet-18 a epoch on the digits, 2 epochs, the
  second timed (the first builds the graphs and initialises the keys); ``job`` against ``worker`` statistics,
  ``--repeats`` rounds in a fresh shuffled order each; the median seconds of a step, and job's over worker's.
  Root only.

Run from the repository root::

    python benchmarks/digits_dataset.py --out digits
    python benchmarks/batchnorm.py --data-dir digits                 # both parts: about an hour and a half
    python benchmarks/batchnorm.py --data-dir digits --part accuracy --quick    # smoke test

Writes ``batchnorm_accuracy.json`` and ``batchnorm_cost.json`` to ``--out`` and prints the tables.
"""
import argparse
import json
import os
import shlex
import sys
import tempfile

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py and cluster.py, beside this script
import cluster as simulated  # noqa: E402
import harness  # noqa: E402

#: The accuracy part's runs: how each is launched (None: one process) and its flags beyond the common ones.
RUNS = {"one process, 1 context": (None, ["--devices", "cpu:1"]),
        "one process, 2 contexts": (None, ["--devices", "cpu:2"]),
        "2 workers, statistics of the job": (2, ["--devices", "cpu:1", "--batchnorm-stats", "job"]),
        "2 workers, statistics per worker": (2, ["--devices", "cpu:1", "--batchnorm-stats", "worker"])}
#: The cost part's settings of the statistics.
STATISTICS = ("job", "worker")


def _train(args, workers, flags, cwd, launch=()):
    """One run of ``python -m parallel.train`` (under the launcher for ``workers``); its ``--metrics-json``."""
    train = [sys.executable, "-m", "parallel.train", "--model", "resnet18", "--batch-size", str(args.batch_size),
             "--lr", "0.05", "--no-progress", "--metrics-json", "m.json", *flags]
    argv = train if workers is None else [sys.executable, "-m", "parallel.launch", "-n", str(workers),
                                          "-s", str(workers), *launch, *train]
    harness.run_process(argv, env=harness.child_env(OMP_NUM_THREADS="1"), cwd=cwd, timeout=args.timeout)
    with open(os.path.join(cwd, "m.json")) as f:
        return json.load(f)


def accuracy(args):
    """Each run of ``RUNS`` with each seed: its epochs' train loss and test accuracy; and by epoch their means over
    the seeds."""
    rows = {}
    for name, (workers, flags) in RUNS.items():
        seeds = {}
        for seed in args.seeds:
            print(f"accuracy: {name}, seed {seed} ...", flush=True)
            with tempfile.TemporaryDirectory() as cwd:
                metrics = _train(args, workers, ["--data-dir", os.path.abspath(args.data_dir), "--epochs",
                                                 str(args.epochs), "--seed", str(seed), *flags], cwd)
            seeds[str(seed)] = {key: [m[key] for m in metrics] for key in ("train_loss", "test_acc", "seconds")}
        rows[name] = {"seeds": seeds, **{key: [sum(epoch) / len(epoch) for epoch in zip(*[run[key] for run in
                                                                                           seeds.values()])]
                                         for key in ("train_loss", "test_acc")}}
    return {"epochs": args.epochs, "batch_size": args.batch_size, "seeds": args.seeds, "rows": rows}


def _step_seconds(args, cluster, statistics, cwd):
    """Seconds of a step of the second epoch of a 2-worker job over ``cluster``'s two hosts."""
    launch = ["--launcher", "ssh", "-H", cluster.hostfile, "--scheduler-host", cluster.host(1).address,
              "--env", "OMP_NUM_THREADS:1"]
    flags = ["--data-dir", os.path.abspath(args.data_dir), "--train-size", str(args.steps * args.batch_size),
             "--epochs", "2", "--devices", "cpu:1", "--batchnorm-stats", statistics]
    train = [sys.executable, "-m", "parallel.train", "--model", "resnet18", "--batch-size", str(args.batch_size),
             "--lr", "0.05", "--no-progress", "--metrics-json", "m.json", *flags]
    argv = [sys.executable, "-m", "parallel.launch", "-n", "2", "-s", "2", *launch, *train]
    harness.run_process(cluster.wrap(argv, 1), env=cluster.env(), cwd=cwd, timeout=args.timeout)
    with open(os.path.join(cwd, "m.json")) as f:
        return json.load(f)[-1]["seconds"] / args.steps


def cost(args):
    """At each rate: the median step with each setting of the statistics, and job's over worker's."""
    rows = []
    for rate in args.rates:
        samples = {statistics: [] for statistics in STATISTICS}
        with simulated.Cluster(2, rate) as cluster, tempfile.TemporaryDirectory() as cwd:
            for order in harness.round_orders(samples, args.repeats):
                for statistics in order:
                    print(f"cost: {rate}, statistics {statistics} ...", flush=True)
                    samples[statistics].append(_step_seconds(args, cluster, statistics, cwd))
        medians = {statistics: harness.median(values) for statistics, values in samples.items()}
        rows.append({"rate": rate, "samples": samples, "step_seconds": medians,
                     "ratio": medians["job"] / medians["worker"]})
    return {"steps": args.steps, "batch_size": args.batch_size, "repeats": args.repeats, "rows": rows}


def render_accuracy(result):
    rows = [[name, ", ".join(f"{v:.3f}" for v in row["train_loss"]), ", ".join(f"{v:.3f}" for v in row["test_acc"]),
             ", ".join(f"{run['test_acc'][-1]:.3f}" for run in row["seeds"].values())]
            for name, row in result["rows"].items()]
    seeds = ", ".join(map(str, result["seeds"]))
    return harness.markdown_table(["run", f"train loss by epoch, mean of seeds {seeds}", "test accuracy by epoch, mean",
                                   "last test accuracy, each seed"], rows)


def render_cost(result):
    rows = [[row["rate"], f"{row['step_seconds']['worker']:.2f}", f"{row['step_seconds']['job']:.2f}",
             f"{row['ratio']:.2f}x"] for row in result["rows"]]
    return harness.markdown_table(["link", "step, statistics per worker (s)", "step, statistics of the job (s)",
                                   "job / worker"], rows)


def run(args, paths):
    command = "python benchmarks/batchnorm.py " + shlex.join(args.argv)
    for part, path in paths.items():
        result = {"command": command, "settings": {**harness.run_settings(), "runs": "OMP_NUM_THREADS=1"},
                  **(accuracy(args) if part == "accuracy" else cost(args))}
        harness.write_json(path, result)
        print("\n".join(render_accuracy(result) if part == "accuracy" else render_cost(result)))


def main(argv=None):
    """The command (see the module's docstring); its exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=harness.mnist_dir, default=None,
                        help="the digits (benchmarks/digits_dataset.py --out DIR); needed")
    parser.add_argument("--part", choices=["accuracy", "cost", "both"], default="both", help="default both")
    parser.add_argument("--epochs", type=int, default=3, help="the accuracy part's epochs; default 3")
    parser.add_argument("--batch-size", type=int, default=64, help="default 64")
    parser.add_argument("--seeds", action=harness.CommaList, item=int, minimum=0, default=[0, 1, 2],
                        help="the accuracy part's seeds, comma-separated; default 0,1,2")
    parser.add_argument("--rates", action=harness.CommaList, default=["1gbit", "100mbit"],
                        help="the cost part's link rates (tc's), comma-separated; default 1gbit,100mbit")
    parser.add_argument("--steps", type=int, default=5, help="the cost part's steps a epoch; default 5")
    parser.add_argument("--repeats", type=int, default=3, help="the cost part's rounds; default 3")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take; default 1800")
    parser.add_argument("--quick", action="store_true", help="1 epoch of seed 0, batch 16, 1 round of 2 steps at "
                                                             "1gbit")
    harness.add_out(parser, "batchnorm_*.json")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.epochs, args.batch_size, args.rates, args.steps, args.repeats, args.seeds = 1, 16, ["1gbit"], 2, 1, [0]

    def check():
        harness.check_minimum([("--epochs", args.epochs), ("--batch-size", args.batch_size),
                               ("--steps", args.steps), ("--repeats", args.repeats)])
        parts = ["accuracy", "cost"] if args.part == "both" else [args.part]
        if args.data_dir is None:
            raise ValueError("--data-dir is needed: make the digits with " + harness.DIGITS_COMMAND + " digits")
        reason = simulated.unavailable() if "cost" in parts else None
        if reason:
            raise ValueError(f"the cost part's simulated hosts {reason}")
        return {part: harness.results_path(args.out, f"batchnorm_{part}.json") for part in parts}
    return harness.command_status(check, lambda paths: run(args, paths))


if __name__ == "__main__":
    sys.exit(harness.command(main))
