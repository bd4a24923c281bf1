"""One worker of the Horovod side of benchmarks/horovod.py: the package's ResNet-18 trained data-parallel with
``horovod.mxnet.DistributedTrainer``, the way ``python -m parallel.train`` trains it under the package's launcher.

Run from the repository root, in Horovod's own venv (here ``../hvd-venv``, beside the repository; benchmarks/README.md,
"Against Horovod", says how to make it; the package is imported from the work tree through ``PYTHONPATH``, and only
its modules that need nothing but MXNet and numpy)::

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD ../hvd-venv/bin/horovodrun -np 2 --gloo -H localhost:2 \\
        --network-interface lo ../hvd-venv/bin/python benchmarks/horovod_worker.py --data-dir digits \\
        --batch-size 64 --lr 0.02 --momentum 0.9
    ... benchmarks/horovod_worker.py --dataset synthetic --batches 20 --log-every 5   # a short run

What it does, each piece matched to the package's run (``parallel.fit``, ``parallel.report.format_epoch``):

- the data: ``parallel.data.load_idx_dataset(--data-dir)`` (the package's IDX reader) or
  ``parallel.data.synthetic_dataset(seed=0)``; every epoch the global batches come from
  ``parallel.data.iterate_batches(..., shuffle=True, seed=epoch_seed(--seed, epoch))`` on every worker, as in the
  package, and each worker trains its slice ``parallel.job.worker_slice(n, 1, rank, 2)`` of every global batch;
- the model: ``parallel.models.resnet.init_resnet18(--seed)`` on every worker (its values loaded into a fresh,
  never-run ``resnet18()``: Horovod cannot read the oneDNN weight layout that ``init_resnet18``'s forward on zeros
  leaves), then ``hvd.broadcast_parameters`` from rank 0, hybridized with ``static_alloc`` and ``static_shape``;
  each worker's BatchNorm normalizes over its own slice (as each worker of the package's job does);
- the step: ``gluon.loss.SoftmaxCrossEntropyLoss``, ``hvd.DistributedTrainer(params, "sgd", {learning_rate,
  momentum, wd})`` (``compression=hvd.Compression.fp16`` with ``--compression fp16``) and ``trainer.step(slice
  size)``: the average over the workers of each worker's mean gradient, the mean over the global batch when the
  slices are equal (MXNet's SGD with momentum is the package's ``SGD``: ``m = momentum * m - lr * (g + wd * w);
  w += m``);
- the epoch's seconds: from just before the first batch is drawn to the moment the last step's loss is read,
  with at most ``IN_FLIGHT`` (2) steps queued before the oldest one's loss is read, as ``parallel.fit`` does (in
  both, the last step's gradient exchange and update may still be running when the clock stops; the JSON also
  gives the time after ``mx.nd.waitall()``); images/s = training examples / rank 0's seconds;
- train loss and accuracy: the summed loss and correct predictions of every worker's slices, summed over the
  workers, over the examples trained on; test accuracy as ``parallel.evaluate`` in a job (each worker scores its
  slice of each test batch with its own BatchNorm statistics, the counts summed).

Rank 0 prints one line ``RESULT {json}``: the epochs (``seconds``, ``images_per_second``, ``train_loss``,
``train_acc``, ``test_acc``, every rank's seconds), the settings and this process's ``OMP_NUM_THREADS``.
"""
import argparse
import collections
import math
import os
import sys
import tempfile
import time

# benchmarks/horovod.py, the driver beside this script, would shadow the horovod package: Python puts the script's
# directory first on the path; it goes last (for harness.py), after the horovod package's site-packages
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [path for path in sys.path if os.path.abspath(path or os.curdir) != _HERE] + [_HERE]
import harness  # noqa: E402
#: Steps queued before the oldest one's loss is read: ``parallel.fit.IN_FLIGHT`` (a test checks they agree).
IN_FLIGHT = 2


def parse_args(argv=None):
    """The worker's arguments: the data, the optimizer, the epochs and an optional limit on the batches."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--data-dir", help="an MNIST-format directory (four IDX files, raw or .gz)")
    data.add_argument("--dataset", choices=["synthetic"], help="parallel.data.synthetic_dataset(seed=0)")
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch (default 64)")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="the model's and the shuffle's seed (default 0)")
    parser.add_argument("--compression", choices=["none", "fp16"], default="none",
                        help="Horovod's gradient compression (hvd.Compression): fp16 casts each gradient to float16 "
                             "for the allreduce and back (default none)")
    parser.add_argument("--batches", type=int, default=None, metavar="N",
                        help="train only the first N global batches of every epoch (a short run)")
    parser.add_argument("--log-every", type=int, default=0, metavar="N",
                        help="rank 0 prints the mean loss of every N batches on stderr (0: never)")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.epochs < 1 or (args.batches is not None and args.batches < 1):
        parser.error("--batch-size, --epochs and --batches must be >= 1")
    return args


def load_dataset(args):
    """The dataset the package's run reads: the IDX directory, or the synthetic set of ``--dataset synthetic``."""
    from parallel.data import load_idx_dataset, synthetic_dataset
    if args.data_dir is not None:
        return load_idx_dataset(args.data_dir)
    return synthetic_dataset(seed=0)


def build(args, hvd):
    """The hybridized ResNet-18 (rank 0's initial parameters on every worker) and its DistributedTrainer."""
    import mxnet as mx
    from parallel.models.resnet import init_resnet18, resnet18
    # init_resnet18's forward on zeros (in inference mode) leaves the convolutions' weights in oneDNN's own
    # layout, which Horovod cannot read ("We can't generate TBlob for MKLDNN data"), and Parameter.set_data
    # copies into those arrays: the same values are loaded into a fresh, never-run ResNet-18 instead
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "init.params")
        init_resnet18(seed=args.seed).save_parameters(path)
        net = resnet18()
        net.load_parameters(path, ctx=mx.cpu())
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)
    net.hybridize(static_alloc=True, static_shape=True)
    compression = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": args.lr, "momentum": args.momentum,
                                                    "wd": args.wd}, compression=compression)
    mx.nd.waitall()
    return net, trainer


class Queued:
    """Steps in flight, as ``parallel.fit``'s epoch keeps them: the oldest step's loss is read once more than
    ``IN_FLIGHT`` are queued; ``loss_sum`` and ``correct`` hold the finished steps' sums."""

    def __init__(self, log_every):
        self.in_flight, self.loss_sum, self.correct, self.done = collections.deque(), 0.0, 0.0, 0
        self.log_every, self.logged = log_every, 0.0

    def queue(self, loss, correct, examples):
        self.in_flight.append((loss, correct, examples))
        if len(self.in_flight) > IN_FLIGHT:
            self.finish_oldest()

    def finish_oldest(self):
        loss, correct, examples = self.in_flight.popleft()
        value = float(loss.asscalar())   # waits for the step
        if not math.isfinite(value):
            raise FloatingPointError(f"the loss became {value} at batch {self.done + 1}: lower --lr")
        self.loss_sum += value
        self.correct += float(correct.asscalar())
        self.done += 1
        if self.log_every:
            self.logged += value / max(examples, 1)
            if self.done % self.log_every == 0:
                print(f"batch {self.done}: mean loss of the last {self.log_every} batches (this worker's slices) "
                      f"{self.logged / self.log_every:.4f}", file=sys.stderr, flush=True)
                self.logged = 0.0

    def drain(self):
        while self.in_flight:
            self.finish_oldest()


def train_epoch(net, trainer, dataset, args, epoch, hvd):
    """One epoch on this worker's slices; returns (seconds to the last loss read, seconds to waitall, this
    worker's loss sum, correct count, global examples trained on)."""
    import mxnet as mx
    from mxnet import autograd
    from parallel.data import epoch_seed, iterate_batches
    from parallel.job import worker_slice
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    queued, examples = Queued(args.log_every if hvd.rank() == 0 else 0), 0
    started = time.perf_counter()
    batches = iterate_batches(dataset.train_images, dataset.train_labels, args.batch_size, shuffle=True,
                              seed=epoch_seed(args.seed, epoch))
    for b, (X, y) in enumerate(batches):
        if args.batches is not None and b == args.batches:
            break
        start, stop = worker_slice(X.shape[0], 1, hvd.rank(), hvd.size())
        Xs, ys = X[start:stop], y[start:stop]
        with autograd.record():
            out = net(Xs)
            loss = loss_fn(out, ys)
        loss.backward()
        trainer.step(stop - start)
        queued.queue(loss.sum(), (out.argmax(axis=1) == ys).sum(), stop - start)
        examples += X.shape[0]
    queued.drain()
    seconds = time.perf_counter() - started
    mx.nd.waitall()
    return seconds, time.perf_counter() - started, queued.loss_sum, queued.correct, examples


def test_accuracy(net, dataset, args, hvd):
    """Accuracy on the test set: each worker scores its slice of every test batch, the counts are summed."""
    import mxnet as mx
    from parallel.data import iterate_batches
    from parallel.job import worker_slice
    correct = mx.nd.zeros((1,))
    for X, y in iterate_batches(dataset.test_images, dataset.test_labels, args.batch_size):
        start, stop = worker_slice(X.shape[0], 1, hvd.rank(), hvd.size())
        if stop > start:
            correct += (net(X[start:stop]).argmax(axis=1) == y[start:stop]).sum()
    total = hvd.allreduce(correct, average=False, name="test_correct")
    return float(total.asscalar()) / len(dataset.test_labels)


def run(args, hvd):
    """Train ``args.epochs`` epochs; return the per-epoch metrics (every worker returns the same sums)."""
    import mxnet as mx
    dataset = load_dataset(args)
    net, trainer = build(args, hvd)
    history = []
    for epoch in range(1, args.epochs + 1):
        hvd.allreduce(mx.nd.zeros((1,)), name=f"start_{epoch}").wait_to_read()   # start together
        seconds, synced, loss_sum, correct, examples = train_epoch(net, trainer, dataset, args, epoch, hvd)
        sums = hvd.allreduce(mx.nd.array([loss_sum, correct], dtype="float64"), average=False,
                             name=f"sums_{epoch}").asnumpy()
        every = hvd.allgather_object({"rank": hvd.rank(), "seconds": seconds, "seconds_to_waitall": synced})
        history.append({"epoch": epoch, "train_loss": float(sums[0]) / examples,
                        "train_acc": float(sums[1]) / examples, "test_acc": test_accuracy(net, dataset, args, hvd),
                        "seconds": seconds, "seconds_to_waitall": synced, "images_per_second": examples / seconds,
                        "examples": examples, "every_rank": sorted(every, key=lambda r: r["rank"])})
    return history, len(dataset.train_labels)


def main(argv=None):
    args = parse_args(argv)
    import mxnet as mx
    import horovod.mxnet as hvd
    hvd.init()
    history, n_train = run(args, hvd)
    if hvd.rank() == 0:
        harness.report_result({
            "epochs": history, "workers": hvd.size(), "train_examples": n_train, "batch_size": args.batch_size,
            "lr": args.lr, "momentum": args.momentum, "wd": args.wd, "seed": args.seed, "batches": args.batches,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"), "mxnet": mx.__version__,
            "horovod": getattr(__import__("horovod"), "__version__", "unknown")})
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
