"""How many Python calls a training step of ``python -m parallel.train``'s loop makes, with nothing observed (no
``--trace``, no ``--logdir``): what the host pays a step beyond the devices' work, counted, not timed.

Run from the repository root::

    OMP_NUM_THREADS=1 python benchmarks/python_calls.py --data-dir digits
    python benchmarks/python_calls.py --quick          # synthetic data, a few steps: a smoke run

Each configuration (``--configurations``, default every one of ``CONFIGURATIONS``) runs the CLI's ``main`` in a
child process of its own (``--child NAME``: its imports and first steps are its own) for ``--epochs`` epochs of
``--batch-size`` on ``--devices`` (default ``cpu:2``). ``cProfile`` counts every Python call from one step's end to
the next's (``Report.step``, the CLI's ``on_step``, marks each) in every epoch after the first, so a count holds
one whole step of the loop (the batch drawn, its step queued, the metrics of an older step read) and nothing of an
epoch's evaluation or report; the figure is the calls divided by those steps. Counts do not depend on the machine's
speed, only on the code, MXNet's and the shapes: one run is the measurement. Writes ``python_calls.json`` to
``--out`` (with the most called functions of each configuration) and prints a table.
"""
import argparse
import cProfile
import os
import pstats
import shutil
import sys
import tempfile

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402

#: The configurations counted: issue 47's two (LeNet data-parallel, the ViT with tensor ranks of 2), their flags.
CONFIGURATIONS = {"lenet-data": ["--model", "lenet"], "vit-tensor2": ["--model", "vit", "--tensor", "2"]}


def build_parser():
    parser = harness.ArgumentParser(prog="python benchmarks/python_calls.py", description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=harness.mnist_dir, help="an MNIST-format directory (python benchmarks/digits_dataset.py --out "
                                           "digits); default: synthetic data")
    parser.add_argument("--configurations", action=harness.CommaList, names=list(CONFIGURATIONS),
                        default=list(CONFIGURATIONS), help="which to count; default all")
    parser.add_argument("--devices", default="cpu:2", help="the CLI's --devices; default cpu:2")
    parser.add_argument("--batch-size", type=int, default=64, help="default 64")
    parser.add_argument("--epochs", type=int, default=3, help="epochs; every one after the first is counted; "
                                                               "default 3")
    parser.add_argument("--quick", action="store_true", help="synthetic data, 2 epochs of 4 batches of 16: a smoke "
                                                             "run")
    parser.add_argument("--child", choices=list(CONFIGURATIONS), help=argparse.SUPPRESS)
    harness.add_out(parser, "python_calls.json")
    return parser


def cli_argv(args, name):
    """The CLI's arguments for configuration ``name``."""
    data = ["--data-dir", args.data_dir] if args.data_dir else ["--dataset", "synthetic"]
    return [*CONFIGURATIONS[name], *data, "--devices", args.devices, "--epochs", str(args.epochs),
            "--batch-size", str(args.batch_size), "--no-progress"]


def count(argv, top=15):
    """Run the CLI's ``main(argv)`` here, counting Python calls between consecutive steps of every epoch after the
    first; ``{"calls_a_step", "steps", "top": [[calls a step, function], ...]}``."""
    from parallel.report import Report
    from parallel.train import main
    windows, open_window = [], [None]   # the counted steps' profiles; the one running: (epoch, batch, profile)
    step = Report.step

    def counted(report, epoch, batch):
        if open_window[0] is not None:
            before, profile = open_window[0][:2], open_window[0][2]
            profile.disable()
            if before == (epoch, batch - 1):   # one whole step of the loop, within an epoch: kept
                windows.append(profile)
            open_window[0] = None   # else an epoch's end (its evaluation, its report) was in it: dropped
        step(report, epoch, batch)
        if epoch > 1:
            open_window[0] = (epoch, batch, cProfile.Profile())
            open_window[0][2].enable()

    Report.step = counted
    try:
        status = main(argv)
    finally:
        Report.step = step
        if open_window[0] is not None:
            open_window[0][2].disable()
    if status != 0:
        raise harness.BenchmarkError(f"python -m parallel.train {' '.join(argv)} exited with {status}")
    if not windows:
        raise harness.BenchmarkError("no step was counted: give at least 2 epochs of at least 2 batches")
    stats = pstats.Stats(*windows)
    n = len(windows)
    rows = sorted(((calls / n, f"{os.path.basename(f)}:{line}({name})")
                   for (f, line, name), (_, calls, _, _, _) in stats.stats.items()), reverse=True)
    return {"calls_a_step": stats.total_calls / n, "steps": n, "top": [[round(c, 1), name] for c, name in rows[:top]]}


def measure(args, name):
    """Configuration ``name`` counted in a child process: its row of the results."""
    child = [sys.executable, os.path.abspath(__file__), "--child", name, "--devices", args.devices,
             "--batch-size", str(args.batch_size), "--epochs", str(args.epochs)]
    child += ["--data-dir", os.path.abspath(args.data_dir)] if args.data_dir else []
    out, _ = harness.run_process(child, env=harness.child_env())
    row = {"configuration": name, "argv": cli_argv(args, name), **harness.read_result(out, name)}
    print(f"{name}: {row['calls_a_step']:.0f} Python calls a step ({row['steps']} steps counted)", flush=True)
    return row


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.child:
        harness.report_result(count(cli_argv(args, args.child)))
        return 0
    if args.quick:   # 4 batches of 16 an epoch, of data written here
        from parallel import synthetic_dataset
        args.epochs, args.batch_size = 2, 16
        args.data_dir = tempfile.mkdtemp(prefix="python-calls-")
        harness.write_dataset(args.data_dir, synthetic_dataset(num_train=64, num_test=16))
    path = harness.results_path(args.out, "python_calls.json")
    try:
        rows = [measure(args, name) for name in args.configurations]
    finally:
        if args.quick:
            shutil.rmtree(args.data_dir, ignore_errors=True)
    table = "\n".join(harness.markdown_table(["configuration", "flags", "Python calls a step", "steps counted"],
                                   [[r["configuration"], " ".join(CONFIGURATIONS[r["configuration"]]),
                                     f"{r['calls_a_step']:,.0f}", r["steps"]] for r in rows]))
    print(table)
    harness.write_json(path, {"command": "python benchmarks/python_calls.py " + " ".join(argv or sys.argv[1:]),
                              "settings": harness.run_settings(), "devices": args.devices,
                              "batch_size": args.batch_size, "epochs": args.epochs, "rows": rows, "table": table})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(harness.command(main))
