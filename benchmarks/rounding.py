"""Is ``--accumulate N`` against the whole batch (or ``--zero 3`` on K contexts, or ``--tensor T``, against one
context) an error, or float32 rounding amplified by training?

Accumulating N micro-batches sums the same per-example gradients as the whole batch, in another order; in exact
arithmetic the two steps are equal. This script trains LeNet both ways from the same start, on the same batches,
in float32 and in float64, and records the difference of the parameters (the largest over the arrays of
``max |a - b| / max |b|``) after 1, 2, 4, 8, ... steps. An error would show in float64 as well and from the first
step at full size; rounding starts at float32's 1e-7 (float64's 1e-16) and grows step by step as training
amplifies it. The start and the batches are those of ``python -m parallel.train --seed 0`` (LeNet's initial
parameters, epoch 1's order), so the last row is what ``--accumulate N`` against ``--accumulate 1`` gives there.

``--compare sharded`` asks the same of ZeRO-3: ``--zero 3`` on 2, 3 and 4 contexts (``--sharded-devices``)
against one context without sharding, with momentum SGD and with Adam (which turns rounding noise in near-zero
gradients into full-size steps: its difference is reported, not bounded). ``--compare tensor`` of tensor
parallelism: the ViT with ``--tensor 2`` on 2 contexts, ``--tensor 4`` on 4 and ``--tensor 2`` on 4 (two
data-parallel groups) against the ViT on one context, with momentum SGD and AdamW.

    python benchmarks/rounding.py --data-dir digits           # held-out digits (benchmarks/digits_dataset.py)
    python benchmarks/rounding.py --dataset synthetic --steps 8
    python benchmarks/rounding.py --data-dir digits --compare sharded --steps 8 --out benchmarks/results/rounding_sharded.json
    python benchmarks/rounding.py --data-dir digits --compare tensor --steps 8 --out benchmarks/results/rounding_tensor.json

Writes ``benchmarks/results/rounding.json`` (``--out``) and prints one line a step count.
"""
import os
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402

#: The two optimizers of the finding (issue 27): plain SGD at lr 0.1, momentum 0.9 at lr 0.05; and ZeRO-3's:
#: momentum, and Adam at its default rate; and tensor parallelism's: momentum, and AdamW.
OPTIMIZERS = {"sgd": ("sgd", {"lr": 0.1}), "momentum": ("sgd", {"lr": 0.05, "momentum": 0.9}),
              "adam": ("adam", {"lr": 0.001}), "adamw": ("adamw", {"lr": 0.003})}

#: What each comparison runs against one context: (model, optimizers, [(label, contexts, zero, tensor)]).
COMPARISONS = {
    "sharded": ("lenet", ("momentum", "adam"), None),
    "tensor": ("vit", ("momentum", "adamw"), [("--tensor 2 on 2 contexts", 2, 0, 2),
                                              ("--tensor 4 on 4 contexts", 4, 0, 4),
                                              ("--tensor 2 on 4 contexts", 4, 0, 2)]),
}


def parse_args(argv=None):
    """The script's arguments."""
    parser = harness.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=harness.mnist_dir, default=None, help="an MNIST-format directory (default: --dataset synthetic)")
    parser.add_argument("--dataset", choices=["synthetic"], default="synthetic")
    parser.add_argument("--num-train", type=int, default=1500, help="synthetic: training examples")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--compare", choices=["accumulate", "sharded", "tensor"], default="accumulate",
                        help="accumulate: --accumulate N against the whole batch (sgd, momentum); sharded: --zero 3 "
                             "on K contexts against one context (momentum, adam); tensor: the ViT with --tensor T "
                             "against one context (momentum, adamw)")
    parser.add_argument("--sharded-devices", action=harness.CommaList, item=int, minimum=1, default=[2, 3, 4],
                        help="sharded: comma-separated numbers of contexts")
    parser.add_argument("--devices", type=int, default=2, help="CPU contexts")
    parser.add_argument("--steps", type=int, default=None, help="steps to take (default: one epoch)")
    parser.add_argument("--out", default=os.path.join(harness.RESULTS, "rounding.json"))
    return parser.parse_args(argv)


def _trajectory(dataset, dtype, optimizer, args, record, accumulate=1, layout=(None, 0, 1), model="lenet"):
    """The parameters (of the first replica) after each step count in ``record``: ``model`` trained by the data
    strategy on ``layout`` = (CPU contexts, default ``--devices``; ``zero``; ``tensor``), each batch in
    ``accumulate`` micro-batches."""
    import mxnet as mx
    from parallel import init_lenet_params, init_vit, iterate_batches
    from parallel.data.batches import epoch_seed
    from parallel.optim import make_optimizer
    from parallel.strategies import make_strategy

    devices, zero, tensor = layout
    ctx_list = [mx.cpu(i) for i in range(args.devices if devices is None else devices)]
    initial = init_lenet_params(seed=0, dtype=dtype) if model == "lenet" else init_vit(seed=0, dtype=dtype)
    strategy = make_strategy("data", initial, ctx_list, zero=zero, tensor=tensor)
    name, options = OPTIMIZERS[optimizer]
    rule = make_optimizer(name, zero=zero, **options)
    snapshots = {}
    batches = iterate_batches(dataset.train_images, dataset.train_labels, args.batch_size, shuffle=True,
                              seed=epoch_seed(0, 1))   # epoch 1's order in python -m parallel.train --seed 0
    for step, (X, y) in enumerate(batches, 1):
        strategy.train_step(X.astype(dtype), y.astype(dtype), optimizer=rule, accumulate=accumulate)
        if step in record:
            snapshots[step] = [p.asnumpy() for p in strategy.params()]
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
    if args.compare != "accumulate":
        return _against_one_context(dataset, record, args)
    for optimizer in ("sgd", "momentum"):
        for dtype in ("float32", "float64"):
            whole = _trajectory(dataset, dtype, optimizer, args, record)
            parts = _trajectory(dataset, dtype, optimizer, args, record, accumulate=args.accumulate)
            for step in record:
                rows.append({"optimizer": optimizer, "dtype": dtype, "step": step,
                             "difference": difference(parts[step], whole[step])})
                print(f"{optimizer:8s} {dtype}: after {step:3d} step(s), accumulate {args.accumulate} against the "
                      f"whole batch differs by {rows[-1]['difference']:.2g} of an array's scale", flush=True)
    return {"data": args.data_dir or f"synthetic {args.num_train}", "batch_size": args.batch_size,
            "accumulate": args.accumulate, "devices": args.devices, "rows": rows}


def _against_one_context(dataset, record, args):
    """Each layout of ``COMPARISONS[args.compare]`` against one context, each of its optimizers, float32 and
    float64."""
    model, optimizers, layouts = COMPARISONS[args.compare]
    if layouts is None:   # ZeRO-3 on each of --sharded-devices
        layouts = [(f"--zero 3 on {k} contexts", k, 3, 1) for k in args.sharded_devices]
    rows = []
    for optimizer in optimizers:
        for dtype in ("float32", "float64"):
            one = _trajectory(dataset, dtype, optimizer, args, record, layout=(1, 0, 1), model=model)
            for label, devices, zero, tensor in layouts:
                got = _trajectory(dataset, dtype, optimizer, args, record, layout=(devices, zero, tensor), model=model)
                for step in record:
                    rows.append({"optimizer": optimizer, "dtype": dtype, "layout": label, "devices": devices,
                                 "step": step, "difference": difference(got[step], one[step])})
                print(f"{optimizer:8s} {dtype}: {label} against one context differs by "
                      + ", ".join(f"{r['difference']:.2g}" for r in rows[-len(record):])
                      + f" of an array's scale after {', '.join(map(str, record))} step(s)", flush=True)
    return {"data": args.data_dir or f"synthetic {args.num_train}", "batch_size": args.batch_size, "model": model,
            "compare": args.compare, "rows": rows}


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    harness.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
