"""Train LeNet on Fashion-MNIST with data parallelism written from scratch, or with the other parallel styles.

Run::

    python -m parallel.train --devices cpu:2 --epochs 10
    python -m parallel.train --dataset synthetic --epochs 2 --metrics-json m.json --plot curves.png
    python -m parallel.train --devices cpu:2 --strategy pipeline --stages 2 --micro-batches 4
    python -m parallel.train --devices cpu:4 --strategy hybrid --boundaries 2

Every strategy runs the same SGD step on the same batches: the same ``--seed`` gives the same loss curve.

Unless ``OMP_NUM_THREADS`` is set, the command runs itself again once with every core per operator (MXNet
reads the setting only at start-up; see ``parallel.devices.recommended_omp_threads``).

Each epoch prints one line in the textbook's form; ``--metrics-json`` and ``--plot`` are rewritten
atomically after every epoch. Bad input exits with status 2 and a one-line ``error:`` message.
"""
import argparse
import functools
import json
import math
import os
import sys
import time
from typing import Callable, List, NamedTuple

import mxnet as mx
import numpy as np
from tqdm import tqdm

from .comm import ALLREDUCE_ALGORITHMS, DEFAULT_ALGORITHM, get_params
from .data import iterate_batches, load_fashion_mnist, num_batches, synthetic_dataset
from .devices import parse_devices, recommended_omp_threads
from .evaluate import evaluate_accuracy
from .files import atomic_write, check_writable
from .model import init_lenet_params
from .step import check_lr, train_step
from .strategies import DEFAULT_MICRO_BATCHES, Hybrid, ModelParallel, Pipeline

__all__ = ["fit", "make_strategy", "Strategy", "STRATEGIES", "load_data", "plot_metrics", "write_metrics",
           "format_epoch", "main", "NonFiniteLossError"]

#: The ways ``fit`` can spread LeNet over the contexts (``--strategy``).
STRATEGIES = ("data", "model", "pipeline", "hybrid")

#: How many batches pass between checks of the loss for NaN/inf (each check is one host sync).
CHECK_EVERY = 50


class NonFiniteLossError(ValueError):
    """The training loss became NaN or infinite."""


def _check_positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_finite(batch_losses, epoch, first_batch):
    """Read the queued per-batch losses at once (one host sync) and raise at the first non-finite one."""
    if not batch_losses:
        return
    values = mx.nd.concat(*batch_losses, dim=0).asnumpy()
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        batch = first_batch + int(bad[0])
        raise NonFiniteLossError(f"loss became {values[bad[0]]} at epoch {epoch}, batch {batch}; "
                                 "training diverged: lower --lr")


class Strategy(NamedTuple):
    """What ``fit`` needs from a parallel style: a train step and an evaluation over the contexts it uses."""
    name: str
    #: ``device_params`` (one replica per context) for ``"data"``; the ``ModelParallel``, ``Pipeline`` or
    #: ``Hybrid`` object otherwise. Trained in place.
    model: object
    #: The contexts actually used (model and pipeline parallelism use one per stage).
    ctx_list: List
    #: ``train_step(X, y, lr)`` -> (summed loss, correct count), each (1,) on ``ctx_list[0]``, not waited for.
    train_step: Callable
    #: ``evaluate(data_iter)`` -> accuracy in [0, 1].
    evaluate: Callable
    #: One line saying how the model is laid out on the contexts.
    description: str


def _data_step(X, y, lr, device_params, ctx_list, algorithm):
    return train_step(X, y, device_params, ctx_list, lr, algorithm=algorithm)


def _pipeline_step(X, y, lr, model):
    """A short last batch (fewer examples than micro-batches) runs in one micro-batch per example."""
    return model.train_step(X, y, lr, micro_batches=min(model.micro_batches, X.shape[0]))


def make_strategy(name, params, ctx_list, stages=None, boundaries=None, micro_batches=None, batch_size=None,
                  algorithm=DEFAULT_ALGORITHM):
    """Lay LeNet's ``params`` out on ``ctx_list`` for one parallel style.

    Parameters
    ----------
    name : str
        ``"data"`` (one replica per context, ``train_step``), ``"model"`` (``ModelParallel``),
        ``"pipeline"`` (``Pipeline``) or ``"hybrid"`` (``Hybrid``).
    params : list of NDArray
        Initial parameters; copied, not modified.
    ctx_list : list of mxnet.Context
    stages, boundaries
        Where to cut the model (see ``parallel.strategies.stage_ranges``; default two stages); not for ``"data"``.
    micro_batches : int, optional
        Pipeline only (default ``DEFAULT_MICRO_BATCHES``). A batch with fewer examples than micro-batches
        (the short last batch of an epoch) is trained in one micro-batch per example.
    batch_size : int, optional
        When given, more micro-batches than ``batch_size`` are refused up front.
    algorithm : str
        Allreduce algorithm for ``"data"`` and ``"hybrid"``.

    Returns
    -------
    Strategy

    Raises
    ------
    ValueError
        For an unknown name, an option the strategy does not take, or a layout the contexts cannot hold.
    """
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    if name == "data" and (stages is not None or boundaries is not None):
        raise ValueError("stages and boundaries apply to the model, pipeline and hybrid strategies, not to data "
                         "parallelism; drop them or choose another strategy")
    if micro_batches is not None and name != "pipeline":
        raise ValueError(f"micro-batches apply to the pipeline strategy only, not to {name}; drop them or "
                         "choose the pipeline strategy")
    if name == "data":
        device_params = [get_params(params, ctx) for ctx in ctx_list]
        return Strategy(name, device_params, list(ctx_list),
                        functools.partial(_data_step, device_params=device_params, ctx_list=ctx_list,
                                          algorithm=algorithm),
                        functools.partial(evaluate_accuracy, device_params=device_params, ctx_list=ctx_list),
                        f"one replica per context, gradients summed with the {algorithm} allreduce")
    if name == "model":
        model = ModelParallel(params, ctx_list, stages, boundaries)
        step = model.train_step
    elif name == "pipeline":
        model = Pipeline(params, ctx_list, stages, boundaries,
                         DEFAULT_MICRO_BATCHES if micro_batches is None else micro_batches)
        if batch_size is not None and model.micro_batches > batch_size:
            raise ValueError(f"{model.micro_batches} micro-batches cannot split batches of {batch_size} "
                             f"examples; use at most {batch_size} micro-batches or a larger batch size")
        step = functools.partial(_pipeline_step, model=model)
    else:
        model = Hybrid(params, ctx_list, stages, boundaries, algorithm)
        step = model.train_step
    return Strategy(name, model, model.ctx_list, step, model.evaluate, model.describe())


def fit(dataset, ctx_list, num_epochs, batch_size, lr, seed=0, algorithm=DEFAULT_ALGORITHM, progress=False,
        on_epoch=None, strategy="data", stages=None, boundaries=None, micro_batches=None):
    """Train LeNet from scratch over ``ctx_list`` with data parallelism or another ``strategy``.

    Parameters
    ----------
    dataset : parallel.data.Dataset
        Train and test images (n, 28, 28) uint8 and labels.
    ctx_list : list of mxnet.Context
    num_epochs, batch_size : int
        Both >= 1. The last batch of an epoch may be smaller; it is trained on, not dropped.
    lr : float
        Learning rate, finite and > 0.
    seed : int
        Seeds the initial parameters and the shuffling; the same seed gives the same run.
    algorithm : str
        Allreduce algorithm (see ``parallel.comm.allreduce``).
    progress : bool
        Show a tqdm progress bar per epoch (on stderr).
    on_epoch : callable, optional
        Called with each epoch's metrics dict and the history so far, after the epoch.
    strategy : str or Strategy
        One of ``STRATEGIES`` (see ``make_strategy``), or a ``Strategy`` already built by ``make_strategy``
        (its parameters and contexts are used as they are; ``seed`` then only seeds the shuffling).
    stages, boundaries, micro_batches
        Passed to ``make_strategy`` with a strategy name.

    Returns
    -------
    (list of dict, object)
        One dict per epoch with ``epoch``, ``train_loss``, ``train_acc``, ``test_acc``, ``seconds``,
        ``images_per_second``; and the trained model, ``Strategy.model``: for ``"data"`` the replicas
        (``device_params``, one per context, as before), else the ``ModelParallel``, ``Pipeline`` or
        ``Hybrid`` object (``.params()`` gives LeNet's eight arrays). Within an epoch the host does not
        wait for the devices except once every ``CHECK_EVERY`` batches to check the loss.

    Raises
    ------
    NonFiniteLossError
        When the loss becomes NaN or infinite, naming the epoch and the batch.
    """
    _check_positive_int(num_epochs, "num_epochs")
    _check_positive_int(batch_size, "batch_size")
    check_lr(lr)
    if not isinstance(strategy, Strategy):
        strategy = make_strategy(strategy, init_lenet_params(seed), ctx_list, stages, boundaries, micro_batches,
                                 batch_size, algorithm)
    n_train = len(dataset.train_labels)
    history = []
    for epoch in range(1, num_epochs + 1):
        batches = iterate_batches(dataset.train_images, dataset.train_labels, batch_size,
                                  shuffle=True, seed=seed * 100003 + epoch)
        bar = tqdm(batches, total=num_batches(n_train, batch_size), desc=f"epoch {epoch}",
                   leave=False, disable=not progress, file=sys.stderr)
        loss_sum = mx.nd.zeros((1,), ctx=strategy.ctx_list[0])
        correct = mx.nd.zeros((1,), ctx=strategy.ctx_list[0])
        pending, first = [], 1
        start = time.perf_counter()
        for b, (X, y) in enumerate(bar, start=1):
            loss, right = strategy.train_step(X, y, lr)
            loss_sum += loss        # accumulated on the device; read once per epoch
            correct += right
            pending.append(loss)
            if len(pending) == CHECK_EVERY:
                _check_finite(pending, epoch, first)
                pending, first = [], b + 1
        _check_finite(pending, epoch, first)
        train_loss = float(loss_sum.asscalar()) / n_train   # waits for the epoch's last step
        seconds = time.perf_counter() - start
        bar.close()
        test_acc = strategy.evaluate(iterate_batches(dataset.test_images, dataset.test_labels, batch_size))
        metrics = {"epoch": epoch, "train_loss": train_loss,
                   "train_acc": float(correct.asscalar()) / n_train, "test_acc": test_acc,
                   "seconds": seconds, "images_per_second": n_train / seconds}
        history.append(metrics)
        if on_epoch is not None:
            on_epoch(metrics, history)
    return history, strategy.model


def load_data(name, data_dir=None, seed=0, progress=True):
    """Load ``"fashion-mnist"`` (downloading it if missing) or the in-memory ``"synthetic"`` set."""
    if name == "synthetic":
        return synthetic_dataset(seed=seed)
    if name == "fashion-mnist":
        return load_fashion_mnist(data_dir, download=True, progress=progress)
    raise ValueError(f"unknown dataset {name!r}; choose 'fashion-mnist' or 'synthetic'")


def write_metrics(history, path):
    """Write the per-epoch metrics as a JSON list, atomically."""
    with atomic_write(path, "w") as f:
        json.dump(history, f, indent=2)
        f.write("\n")


def plot_metrics(history, path=None, title=None):
    """Plot the loss and accuracy curves; write them to a PNG at ``path`` (atomically) if given.

    Returns
    -------
    matplotlib.figure.Figure
        Built without pyplot, so it never changes the plotting backend (a notebook shows it with
        ``display(fig)``).
    """
    from matplotlib.figure import Figure

    epochs = [m["epoch"] for m in history]
    fig = Figure(figsize=(9, 3.5))
    ax_loss, ax_acc = fig.subplots(1, 2)
    ax_loss.plot(epochs, [m["train_loss"] for m in history], "o-", label="train loss")
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_acc.plot(epochs, [m["train_acc"] for m in history], "o-", label="train acc")
    ax_acc.plot(epochs, [m["test_acc"] for m in history], "s--", label="test acc")
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("accuracy")
    ax_acc.set_ylim(0, 1)
    ax_acc.legend()
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        with atomic_write(path, "wb") as f:
            fig.savefig(f, format="png", dpi=100)
    return fig


def format_epoch(metrics, ctx_list, strategy="data"):
    """The textbook's one-line epoch summary; other strategies than data parallelism are named."""
    name = "" if strategy == "data" else f", {strategy} parallel"
    return (f"epoch {metrics['epoch']}, loss {metrics['train_loss']:.3f}, "
            f"train acc {metrics['train_acc']:.3f}, test acc {metrics['test_acc']:.3f}, "
            f"{metrics['seconds']:.1f} sec/epoch, {metrics['images_per_second']:.0f} examples/sec{name} "
            f"on [{', '.join(str(c) for c in ctx_list)}]")


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, no usage dump: main() prints "error: ..." and returns 2
        raise _UsageError(message)


def _finite_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not finite")
    return value


def _layer_indices(text):
    try:
        return [int(part) for part in text.split(",")] if text.strip() else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer indices "
                                         "such as 2 or 1,3") from None


def build_parser():
    parser = _Parser(prog="python -m parallel.train",
                     description="Train LeNet with data parallelism written from scratch on MXNet.")
    parser.add_argument("--devices", default="auto",
                        help="'auto' (all GPUs, else one CPU context), 'cpu:N' (N CPU contexts) or "
                             "'gpu:I,J,...' (GPU indices as CUDA_VISIBLE_DEVICES numbers them); default auto")
    parser.add_argument("--epochs", type=int, default=10, help="number of epochs (>= 1); default 10")
    parser.add_argument("--batch-size", type=int, default=256,
                        help="global batch size, split across the devices (>= 1); default 256")
    parser.add_argument("--lr", type=_finite_float, default=0.2, help="learning rate (> 0); default 0.2")
    parser.add_argument("--dataset", choices=["fashion-mnist", "synthetic"], default="fashion-mnist",
                        help="default fashion-mnist (downloaded when missing)")
    parser.add_argument("--data-dir", default=None,
                        help="directory of the four IDX files, raw or .gz "
                             "(default $MXNET_HOME/datasets/fashion-mnist, i.e. ~/.mxnet/...)")
    parser.add_argument("--allreduce", choices=sorted(ALLREDUCE_ALGORITHMS), default=DEFAULT_ALGORITHM,
                        help=f"how gradients are summed across devices; default {DEFAULT_ALGORITHM}")
    parser.add_argument("--strategy", choices=STRATEGIES, default="data",
                        help="data: a replica per device; model: LeNet cut into stages, one per device; "
                             "pipeline: micro-batches through the stages; hybrid: data parallelism over "
                             "groups of stages; default data")
    parser.add_argument("--stages", type=int, default=None,
                        help="model/pipeline/hybrid: cut LeNet's 4 layers into N stages as evenly as possible "
                             "(default 2)")
    parser.add_argument("--boundaries", type=_layer_indices, default=None, metavar="I,J",
                        help="model/pipeline/hybrid: instead of --stages, the layer indices where stages start, "
                             "e.g. 2 (conv | dense) or 1,3; LeNet's layers are conv1, conv2, dense1, dense2")
    parser.add_argument("--micro-batches", type=int, default=None, metavar="M",
                        help=f"pipeline: micro-batches per batch, at most --batch-size "
                             f"(default {DEFAULT_MICRO_BATCHES}); a shorter last batch uses one per example")
    parser.add_argument("--seed", type=int, default=0, help="seeds initial parameters and shuffling")
    parser.add_argument("--metrics-json", metavar="PATH", help="write per-epoch metrics as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write loss and accuracy curves as PNG")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def run(args):
    """Run the CLI's job for parsed ``args``; raises ValueError/DataError on bad input."""
    if args.epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {args.epochs}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.lr <= 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if args.data_dir is not None and args.dataset == "synthetic":
        raise ValueError("--data-dir applies to --dataset fashion-mnist, not synthetic")
    if args.strategy == "data" and (args.stages is not None or args.boundaries is not None):
        flag = "--stages" if args.stages is not None else "--boundaries"
        raise ValueError(f"{flag} applies to --strategy model, pipeline or hybrid, not data")
    if args.stages is not None and args.boundaries is not None:
        raise ValueError("give --stages or --boundaries, not both")
    if args.micro_batches is not None and args.strategy != "pipeline":
        raise ValueError(f"--micro-batches applies to --strategy pipeline, not {args.strategy}")
    if args.micro_batches is not None and not 1 <= args.micro_batches <= args.batch_size:
        raise ValueError(f"--micro-batches must be between 1 and --batch-size ({args.batch_size}), "
                         f"got {args.micro_batches}")
    for path, flag in ((args.metrics_json, "--metrics-json"), (args.plot, "--plot")):
        if path:
            check_writable(path, flag)
    ctx_list = parse_devices(args.devices)
    strategy = make_strategy(args.strategy, init_lenet_params(args.seed), ctx_list, args.stages, args.boundaries,
                             args.micro_batches, args.batch_size, args.allreduce)   # a bad layout fails here
    progress = not args.no_progress
    dataset = load_data(args.dataset, args.data_dir, progress=progress)
    used = strategy.ctx_list
    print(f"training LeNet on {args.dataset}: {len(dataset.train_labels)} train / "
          f"{len(dataset.test_labels)} test examples, batch {args.batch_size}, lr {args.lr}, "
          f"on {len(used)} context(s)", flush=True)
    print(f"strategy {strategy.name}: {strategy.description}; operator threads: OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset (MXNet default: half the cores)')}", flush=True)

    def on_epoch(metrics, history):
        print(format_epoch(metrics, used, strategy.name), flush=True)
        if args.metrics_json:
            write_metrics(history, args.metrics_json)
        if args.plot:
            plot_metrics(history, args.plot,
                         title=f"LeNet on {args.dataset}, {strategy.name} parallel on {len(used)} context(s)")

    fit(dataset, ctx_list, args.epochs, args.batch_size, args.lr, seed=args.seed, algorithm=args.allreduce,
        progress=progress, on_epoch=on_epoch, strategy=strategy)


def main(argv=None):
    """Entry point of ``python -m parallel.train``; returns the process exit status."""
    try:
        run(build_parser().parse_args(argv))
    except (_UsageError, ValueError) as e:   # DataError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:   # e.g. the output disappeared or filled the disk mid-run
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


def _reexec_with_threads(argv):
    """Run this command again, once, with ``OMP_NUM_THREADS`` set: MXNet reads it only at start-up.

    Unless the user has set it, every operator gets every core (``recommended_omp_threads``); MXNet's own
    default, half the cores, measured slower at every number of contexts.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = str(recommended_omp_threads())
    os.execv(sys.executable, [sys.executable, "-m", "parallel.train", *argv])


if __name__ == "__main__":
    _reexec_with_threads(sys.argv[1:])
    sys.exit(main())
