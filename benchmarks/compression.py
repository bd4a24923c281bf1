"""What gradient compression saves and costs: bytes per step, time per step, test accuracy after equal epochs.

Run from the repository root, one part at a time (each its own interleaved run)::

    OMP_NUM_THREADS=2 python benchmarks/compression.py --data-dir digits --part process
    python benchmarks/compression.py --data-dir digits --part job
    OMP_NUM_THREADS=2 python benchmarks/compression.py --data-dir digits --model resnet18   # both parts
    python benchmarks/compression.py --quick                     # smoke test, synthetic data, seconds

- ``process``: one process, 2 CPU contexts, ``fit`` of a strategy whose ``Reducer`` compresses with ``spec`` for every compressor, in a shuffled
  order: the bytes one step copies between the contexts (``bytes_moved``), the median seconds per epoch and the
  test accuracy after every epoch.
- ``job``: ``python -m parallel.launch -n 2`` of ``python -m parallel.train --compression SPEC`` (one context a
  worker, the launcher's thread split), every compressor, and MXNet's own 2-bit compression through
  ``gluon.Trainer(kvstore='dist_sync')`` with ``kv.set_gradient_compression({'type': '2bit'})`` on the same
  data, batch, model initialisation and optimizer (momentum SGD on the servers, MXNet's default): the bytes each
  worker pushes a step, seconds per epoch, final test accuracy. (MXNet 1.9.1's ``gluon.Trainer`` sums through
  ``pushpull``, which ``dist_sync`` refuses with compression, so that worker pushes and pulls as MXNet's Module
  does; its pull of the updated weights is not compressed, mxnet#8979.)

LeNet (20 epochs): batch 32, Nesterov momentum 0.9, lr 0.1, cosine over the epochs with one warm-up epoch (the
setting benchmarks/optimizer_accuracy.py found for digits). ResNet-18 (4 epochs): batch 64, momentum 0.9, weight
decay 5e-4, lr 0.02, cosine (benchmarks/optimizer_accuracy.py's ``resnet18/momentum``). Writes
``compression.json`` (``compression_resnet18.json``; ``_process``/``_job`` for one part) to ``--out``.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py, beside this script
import harness  # noqa: E402

SPECS = ["none", "fp16", "2bit", "2bit:0.5", "topk:0.01", "powersgd:4"]
#: model -> its training setting: batch, lr, momentum, Nesterov, weight decay, a warm-up epoch, epochs
SETTINGS = {"lenet": {"batch": 32, "lr": 0.1, "momentum": 0.9, "nesterov": True, "wd": 0.0, "warmup": True,
                      "epochs": 20},
            "resnet18": {"batch": 64, "lr": 0.02, "momentum": 0.9, "nesterov": False, "wd": 5e-4, "warmup": False,
                         "epochs": 4}}


def _optimizer(setting, epochs, per_epoch):
    from parallel.optim import SGD, Cosine
    warmup = per_epoch if setting["warmup"] and epochs > 1 else 0
    return SGD(lr=setting["lr"], momentum=setting["momentum"], nesterov=setting["nesterov"], wd=setting["wd"],
               schedule=Cosine(total_steps=epochs * per_epoch, warmup_steps=warmup))


def _cli_flags(setting, epochs):
    """The same optimizer as ``_optimizer``, as ``python -m parallel.train`` flags."""
    flags = ["--batch-size", str(setting["batch"]), "--lr", str(setting["lr"]), "--momentum",
             str(setting["momentum"]), "--lr-schedule", "cosine",
             "--warmup-epochs", "1" if setting["warmup"] and epochs > 1 else "0"]
    return flags + (["--nesterov"] if setting["nesterov"] else []) + (["--wd", str(setting["wd"])]
                                                                    if setting["wd"] else [])


def _shapes(model):
    from parallel.models.layout import model_layout
    return [tuple(shape) for shape in model_layout(model).shapes]


def _dataset(args):
    from parallel import load_idx_dataset, synthetic_dataset
    if args.data_dir:
        return load_idx_dataset(args.data_dir)
    small = args.model == "resnet18"   # a smoke run: one ResNet-18 step a compressor (a step takes a second here)
    return synthetic_dataset(num_train=64 if small else 320, num_test=32 if small else 64, seed=0)


def part_process(args):
    """Every compressor (but MXNet's) in one process of 2 contexts, in a shuffled order: its rows."""
    import mxnet as mx
    import numpy as np
    from parallel import Reducer, RunConfig, bytes_moved, fit, init_model, make_codec, make_strategy
    from parallel.data import num_batches
    setting, shapes = SETTINGS[args.model], _shapes(args.model)
    dataset = _dataset(args)
    per_epoch = num_batches(len(dataset.train_labels), setting["batch"])
    size = sum(int(np.prod(s)) for s in shapes)
    order = next(harness.round_orders([spec for spec in args.specs if spec != "mxnet-2bit"], 1, seed=0))
    rows = {}
    for spec in order:
        compressor = make_codec(spec)
        started = time.monotonic()
        strategy = make_strategy("data", init_model(args.model, 0), [mx.cpu(0), mx.cpu(1)],
                                 reducer=Reducer(compression=compressor))
        history, _ = fit(dataset, strategy, _optimizer(setting, args.epochs, per_epoch),
                         RunConfig(epochs=args.epochs, batch_size=setting["batch"]))
        moved = bytes_moved("fused", 4 * size, 2, compression=compressor, shapes=shapes)
        rows[spec] = {"bytes_per_step": moved.total, "seconds_per_epoch": harness.median(
            h["seconds"] for h in history), "test_acc": [h["test_acc"] for h in history],
            "wall_seconds": time.monotonic() - started}
        print(f"process: {spec} done", file=sys.stderr, flush=True)
    return {"order": order, "rows": rows}


# ---- the job part ---------------------------------------------------------------------------------------------

def worker_native(args):
    """MXNet's own 2-bit compression: the gluon model with the package's initial weights, pushed and pulled through
    dist_sync, the servers running the same optimizer."""
    import mxnet as mx
    from mxnet import autograd, gluon
    from parallel import iterate_batches
    from parallel.data import num_batches
    from parallel.data.batches import epoch_seed
    from parallel.job import worker_slice
    dataset = _dataset(args)
    kv = mx.kv.create("dist_sync")
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    ctx = mx.cpu(0)
    setting = SETTINGS[args.model]
    net = harness.gluon_network(args.model)
    net.collect_params().reset_ctx(ctx)
    net.hybridize(static_alloc=True, static_shape=True)
    batch = setting["batch"]
    per_epoch = num_batches(len(dataset.train_labels), batch)
    schedule = mx.lr_scheduler.CosineScheduler(
        max_update=args.epochs * per_epoch, base_lr=setting["lr"],
        warmup_steps=per_epoch if setting["warmup"] and args.epochs > 1 else 0)
    # gluon.Trainer (MXNet 1.9.1) sums through pushpull, which dist_sync refuses with compression ("Compression
    # not supported with PushPull"): push and pull as MXNet's Module does, the servers running the optimizer.
    kind = mx.optimizer.NAG if setting["nesterov"] else mx.optimizer.SGD
    kv.set_optimizer(kind(learning_rate=setting["lr"], momentum=setting["momentum"], wd=setting["wd"],
                          lr_scheduler=schedule, rescale_grad=1.0 / batch))
    params = [param for param in net.collect_params().values() if param.grad_req != "null"]
    for i, param in enumerate(params):
        kv.init(i, param.data(ctx))
        kv.pull(i, out=param.data(ctx))
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    seconds = []
    for epoch in range(1, args.epochs + 1):
        started = time.monotonic()
        for X, y in iterate_batches(dataset.train_images, dataset.train_labels, batch, shuffle=True,
                                    seed=epoch_seed(0, epoch)):
            start, stop = worker_slice(X.shape[0], 1, kv.rank, kv.num_workers)
            with autograd.record():
                l = loss(net(X[start:stop].as_in_context(ctx)), y[start:stop].as_in_context(ctx))
            l.backward()
            for i, param in enumerate(params):
                kv.push(i, param.grad(ctx), priority=-i)
            for i, param in enumerate(params):
                kv.pull(i, out=param.data(ctx), priority=-i)
        mx.nd.waitall()
        seconds.append(time.monotonic() - started)
    correct = 0
    for X, y in iterate_batches(dataset.test_images, dataset.test_labels, 256):
        correct += int((net(X.as_in_context(ctx)).argmax(axis=1) == y.as_in_context(ctx)).sum().asscalar())
    if kv.rank == 0:
        harness.report_result({"seconds": seconds, "test_acc": correct / len(dataset.test_labels)})


def _job_native(args, launch, data_dir, tmp, size):
    """MXNet's own 2-bit compression (``--worker-native`` under the launcher): its row."""
    out, _ = harness.run_process(launch + [sys.executable, os.path.abspath(__file__), "--worker-native", "--epochs",
                                           str(args.epochs), "--data-dir", os.path.abspath(data_dir), "--model",
                                           args.model], cwd=tmp)
    native = harness.read_result(out, "the mxnet-2bit job")
    # MXNet packs 16 two-bit codes per float32 on the push; the pull of the weights is dense
    return {"bytes_per_step": 4 * -(-size // 16), "pull_bytes_per_step": 4 * size,
            "seconds_per_epoch": harness.median(native["seconds"]), "test_acc": native["test_acc"]}


def _job_package(args, spec, launch, data_dir, tmp, size):
    """``python -m parallel.train --compression SPEC`` under the launcher: its row."""
    from parallel import make_codec
    setting, shapes = SETTINGS[args.model], _shapes(args.model)
    metrics = os.path.join(tmp, f"{spec.replace(':', '_')}.json")
    harness.run_process(launch + [sys.executable, "-m", "parallel.train", "--data-dir", os.path.abspath(data_dir),
                                  "--model", args.model, "--epochs", str(args.epochs),
                                  *_cli_flags(setting, args.epochs), "--devices", "cpu:1", "--no-progress",
                                  "--compression", spec, "--metrics-json", metrics], cwd=tmp)
    with open(metrics) as f:
        history = json.load(f)
    compressor = make_codec(spec)
    pushed = 4 * size if compressor is None else compressor.across_nbytes(size, 2, shapes)
    return {"bytes_per_step": pushed, "pull_bytes_per_step": pushed,
            "seconds_per_epoch": harness.median(h["seconds"] for h in history), "test_acc": history[-1]["test_acc"]}


def part_job(args):
    """Every compressor (and MXNet's 2-bit) in a job of 2 workers under the launcher, in a shuffled order."""
    import numpy as np
    size = sum(int(np.prod(s)) for s in _shapes(args.model))
    order = next(harness.round_orders(args.specs, 1, seed=1))
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir or harness.write_dataset(os.path.join(tmp, "data"), _dataset(args))
        launch = [sys.executable, "-m", "parallel.launch", "-n", "2"]
        for spec in order:
            rows[spec] = (_job_native(args, launch, data_dir, tmp, size) if spec == "mxnet-2bit" else
                          _job_package(args, spec, launch, data_dir, tmp, size))
            print(f"job: {spec} done", file=sys.stderr, flush=True)
    return {"order": order, "rows": rows}


def parse_args(argv=None):
    """The benchmark's arguments: ``--specs`` with ``none`` first, ``--epochs`` the model's by default."""
    parser = harness.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=harness.mnist_dir, default=None, help="MNIST-format data (digits); default: synthetic")
    parser.add_argument("--part", choices=["process", "job", "both"], default="both")
    parser.add_argument("--model", choices=list(SETTINGS), default="lenet")
    parser.add_argument("--epochs", type=int, default=None, help="default: 20 for LeNet, 4 for ResNet-18")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 epoch of a small synthetic set")
    harness.add_out(parser, "compression.json")
    parser.add_argument("--specs", default=None, metavar="SPEC,...",
                        help="the compressors to run (none is always added: the baseline), e.g. "
                             "powersgd:8,topk:0.05; default: " + ",".join(SPECS) + " and mxnet-2bit (in the job)")
    parser.add_argument("--worker-native", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.chosen = args.specs
    if args.specs is None:
        args.specs = SPECS + ["mxnet-2bit"]
    else:
        from parallel.compress import parse_compression
        args.specs = ["none"] + [spec for spec in args.chosen.split(",") if spec and spec != "none"]
        for spec in args.specs:
            if spec != "mxnet-2bit":
                try:
                    parse_compression(spec, "--specs")
                except ValueError as e:
                    parser.error(str(e))
    if args.quick:
        args.epochs = 1
    elif args.epochs is None:
        args.epochs = SETTINGS[args.model]["epochs"]
    return args


def _final_accuracy(row):
    """A row's test accuracy after its last epoch (the process part keeps every epoch's)."""
    return row["test_acc"][-1] if isinstance(row["test_acc"], list) else row["test_acc"]


def _print_rows(result):
    for part in ("process", "job"):
        if part in result:
            rows = result[part]["rows"]
            base = rows["none"]
            print("\n".join(harness.markdown_table(
                [part, "bytes/step", "fewer", "s/epoch", "vs none", "test acc"],
                [[spec, row["bytes_per_step"], f"{base['bytes_per_step'] / row['bytes_per_step']:.1f}x",
                  f"{row['seconds_per_epoch']:.2f}", f"{row['seconds_per_epoch'] / base['seconds_per_epoch']:.2f}x",
                  f"{_final_accuracy(row):.3f} ({_final_accuracy(row) - _final_accuracy(base):+.3f})"]
                 for spec, row in rows.items()])))


def main(argv=None):
    args = parse_args(argv)
    if args.worker_native:
        worker_native(args)
        return 0
    result = {"command": "python benchmarks/compression.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"), "model": args.model,
              "setting": SETTINGS[args.model], "epochs": args.epochs}
    if args.part in ("process", "both"):
        result["process"] = part_process(args)
    if args.part in ("job", "both"):
        result["job"] = part_job(args)
    _print_rows(result)
    name = "compression" + ("" if args.model == "lenet" else f"_{args.model}") + \
        ("" if args.part == "both" else f"_{args.part}") + \
        ("" if args.chosen is None else "_" + "-".join(args.specs[1:]).replace(":", "_")) + ".json"
    harness.write_json(os.path.join(args.out, name), result)
    return 0


if __name__ == "__main__":
    sys.exit(harness.command(main))
