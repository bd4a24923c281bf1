"""What an elastic job's commits cost: the training state committed in memory every N steps against none.

An elastic job's workers (``python -m parallel.launch -n MIN:MAX`` or ``--host-discovery-script``) commit their
state after every ``--commit-every N`` optimizer steps: the queued steps finished, the position's partial sums
summed, the parameters checked finite, and host copies of the parameters, BatchNorm's statistics and the
optimizer's state queued (``parallel.checkpoint.packer``), packed as a checkpoint's archive only when the launcher
asks for them. Here ``fit`` runs on one context with that commit
every 1 and every 10 steps, or none, for LeNet (batch 64) and ResNet-18 (batch 32) on synthetic data, with SGD and
momentum; ``--repeats`` rounds, each running every configuration once in a fresh shuffled order; the median seconds
per epoch, each against none. Run from the repository root::

    OMP_NUM_THREADS=2 python benchmarks/commits.py
    OMP_NUM_THREADS=1 python benchmarks/commits.py --quick            # smoke test

Writes ``commits.json`` to ``--out`` and prints the table.
"""
import argparse
import os
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402

#: Every configuration's commit interval in steps (None: no commit within the epoch).
EVERYS = (None, 1, 10)


def measure(args):
    """Seconds per epoch of each (model, commit interval), interleaved; a row each with its ratio to none."""
    import mxnet as mx
    from parallel import RunConfig, fit, init_model, make_strategy, synthetic_dataset
    from parallel.checkpoint import packer
    from parallel.optim import make_optimizer

    models = {"lenet": (64, 10 if args.quick else 100), "resnet18": (32, 2 if args.quick else 40)}
    samples = {(model, every): [] for model in models for every in EVERYS}
    sizes, packs = {}, []

    def committer(model):
        def commit(snapshot):   # what an elastic worker does at each commit (parallel.train_steps)
            packs.append(packer(snapshot, {}, model))
        return commit

    for repeat, order in enumerate(harness.round_orders(samples, args.repeats)):
        for model, every in order:
            batch, steps = models[model]
            dataset = synthetic_dataset(num_train=batch * steps, num_test=batch, seed=repeat)
            history, _ = fit(dataset, make_strategy("data", init_model(model), [mx.cpu(0)]),
                             make_optimizer("sgd", 0.01, momentum=0.9),
                             RunConfig(epochs=1, batch_size=batch, checkpoint_every=every),
                             on_checkpoint=committer(model) if every else None)
            samples[model, every].append(history[0]["seconds"])
            if packs:   # what one commit packs, when the launcher asks for it (not timed)
                sizes[model] = len(packs[-1]())
            packs.clear()
        print(f"round {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    rows = [{"model": model, "commit_every": every, "steps": models[model][1], "batch_size": models[model][0],
             "commit_bytes": sizes.get(model), "seconds": samples[model, every],
             "median_seconds": harness.median(samples[model, every])} for model in models for every in EVERYS]
    return harness.add_ratios(rows, group=lambda row: row["model"], value="median_seconds",
                              reference=lambda row: row["commit_every"] is None)


def render(rows):
    """The markdown table of the rows."""
    return harness.markdown_table(
        ["model", "commit", "state committed", "s/epoch (median)", "vs none"],
        [[row["model"], "none" if row["commit_every"] is None else f"every {row['commit_every']} step(s)",
          "-" if row["commit_every"] is None else harness.size_label(row["commit_bytes"]),
          f"{row['median_seconds']:.2f}", f"{row['ratio']:.2f}x"] for row in rows])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; default 3")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, seconds")
    harness.add_out(parser, "commits.json")
    args = parser.parse_args(argv)

    def check():
        harness.check_minimum([("--repeats", args.repeats)])
        if args.quick:
            args.repeats = 1
        return harness.results_path(args.out, "commits.json")

    def run(path):
        rows = measure(args)
        result = {"command": "python benchmarks/commits.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"), "rows": rows}
        harness.write_json(path, result)
        print("\n".join(render(rows)))
    return harness.command_status(check, run)


if __name__ == "__main__":
    sys.exit(harness.command(main))
