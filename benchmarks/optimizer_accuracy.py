"""Test accuracy after each epoch, and time per epoch, of plain SGD against momentum, weight decay and a cosine
schedule: LeNet and ResNet-18 on scikit-learn's digits (``benchmarks/digits_dataset.py``); and the ViT with and
without a mixture of experts.

Run from the repository root, one configuration after the other (about 8 minutes on 2 cores)::

    python benchmarks/digits_dataset.py --out digits
    OMP_NUM_THREADS=2 python benchmarks/optimizer_accuracy.py --data-dir digits
    OMP_NUM_THREADS=1 python benchmarks/optimizer_accuracy.py --data-dir digits --quick    # smoke test

Each configuration is ``python -m parallel.train`` with its flags (on one context unless they name the devices), in
its own process, its ``--metrics-json`` read back. The configurations (``CONFIGURATIONS``):

- ``resnet18/sgd``: the textbook's step, batch 64, lr 0.05, 4 epochs;
- ``resnet18/momentum``: momentum 0.9, weight decay 5e-4, cosine schedule, batch 64, lr 0.02, 4 epochs;
- ``resnet18/nesterov-2-epochs``: Nesterov momentum 0.9, weight decay 5e-4, a cosine over 2 epochs, batch 32,
  lr 0.02: the most accurate after two epochs of the settings tried (see benchmarks/README.md);
- ``lenet/sgd``: batch 32, lr 0.2, 20 epochs, seeds 0-3;
- ``lenet/nesterov``: Nesterov momentum 0.9, cosine schedule with one warm-up epoch, batch 32, lr 0.1,
  10 epochs, seeds 0-3;
- ``vit/adamw``: the docs' ViT run (docs/gluon.md: AdamW, batch 64, lr 0.003, weight decay 0.05, a cosine with one
  warm-up epoch, 20 epochs) on 2 contexts, seeds 0-2;
- ``vit-moe/adamw``: the same with a mixture of 4 experts in every other block, spread over the 2 contexts
  (``--experts 4 --expert-parallel 2``): whether the experts learn as well as the dense MLPs (docs/experts.md);
- ``vit-moe-gates-x4/adamw``: the same with every gate times 4 (``--gate-scale 4``, E: a near-uniform router's
  chosen expert weighs about what the dense MLP does).

``--seeds N`` runs seeds 0 .. N-1 of each configuration chosen instead of its own (docs/experts.md: 10 of both ViTs).

Writes ``optimizer_accuracy.json`` to ``--out``.
"""
import json
import os
import sys
import tempfile
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402

#: The docs' ViT run (docs/gluon.md) on 2 contexts.
VIT_FLAGS = ["--devices", "cpu:2", "--optimizer", "adamw", "--batch-size", "64", "--lr", "0.003", "--wd", "0.05",
             "--lr-schedule", "cosine", "--warmup-epochs", "1"]

#: name -> (model, epochs, seeds, flags)
CONFIGURATIONS = {
    "resnet18/sgd": ("resnet18", 4, [0], ["--batch-size", "64", "--lr", "0.05"]),
    "resnet18/momentum": ("resnet18", 4, [0], ["--batch-size", "64", "--lr", "0.02", "--momentum", "0.9", "--wd",
                                               "5e-4", "--lr-schedule", "cosine"]),
    "resnet18/nesterov-2-epochs": ("resnet18", 2, [0], ["--batch-size", "32", "--lr", "0.02", "--momentum", "0.9",
                                                        "--nesterov", "--wd", "5e-4", "--lr-schedule", "cosine"]),
    "lenet/sgd": ("lenet", 20, [0, 1, 2, 3], ["--batch-size", "32", "--lr", "0.2"]),
    "lenet/nesterov": ("lenet", 10, [0, 1, 2, 3], ["--batch-size", "32", "--lr", "0.1", "--momentum", "0.9",
                                                   "--nesterov", "--lr-schedule", "cosine", "--warmup-epochs", "1"]),
    "vit/adamw": ("vit", 20, [0, 1, 2], VIT_FLAGS),
    "vit-moe/adamw": ("vit", 20, [0, 1, 2], VIT_FLAGS + ["--experts", "4", "--expert-parallel", "2"]),
    "vit-moe-gates-x4/adamw": ("vit", 20, [0, 1, 2], VIT_FLAGS + ["--experts", "4", "--expert-parallel", "2",
                                                                  "--gate-scale", "4"]),
}


def run_one(model, epochs, seed, flags, data_dir, timeout):
    """One training run in its own process; returns its metrics history."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.json")
        devices = [] if "--devices" in flags else ["--devices", "cpu:1"]
        command = [sys.executable, "-m", "parallel.train", "--model", model, "--data-dir", data_dir, *devices,
                   "--epochs", str(epochs), "--seed", str(seed), "--no-progress", "--metrics-json", metrics, *flags]
        harness.run_process(command, timeout=timeout)
        with open(metrics) as f:
            return json.load(f)


def run(args):
    """Every configuration of ``--configurations``, each seed, one after the other; a record each."""
    records = []
    for name in args.configurations:
        model, epochs, seeds, flags = CONFIGURATIONS[name]
        if args.seeds is not None:
            seeds = list(range(args.seeds))
        if args.quick:
            epochs, seeds = 2, seeds[:1]   # two: a warm-up of one epoch needs a second
        for seed in seeds:
            history = run_one(model, epochs, seed, flags, args.data_dir, args.timeout)
            records.append({"configuration": name, "model": model, "seed": seed, "flags": flags,
                            "test_acc": [m["test_acc"] for m in history], "seconds": [m["seconds"] for m in history]})
            accuracies = " ".join(f"{acc:.3f}" for acc in records[-1]["test_acc"])
            print(f"{name:28s} seed {seed}: test acc after each epoch {accuracies}; "
                  f"{sum(records[-1]['seconds']) / len(history):.1f} s/epoch", flush=True)
    return records


def main(argv=None):
    parser = harness.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=harness.mnist_dir, required=True, help="an MNIST-format directory (benchmarks/digits_dataset.py)")
    parser.add_argument("--configurations", action=harness.CommaList, names=list(CONFIGURATIONS),
                        default=list(CONFIGURATIONS),
                        help=f"comma-separated, of {', '.join(CONFIGURATIONS)}; default all")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one run may take; default 3600")
    parser.add_argument("--seeds", type=int, default=None, metavar="N",
                        help="run seeds 0 .. N-1 of each configuration; default: the configuration's own")
    parser.add_argument("--quick", action="store_true", help="smoke test: two epochs of one seed each")
    harness.add_out(parser, "optimizer_accuracy.json")
    args = parser.parse_args(argv)
    if args.seeds is not None and args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    path = harness.results_path(args.out, "optimizer_accuracy.json")
    start = time.perf_counter()
    records = run(args)
    settings = {**harness.run_settings(unset="unset (the CLI: every core)"),
                "data_dir": os.path.basename(os.path.abspath(args.data_dir)),
                "seconds": time.perf_counter() - start, "quick": args.quick}
    print(f"wrote {harness.write_json(path, {'settings': settings, 'records': records})}")
    return 0


if __name__ == "__main__":
    sys.exit(harness.command(main))
