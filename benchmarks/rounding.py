"""Is ``--accumulate N`` against the whole batch an error, or float32 rounding amplified by training?

Accumulating N micro-batches sums the same per-example gradients as the whole batch, in another order; in exact
arithmetic the two steps are equal. This script trains LeNet both ways from the same start, on the same batches,
in float32 and in float64, and records the difference of the parameters (the largest over the arrays of
``max |a - b| / max |b|``) after 1, 2, 4, 8, ... steps. An error would show in float64 as well and from the first
step at full size; rounding starts at float32's 1e-7 (float64's 1e-16) and grows step by step as training
amplifies it. The start and the batches are those of ``python -m parallel.train --seed 0`` (LeNet's initial
parameters, epoch 1's order), so the last row is what ``--accumulate N`` against ``--accumulate 1`` gives there.

    python benchmarks/rounding.py --data-dir digits           # held-out digits (benchmarks/digits_dataset.py)
    python benchmarks/rounding.py --dataset synthetic --steps 8

Writes ``benchmarks/results/rounding.json`` (``--out``) and prints one line a step count.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

#: The two optimizers of the finding (issue 27): plain SGD at lr 0.1, momentum 0.9 at lr 0.05.
OPTIMIZERS = {"sgd": {"lr": 0.1}, "momentum": {"lr": 0.05, "momentum": 0.9}}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None, help="an MNIST-format directory (default: --dataset synthetic)")
    parser.add_argument("--dataset", choices=["synthetic"], default="synthetic")
    parser.add_argument("--num-train", type=int, default=1500, help="synthetic: training examples")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2, help="CPU contexts")
    parser.add_argument("--steps", type=int, default=None, help="steps to take (default: one epoch)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                       "rounding.json"))
    return parser.parse_args(argv)


def _trajectory(dataset, dtype, accumulate, optimizer, args, record):
    """The parameters of the first replica after each step count in ``record``."""
    import mxnet as mx
    from parallel import get_params, init_lenet_params, iterate_batches, train_batch
    from parallel.data.batches import epoch_seed
    from parallel.optim import SGD

    ctx_list = [mx.cpu(i) for i in range(args.devices)]
    device_params = [get_params(init_lenet_params(seed=0, dtype=dtype), ctx) for ctx in ctx_list]
    rule = SGD(**OPTIMIZERS[optimizer])
    snapshots = {}
    batches = iterate_batches(dataset.train_images, dataset.train_labels, args.batch_size, shuffle=True,
                              seed=epoch_seed(0, 1))   # epoch 1's order in python -m parallel.train --seed 0
    for step, (X, y) in enumerate(batches, 1):
        train_batch(X.astype(dtype), y.astype(dtype), device_params, ctx_list, optimizer=rule, accumulate=accumulate)
        if step in record:
            snapshots[step] = [p.asnumpy() for p in device_params[0]]
        if step == max(record):
            break
    return snapshots


def difference(got, want):
    """The largest over the arrays of ``max |got - want| / max |want|``."""
    import numpy as np
    return max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want))


def run(args):
    from parallel import load_idx_dataset, synthetic_dataset
    dataset = (load_idx_dataset(args.data_dir) if args.data_dir else
               synthetic_dataset(num_train=args.num_train, num_test=10, seed=0))
    per_epoch = -(-len(dataset.train_labels) // args.batch_size)
    last = min(args.steps or per_epoch, per_epoch)
    record = sorted({2 ** i for i in range(last.bit_length()) if 2 ** i <= last} | {last})
    rows = []
    for optimizer in OPTIMIZERS:
        for dtype in ("float32", "float64"):
            whole = _trajectory(dataset, dtype, 1, optimizer, args, record)
            parts = _trajectory(dataset, dtype, args.accumulate, optimizer, args, record)
            for step in record:
                rows.append({"optimizer": optimizer, "dtype": dtype, "step": step,
                             "difference": difference(parts[step], whole[step])})
                print(f"{optimizer:8s} {dtype}: after {step:3d} step(s), accumulate {args.accumulate} against the "
                      f"whole batch differs by {rows[-1]['difference']:.2g} of an array's scale", flush=True)
    return {"data": args.data_dir or f"synthetic {args.num_train}", "batch_size": args.batch_size,
            "accumulate": args.accumulate, "devices": args.devices, "rows": rows}


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    from parallel.files import atomic_write
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with atomic_write(args.out) as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
