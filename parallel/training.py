"""The training loop behind ``python -m parallel.train``: lay a model out for a strategy, train, report.

``fit`` trains LeNet (from scratch) or the textbook's ResNet-18 (a gluon block on flat replicas) with data
parallelism written from scratch, or with the model, pipeline or hybrid strategy, on the same batches with the
same SGD step; ``plot_metrics`` and ``write_metrics`` write what it measured. A tiny run on two CPU contexts:

>>> import mxnet as mx
>>> from parallel import fit, synthetic_dataset
>>> history, device_params = fit(synthetic_dataset(num_train=512, num_test=128), [mx.cpu(0), mx.cpu(1)],
...                              num_epochs=2, batch_size=64, lr=0.2)
>>> [sorted(m) for m in history][0]
['epoch', 'images_per_second', 'seconds', 'test_acc', 'train_acc', 'train_loss']
>>> [m["epoch"] for m in history], len(device_params)
([1, 2], 2)
"""
import collections
import functools
import json
import math
import os
import sys
import time
from typing import Callable, List, NamedTuple

import numpy as np
from tqdm import tqdm

import mxnet as mx
from mxnet import gluon

from .comm import get_params
from .data import iterate_batches, load_fashion_mnist, num_batches, synthetic_dataset
from .checkpoint import MODELS, TrainingState
from .evaluate import evaluate_accuracy
from .files import atomic_write
from .kvstore import broadcast_object, broadcast_params, sum_values
from .models import block_state, init_lenet_params, init_resnet18, lenet_cached
from .settings import DEFAULT_ALGORITHM, DEFAULT_MICRO_BATCHES, STRATEGIES, check_lr, check_seed
from .step import train_step
from .strategies import Hybrid, ModelParallel, Pipeline
from .strategies._checks import check_contexts

__all__ = ["fit", "make_strategy", "init_model", "Strategy", "STRATEGIES", "MODELS", "MODEL_TITLES", "load_data",
           "plot_metrics", "write_metrics", "format_epoch", "epoch_seed", "plot_format", "plot_formats",
           "NonFiniteLossError", "TrainingStopped", "TrainingState", "IN_FLIGHT"]

#: How the epoch lines, plots and messages name each model of ``MODELS``.
MODEL_TITLES = {"lenet": "LeNet", "resnet18": "ResNet-18"}

#: The kvstore key that broadcasts rank 0's non-trained arrays (BatchNorm's running statistics), beside
#: ``parallel.kvstore``'s own keys (0 .. 2, 100 + n, 1000 + i).
AUX_KEY = 3

#: How many steps the host queues ahead of the devices. It then waits for the oldest step, reads its loss
#: (checking it is finite) and advances the progress bar: the bar counts finished batches, not queued ones,
#: and a NaN stops the run at the batch where it appeared. Two queued steps keep the devices busy while
#: Python queues the next one.
IN_FLIGHT = 2


class NonFiniteLossError(ValueError):
    """The training loss became NaN or infinite."""


class TrainingStopped(Exception):
    """``fit`` stopped at a batch boundary because ``stop()`` asked it to; ``state`` says where."""

    def __init__(self, state):
        super().__init__(f"stopped at epoch {state.epoch} after {state.batch} batch(es)")
        self.state = state


def _check_positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def epoch_seed(seed, epoch):
    """The shuffling seed of ``epoch`` in a run seeded with ``seed``: any seed in 0 .. 2**32-1 gives one.

    Both numbers feed a ``numpy.random.SeedSequence``, so neighbouring seeds and epochs give unrelated
    orders and nothing overflows (a formula such as ``seed * 100003 + epoch`` leaves numpy's range for
    seeds above 42949).

    >>> epoch_seed(2**32 - 1, 1) <= 2**32 - 1
    True
    >>> epoch_seed(0, 1) == epoch_seed(0, 1) != epoch_seed(0, 2)
    True
    """
    check_seed(seed)
    return int(np.random.SeedSequence([int(seed), int(epoch)]).generate_state(1)[0])


class Strategy(NamedTuple):
    """What ``fit`` needs from a parallel style: a train step and an evaluation over the contexts it uses."""
    name: str
    #: ``device_params`` (one replica per context, ``get_params``'s) for ``"data"``; the ``ModelParallel``,
    #: ``Pipeline`` or ``Hybrid`` object otherwise. Trained in place.
    model: object
    #: The contexts actually used (model and pipeline parallelism use one per stage).
    ctx_list: List
    #: ``train_step(X, y, lr)`` -> (summed loss, correct count), each (1,) on ``ctx_list[0]``, not waited for.
    train_step: Callable
    #: ``evaluate(data_iter)`` -> accuracy in [0, 1].
    evaluate: Callable
    #: One line saying how the model is laid out on the contexts.
    description: str
    #: ``params()`` -> the model's trainable live arrays (replica 0's, or each on its stage's context): LeNet's
    #: eight, or a gluon block's in ``block_state(block)`` order. What a checkpoint stores and
    #: ``parallel.export`` writes.
    params: Callable
    #: The distributed job (``parallel.kvstore.join()``) this worker trains in, or None for one process.
    job: object = None
    #: ``aux()`` -> the live arrays that are not trained (a block's BatchNorm running statistics), in
    #: ``block_state(block)`` order; ``[]`` for LeNet. Stored and exported with ``params()``.
    aux: Callable = list


def init_model(model="lenet", seed=0, params=None, aux=None):
    """The initial model of a run, as ``make_strategy`` takes it.

    Parameters
    ----------
    model : str
        ``"lenet"`` (the from-scratch LeNet) or ``"resnet18"`` (the textbook's ResNet-18 for 1x28x28 images and
        10 classes, ``init_resnet18``): one of ``MODELS``.
    seed : int
        Seeds the initial values when ``params`` is not given.
    params, aux : list of NDArray, optional
        Values to start from (a checkpoint's): the trainable arrays and the others (BatchNorm's running
        statistics), in ``block_state`` order for ResNet-18 (``aux`` is required with it); LeNet's eight, and
        no ``aux``, for LeNet. Copied, not modified.

    Returns
    -------
    list of NDArray or mxnet.gluon.nn.HybridSequential
        LeNet's eight arrays (on the CPU), or ResNet-18 as an initialized gluon block on the CPU.

    Raises
    ------
    ValueError
        For an unknown model, or arrays that do not fit it (count, shape).
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    if model == "lenet":
        if aux:
            raise ValueError(f"LeNet has no arrays besides its parameters, got {len(aux)} aux arrays")
        return init_lenet_params(seed) if params is None else list(params)
    block = init_resnet18(seed, num_classes=10, input_shape=(1, 1, 28, 28))
    if params is None:
        return block
    names, arrays, aux_names, aux_arrays = block_state(block)
    aux = [] if aux is None else list(aux)
    for what, values, targets, target_names in (("trainable", list(params), arrays, names),
                                                ("non-trained", aux, aux_arrays, aux_names)):
        if len(values) != len(targets):
            raise ValueError(f"ResNet-18 has {len(targets)} {what} arrays, got {len(values)}")
        for name, value, target in zip(target_names, values, targets):
            if value.shape != target.shape:
                raise ValueError(f"{name} has shape {target.shape} in ResNet-18, got {value.shape}")
            target[:] = value.as_in_context(target.context)
    return block


def _data_step(X, y, lr, device_params, ctx_list, algorithm, job, net):
    return train_step(X, y, device_params, ctx_list, lr, net=net, algorithm=algorithm, job=job)


def _replica_aux(replica):
    return list(getattr(replica, "aux", ()))


def _broadcast_aux(job, device_params):
    """Give every replica of every worker rank 0's non-trained arrays (BatchNorm's running statistics), in
    place: one broadcast of their concatenation. A collective call, like ``broadcast_params``."""
    aux = _replica_aux(device_params[0])
    if not aux:
        return
    flat = job.broadcast(AUX_KEY, mx.nd.concat(*[a.reshape(-1) for a in aux], dim=0))
    for params in device_params:
        offset = 0
        for array in _replica_aux(params):
            flat[offset:offset + array.size].reshape(array.shape).copyto(array)
            offset += array.size


def _pipeline_step(X, y, lr, model):
    """A short last batch (fewer examples than micro-batches) runs in one micro-batch per example."""
    return model.train_step(X, y, lr, micro_batches=min(model.micro_batches, X.shape[0]))


def make_strategy(name, params, ctx_list, stages=None, boundaries=None, micro_batches=None, batch_size=None,
                  algorithm=DEFAULT_ALGORITHM, job=None):
    """Lay a model out on ``ctx_list`` for one parallel style.

    Parameters
    ----------
    name : str
        ``"data"`` (one replica per context, ``train_step``), ``"model"`` (``ModelParallel``),
        ``"pipeline"`` (``Pipeline``) or ``"hybrid"`` (``Hybrid``).
    params : list of NDArray, or mxnet.gluon.nn.HybridSequential
        The initial model (``init_model``): LeNet's eight arrays, or an initialized gluon block with known
        shapes (ResNet-18; data parallelism replicates it with ``get_params(block, ctx)`` and runs it with
        ``net=block``, the other strategies cut it at its children). Copied, not modified.
    ctx_list : list of mxnet.Context
        Distinct contexts, at least one.
    stages, boundaries
        Where to cut the model (see ``parallel.strategies.stage_ranges``; default two stages); not for ``"data"``.
    micro_batches : int, optional
        Pipeline only (default ``DEFAULT_MICRO_BATCHES``). A batch with fewer examples than micro-batches
        (the short last batch of an epoch) is trained in one micro-batch per example.
    batch_size : int, optional
        When given, more micro-batches than ``batch_size`` are refused up front.
    algorithm : str
        Allreduce algorithm for ``"data"`` and ``"hybrid"``.
    job : parallel.kvstore.Job, optional
        ``"data"`` only: train as one worker of a distributed job. Every worker's replicas get rank 0's
        ``params`` and, for a block, its running statistics (a collective call: every worker must make it);
        each step trains this worker's slice of the global batch and sums the gradients over the workers;
        evaluation combines the workers' counts. BatchNorm normalises over the worker's slice, synchronized
        across its contexts but not across the workers, so each worker's running statistics drift apart
        from the others' and a job with BatchNorm is not the same computation as one context.

    Returns
    -------
    Strategy
        ``Strategy.ctx_list`` holds the contexts actually used: model and pipeline parallelism use one per
        stage and leave the rest of ``ctx_list`` idle.

    Raises
    ------
    ValueError, TypeError
        For an unknown name, an empty or repeated ``ctx_list``, an option the strategy does not take, or a
        layout the contexts cannot hold.
    """
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    check_contexts(ctx_list)
    if name == "data" and (stages is not None or boundaries is not None):
        raise ValueError("stages and boundaries apply to the model, pipeline and hybrid strategies, not to data "
                         "parallelism; drop them or choose another strategy")
    if job is not None and name != "data":
        raise ValueError(f"a distributed job trains with the data strategy, not {name}; run the {name} strategy "
                         "in one process")
    if micro_batches is not None and name != "pipeline":
        raise ValueError(f"micro-batches apply to the pipeline strategy only, not to {name}; drop them or "
                         "choose the pipeline strategy")
    if name == "data":
        net = params if isinstance(params, gluon.Block) else lenet_cached
        device_params = [get_params(params, ctx) for ctx in ctx_list]
        description = f"one replica per context, gradients summed with the {algorithm} allreduce"
        if net is not lenet_cached and len(ctx_list) > 1:
            description += ", BatchNorm over the whole batch"
        if job is not None:
            broadcast_params(job, device_params)
            _broadcast_aux(job, device_params)
            description += f", then over {job.num_workers} worker(s) through the {job.kv.type} kvstore"
            if _replica_aux(device_params[0]):
                description += " (BatchNorm statistics per worker)"
        return Strategy(name, device_params, list(ctx_list),
                        functools.partial(_data_step, device_params=device_params, ctx_list=ctx_list,
                                          algorithm=algorithm, job=job, net=net),
                        functools.partial(evaluate_accuracy,
                                          device_params=device_params, ctx_list=ctx_list, net=net, job=job),
                        description, functools.partial(list, device_params[0]), job,
                        functools.partial(_replica_aux, device_params[0]))
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
    return Strategy(name, model, model.ctx_list, step, model.evaluate, model.describe(), model.params, None,
                    model.aux)


def _read_finished(loss, right, epoch, batch):
    """Wait for one step's loss and correct count, and return them as floats; raise if the loss is not finite."""
    value = float(loss.asscalar())
    if not math.isfinite(value):
        raise NonFiniteLossError(f"loss became {value} at epoch {epoch}, batch {batch}; "
                                 "training diverged: lower --lr")
    return value, float(right.asscalar())


def fit(dataset, ctx_list, num_epochs, batch_size, lr, seed=0, algorithm=DEFAULT_ALGORITHM, progress=False,
        on_epoch=None, strategy="data", stages=None, boundaries=None, micro_batches=None, params=None, start=None,
        stop=None, on_checkpoint=None, job=None, model="lenet", aux=None):
    """Train LeNet or ResNet-18 from scratch over ``ctx_list`` with data parallelism or another ``strategy``.

    Parameters
    ----------
    dataset : parallel.data.Dataset
        Train and test images (n, 28, 28) uint8 and labels.
    ctx_list : list of mxnet.Context
        Distinct contexts, at least one.
    num_epochs, batch_size : int
        Both >= 1. The last batch of an epoch may be smaller; it is trained on, not dropped.
    lr : float
        Learning rate, finite and > 0, within float32's range (see ``parallel.settings.check_lr``).
    seed : int
        0 .. 2**32-1. Seeds the initial parameters and the shuffling (``epoch_seed``); the same seed gives
        the same run.
    algorithm : str
        Allreduce algorithm (see ``parallel.comm.allreduce``).
    progress : bool
        Show a tqdm progress bar per epoch (on stderr) that counts finished batches.
    on_epoch : callable, optional
        Called with each epoch's metrics dict and the history so far, after the epoch.
    strategy : str or Strategy
        One of ``STRATEGIES`` (see ``make_strategy``), or a ``Strategy`` already built by ``make_strategy``
        (its parameters and contexts are used as they are; ``seed`` then only seeds the shuffling).
    stages, boundaries, micro_batches
        Passed to ``make_strategy`` with a strategy name.
    params, aux : list of NDArray, optional
        With a strategy name: the initial values (a checkpoint's), the model's trainable arrays and, for
        ResNet-18, its running statistics (see ``init_model``); default ``init_model(model, seed)``.
    start : parallel.checkpoint.TrainingState, optional
        Where to continue: a checkpoint's state (its epoch, the batches of it already trained, their sums, the
        history). With the checkpoint's parameters, the same layout and the same arguments, the run ends with
        parameters bitwise equal to a run never interrupted.
    stop : callable, optional
        ``stop()`` is asked before each batch; when it returns True the queued steps are finished,
        ``on_checkpoint`` is called and ``TrainingStopped`` is raised: the run stops at a batch boundary.
    on_checkpoint : callable, optional
        ``on_checkpoint(state, params, aux)`` with a ``TrainingState``, the model's trainable live arrays and
        its others (``Strategy.params()`` and ``Strategy.aux()``; ``aux`` is ``[]`` for LeNet): after every
        epoch (the state then points at the next epoch's first batch) and when ``stop`` stops the run. Not
        called when the loss becomes NaN or infinite.
    model : str
        ``"lenet"`` or ``"resnet18"`` (``MODELS``), with a strategy name; a ``Strategy`` brings its own model.
    job : parallel.kvstore.Job, optional
        Train as one worker of a distributed job (``parallel.kvstore.join()``; data strategy only). Every
        worker calls ``fit`` with the same dataset and arguments; the parameters, ``seed`` and ``start``
        are rank 0's (the others' are ignored). Each worker trains its slice of every global batch
        (``batch_size`` stays the global batch), and the loss and accuracies are summed over the workers,
        so every worker returns the same history but for ``seconds`` (for ResNet-18 the test accuracy
        scores each worker's slice with that worker's BatchNorm statistics). Let ``on_epoch`` and
        ``on_checkpoint`` act on rank 0 alone when one copy of what they write is wanted. A state saved by
        ``stop`` mid-epoch holds rank 0's share of that epoch's loss and accuracy so far (the parameters
        are the job's), so after resuming, that epoch's train metrics leave out the other workers' batches
        before the stop.

    Returns
    -------
    (list of dict, object)
        One dict per epoch with ``epoch``, ``train_loss``, ``train_acc``, ``test_acc``, ``seconds``,
        ``images_per_second`` (a resumed run's history includes the checkpoint's epochs); and the trained
        model, ``Strategy.model``: for ``"data"`` the replicas (``device_params``, one per context; LeNet's
        eight arrays are ``device_params[0]``, a block's replica also holds ``.aux``), else the
        ``ModelParallel``, ``Pipeline`` or ``Hybrid`` object (``.params()`` and ``.aux()`` give them). Either
        is what ``parallel.export`` takes (``export_lenet``, or ``export_gluon`` for ResNet-18). The host queues at most
        ``IN_FLIGHT`` steps ahead of the devices, then reads the oldest step's loss.

    Raises
    ------
    NonFiniteLossError
        When the loss becomes NaN or infinite, naming the epoch and the batch.
    TrainingStopped
        When ``stop()`` returned True.
    ValueError, TypeError
        For an argument out of range (checked before any training).
    """
    _check_positive_int(num_epochs, "num_epochs")
    _check_positive_int(batch_size, "batch_size")
    check_lr(lr)
    check_seed(seed)
    n_train = len(dataset.train_labels)
    per_epoch = num_batches(n_train, batch_size)
    state = start if start is not None else TrainingState(1, 0, 0.0, 0.0, 0.0, epoch_seed(seed, 1), [])
    _check_start(state, seed, per_epoch)
    if not isinstance(strategy, Strategy):
        strategy = make_strategy(strategy, init_model(model, seed, params, aux), ctx_list, stages, boundaries,
                                 micro_batches, batch_size, algorithm, job)
    elif job is not None and strategy.job is not job:
        raise ValueError("fit got a job but the strategy was built without it; pass job to make_strategy")
    job = strategy.job
    if job is not None:   # rank 0's seed (the data order) and start (a checkpoint it read)
        shared = broadcast_object(job, {"seed": seed, "start": state._asdict()})
        seed, state = shared["seed"], TrainingState(**shared["start"])
        _check_start(state, seed, per_epoch)   # the others' sums of the started epoch start at zero
        if job.rank != 0:
            state = state._replace(loss_sum=0.0, correct=0.0)
    history = list(state.history)
    for epoch in range(state.epoch, num_epochs + 1):
        resumed = epoch == state.epoch
        skip = state.batch if resumed else 0
        batches = iterate_batches(dataset.train_images, dataset.train_labels, batch_size,
                                  shuffle=True, seed=epoch_seed(seed, epoch), start=skip)
        bar = tqdm(total=per_epoch, initial=skip, desc=f"epoch {epoch}", unit="batch",
                   leave=False, disable=not progress, file=sys.stderr)
        # summed loss, correct predictions and seconds of the finished batches
        totals = [state.loss_sum, state.correct, state.seconds] if resumed else [0.0, 0.0, 0.0]
        in_flight = collections.deque()   # (batch number, loss, correct count) of the queued steps

        def finish_oldest():
            done, loss, right = in_flight.popleft()
            for i, value in enumerate(_read_finished(loss, right, epoch, done)):
                totals[i] += value
            bar.update(1)

        def finish_all(started):
            while in_flight:
                finish_oldest()
            totals[2] += time.perf_counter() - started

        started = time.perf_counter()
        for b, (X, y) in enumerate(batches, start=skip + 1):
            if stop is not None and stop():
                finish_all(started)
                bar.close()
                here = TrainingState(epoch, b - 1, *totals, epoch_seed(seed, epoch), history)
                if on_checkpoint is not None:
                    on_checkpoint(here, strategy.params(), strategy.aux())
                raise TrainingStopped(here)
            in_flight.append((b, *strategy.train_step(X, y, lr)))
            if len(in_flight) > IN_FLIGHT:
                finish_oldest()
        finish_all(started)
        bar.close()
        if job is not None:   # each worker summed the loss and the correct predictions of its slices
            totals[:2] = sum_values(job, totals[:2])
        test_acc = strategy.evaluate(iterate_batches(dataset.test_images, dataset.test_labels, batch_size))
        metrics = {"epoch": epoch, "train_loss": totals[0] / n_train, "train_acc": totals[1] / n_train,
                   "test_acc": test_acc, "seconds": totals[2], "images_per_second": n_train / totals[2]}
        history.append(metrics)
        if on_epoch is not None:
            on_epoch(metrics, history)
        if on_checkpoint is not None:
            on_checkpoint(TrainingState(epoch + 1, 0, 0.0, 0.0, 0.0, epoch_seed(seed, epoch + 1), list(history)),
                          strategy.params(), strategy.aux())
    return history, strategy.model


def _check_start(state, seed, per_epoch):
    """Raise ``ValueError`` unless ``state`` is a position this run can continue from."""
    if not isinstance(state, TrainingState):
        raise TypeError(f"start must be a TrainingState (a checkpoint's state), got {type(state).__name__}")
    if state.epoch < 1 or not 0 <= state.batch < per_epoch:
        raise ValueError(f"start points at epoch {state.epoch}, batch {state.batch}, but an epoch here has "
                         f"{per_epoch} batches; the checkpoint belongs to another batch size or dataset")
    if len(state.history) != state.epoch - 1:
        raise ValueError(f"start is in epoch {state.epoch} but holds {len(state.history)} finished epochs")
    if state.shuffle_seed != epoch_seed(seed, state.epoch):
        raise ValueError(f"start orders epoch {state.epoch} with seed {state.shuffle_seed}, but seed {seed} gives "
                         f"{epoch_seed(seed, state.epoch)}: the data order would change")


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


@functools.lru_cache(maxsize=None)
def plot_formats():
    """The file formats matplotlib writes here, by suffix without the dot (``png``, ``pdf``, ``svg``, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase
    return tuple(sorted(FigureCanvasBase.get_supported_filetypes()))


def plot_format(path):
    """The format named by ``path``'s suffix (``"png"`` for ``curves.png``); ``ValueError`` when matplotlib
    cannot write it or there is no suffix.

    >>> plot_format("curves.PDF")
    'pdf'
    """
    suffix = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
    if suffix not in plot_formats():
        raise ValueError(f"cannot tell the plot format of {os.fspath(path)!r}: end the file name with a format "
                         f"matplotlib writes, one of {', '.join('.' + f for f in plot_formats())}")
    return suffix


def plot_metrics(history, path=None, title=None):
    """Plot the loss and accuracy curves; write them to ``path`` (atomically) if given.

    Parameters
    ----------
    history : list of dict
        As returned by ``fit``.
    path : str or os.PathLike, optional
        The file's suffix names its format (``.png``, ``.pdf``, ``.svg``, ``.jpg``, ...; see
        ``plot_formats``); an unknown or missing suffix raises ``ValueError`` before anything is written.
    title : str, optional

    Returns
    -------
    matplotlib.figure.Figure
        Built without pyplot, so it never changes the plotting backend (a notebook shows it with
        ``display(fig)``).
    """
    from matplotlib.figure import Figure

    fmt = None if path is None else plot_format(path)
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
            fig.savefig(f, format=fmt, dpi=100)
    return fig


def format_epoch(metrics, ctx_list, strategy="data", workers=1):
    """The textbook's one-line epoch summary; other strategies than data parallelism are named, and a job's
    workers counted (``ctx_list`` is then each worker's contexts)."""
    name = "" if strategy == "data" else f", {strategy} parallel"
    where = f"[{', '.join(str(c) for c in ctx_list)}]"
    return (f"epoch {metrics['epoch']}, loss {metrics['train_loss']:.3f}, "
            f"train acc {metrics['train_acc']:.3f}, test acc {metrics['test_acc']:.3f}, "
            f"{metrics['seconds']:.1f} sec/epoch, {metrics['images_per_second']:.0f} examples/sec{name} "
            f"on {where if workers == 1 else f'{workers} workers x {where}'}")
