"""What does an honest progress bar cost? fit() with at most IN_FLIGHT queued steps against queueing the whole epoch.

``parallel.fit`` (parallel/fit.py) reads each step's loss once two newer steps are queued, so its progress bar counts
finished batches and a NaN stops the run at its batch. The alternative is to queue every step of the epoch
and read the losses at the end (the bar then races ahead and stalls). Both run the same steps; this measures
seconds per epoch of each, interleaved round by round in one process, and reports medians and their ratio::

    python benchmarks/epoch_loop.py
    python benchmarks/epoch_loop.py --ks 1,2,4 --rounds 5 --batches 40

Thread settings change timings by 1.5-2x: the run states them, and both loops always share them.
"""
import argparse
import importlib
import os
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402

BATCH = 256


def build_parser():
    parser = argparse.ArgumentParser(prog="python benchmarks/epoch_loop.py", description=__doc__.splitlines()[0])
    parser.add_argument("--ks", action=harness.CommaList, item=int, minimum=1, default=[1, 2, 4],
                        help="numbers of CPU contexts; default 1,2,4")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    parser.add_argument("--batches", type=int, default=40, help="batches of 256 per epoch; default 40")
    parser.add_argument("--quick", action="store_true", help="1 round of 3 batches, K=1,2: a smoke test")
    parser.add_argument("--json", default=os.path.join(harness.RESULTS, "epoch_loop.json"),
                        help="where the JSON goes")
    return parser


def measure(args):
    """Seconds per epoch of each loop (``"bounded"``: ``fit``'s ``IN_FLIGHT`` steps queued; ``"whole epoch"``)
    at each K, interleaved round by round; the steps each loop may queue ahead."""
    import mxnet as mx
    from parallel import RunConfig, init_model, make_strategy, synthetic_dataset
    training = importlib.import_module("parallel.fit")   # the module, for its IN_FLIGHT

    dataset = synthetic_dataset(num_train=args.batches * BATCH, num_test=BATCH)
    loops = {"bounded": training.IN_FLIGHT, "whole epoch": 10 ** 9}   # steps the host may queue ahead
    strategies = {k: make_strategy("data", init_model("lenet"), [mx.cpu(i) for i in range(k)]) for k in args.ks}
    config = RunConfig(epochs=1, batch_size=BATCH)
    for k in args.ks:   # one warm-up epoch per K builds the cached graphs
        training.fit(dataset, strategies[k], 0.1, config)

    def epoch(key):
        name, k = key
        training.IN_FLIGHT = loops[name]
        try:
            history, _ = training.fit(dataset, strategies[k], 0.1, config)
        finally:
            training.IN_FLIGHT = loops["bounded"]
        return history[0]["seconds"]
    keys = [(name, k) for k in args.ks for name in loops]
    return harness.interleave(epoch, keys, args.rounds, order="fixed"), loops


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.quick:
        args.ks, args.rounds, args.batches = [1, 2], 1, 3
    settings = (f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, MXNET_CPU_WORKER_NTHREADS="
                f"{os.environ.get('MXNET_CPU_WORKER_NTHREADS', 'unset')}, os.cpu_count()={os.cpu_count()}")
    print(f"threads: {settings}")
    seconds, loops = measure(args)
    rows = []
    print(f"LeNet, {args.batches} batches of {BATCH} per epoch, median of {args.rounds} interleaved round(s)")
    print(f"{'K':>2} {'bounded (s)':>12} {'whole epoch (s)':>16} {'ratio':>6}")
    for k in args.ks:
        bounded, whole = (harness.median(seconds[(name, k)]) for name in loops)
        rows.append({"k": k, "bounded_s": bounded, "whole_epoch_s": whole, "ratio": bounded / whole,
                     "samples": {name: seconds[(name, k)] for name in loops}})
        print(f"{k:>2} {bounded:>12.3f} {whole:>16.3f} {bounded / whole:>5.2f}x")
    harness.write_json(args.json, {"settings": settings, "batches": args.batches, "rounds": args.rounds,
                                   "in_flight": loops["bounded"], "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(harness.command(main))
