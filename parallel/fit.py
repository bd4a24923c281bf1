"""The training loop, ``fit``: epochs of shuffled batches through a strategy, a few steps in flight, checkpoints
and stops.

``fit`` trains LeNet (from scratch) or the textbook's ResNet-18 (a gluon block on flat replicas) with any
strategy of ``parallel.strategies`` on the same batches with the same SGD step, in one process or as one worker
of a distributed job. It reports nothing itself: ``on_epoch`` and ``on_checkpoint`` receive what it measured
(``parallel.report`` formats and writes it). A tiny run on two CPU contexts:

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
import math
import sys
import time
import warnings

from tqdm import tqdm

from .checkpoint import TrainingState
from .comm import DEFAULT_ALGORITHM
from .comm.reducer import Reducer
from .data import iterate_batches, num_batches
from .data.batches import epoch_seed
import mxnet as mx

from .compress.feedback import job_names, place
from .job import KEYS, broadcast_arrays, broadcast_object, gather_arrays, sum_values
from .models.layout import init_model
from .optim.zero import as_optimizer, gather_state, load_state
from .strategies import check_options
from .strategies.registry import make_strategy
from .trace import trace, worker_path
from .validate import check_int, check_seed

__all__ = ["fit", "NonFiniteLossError", "TrainingStopped", "IN_FLIGHT", "TRACE_FIRST", "TRACE_STEPS"]

#: ``fit(trace=...)`` records steps TRACE_FIRST .. TRACE_FIRST + TRACE_STEPS - 1 of the run (counted from 1).
TRACE_FIRST, TRACE_STEPS = 2, 3

#: How many steps the host queues ahead of the devices. It then waits for the oldest step, reads its loss
#: (checking it is finite) and advances the progress bar: the bar counts finished batches, not queued ones,
#: and a NaN stops the run at the batch where it appeared. Two queued steps keep the devices busy while
#: Python queues the next one.
IN_FLIGHT = 2


class NonFiniteLossError(ValueError):
    """The training loss became NaN or infinite (``lr`` too large: the run diverged)."""


class TrainingStopped(Exception):
    """``fit`` stopped at a batch boundary because ``stop()`` asked it to; ``state`` says where."""

    def __init__(self, state):
        super().__init__(f"stopped at epoch {state.epoch} after {state.batch} batch(es)")
        self.state = state


class _Epoch:
    """One epoch's steps in flight: queue a step's (loss, correct) and read the oldest once ``IN_FLIGHT`` are
    queued; ``totals`` holds the summed loss, correct predictions and seconds of the finished batches."""

    def __init__(self, epoch, per_epoch, skip, totals, progress):
        self.epoch, self.totals = epoch, list(totals)
        self.in_flight = collections.deque()   # (batch number, loss, correct count) of the queued steps
        self.bar = tqdm(total=per_epoch, initial=skip, desc=f"epoch {epoch}", unit="batch", leave=False,
                        disable=not progress, file=sys.stderr)
        self.started = time.perf_counter()

    def queue(self, batch, loss, correct):
        self.in_flight.append((batch, loss, correct))
        if len(self.in_flight) > IN_FLIGHT:
            self._finish_oldest()

    def _finish_oldest(self):
        batch, loss, correct = self.in_flight.popleft()
        value = float(loss.asscalar())   # waits for the step
        if not math.isfinite(value):
            raise NonFiniteLossError(f"lr is too large: the loss became {value} at epoch {self.epoch}, batch "
                                     f"{batch} (training diverged); lower it")
        self.totals[0] += value
        self.totals[1] += float(correct.asscalar())
        self.bar.update(1)

    def drain(self):
        """Wait for every queued step; returns a copy of ``totals`` so far (the epoch goes on)."""
        while self.in_flight:
            self._finish_oldest()
        now = time.perf_counter()
        self.totals[2] += now - self.started
        self.started = now
        return list(self.totals)

    def finish(self):
        """Wait for every queued step and close the progress bar; returns ``totals``."""
        totals = self.drain()
        self.bar.close()
        return totals


class _Run:
    """What every epoch of a ``fit`` shares: the strategy, the optimizer and how to step it, the data, the seed."""

    def __init__(self, strategy, optimizer, accumulate, dataset, seed, batch_size, checkpoint_every, trace_path=None):
        self.strategy, self.optimizer, self.accumulate = strategy, optimizer, accumulate
        self.dataset, self.seed, self.batch_size = dataset, seed, batch_size
        self.checkpoint_every = checkpoint_every
        self.per_epoch = num_batches(len(dataset.train_labels), batch_size)
        self.trace_path, self.steps_run, self.tracing = trace_path, 0, None

    def checkpoint_due(self, epoch, batch):
        """Whether ``checkpoint_every`` asks for a checkpoint after ``batch`` of ``epoch``: after every
        ``checkpoint_every``-th optimizer step counted from the run's first (so a resumed run writes them where
        the uninterrupted one does), but not after an epoch's last batch, where the epoch's own is written."""
        step = (epoch - 1) * self.per_epoch + batch
        return bool(self.checkpoint_every) and batch < self.per_epoch and step % self.checkpoint_every == 0

    def step(self, X, y):
        self.steps_run += 1
        if self.trace_path is not None and self.steps_run == TRACE_FIRST:
            job = self.strategy.job
            self.tracing = trace(worker_path(self.trace_path, job), None if job is None else job.rank,
                                 self.strategy.ctx_list).__enter__()
        out = self.strategy.train_step(X, y, optimizer=self.optimizer, accumulate=min(self.accumulate, X.shape[0]))
        if self.steps_run == TRACE_FIRST + TRACE_STEPS - 1:
            self.end_trace()
        return out

    def end_trace(self):
        """Write the trace being recorded, if any (after its last step, or when the run ends sooner)."""
        if self.tracing is not None:
            tracing, self.tracing = self.tracing, None
            tracing.__exit__(None, None, None)

    def checkpoint(self, on_checkpoint, state):
        """Hand ``on_checkpoint`` the model's arrays, the optimizer's whole state and every worker's error
        feedback, read after the queued steps (in a job, every worker takes part; rank 0 gets the arrays)."""
        if on_checkpoint is not None:
            strategy = self.strategy
            feedback = _gather_feedback(strategy)
            on_checkpoint(state, strategy.params(), strategy.aux(),
                          gather_state(self.optimizer, strategy.groups(), strategy.params()), feedback)


def _train_epoch(run, epoch, state, stop, on_checkpoint, progress, history):
    """Train one epoch from ``state`` (its first batch, or where a checkpoint left it); return the totals, or
    raise ``TrainingStopped`` after writing the checkpoint when ``stop()`` asks."""
    dataset, batch_size, seed = run.dataset, run.batch_size, run.seed
    per_epoch = num_batches(len(dataset.train_labels), batch_size)
    resumed = epoch == state.epoch
    skip = state.batch if resumed else 0
    queued = _Epoch(epoch, per_epoch, skip, [state.loss_sum, state.correct, state.seconds] if resumed else [0.0] * 3,
                    progress)
    batches = iterate_batches(dataset.train_images, dataset.train_labels, batch_size, shuffle=True,
                              seed=epoch_seed(seed, epoch), start=skip)
    for b, (X, y) in enumerate(batches, start=skip + 1):
        if stop is not None and stop():
            here = TrainingState(epoch, b - 1, *queued.finish(), epoch_seed(seed, epoch), history)
            run.checkpoint(on_checkpoint, here)
            raise TrainingStopped(here)
        queued.queue(b, *run.step(X, y))
        if run.checkpoint_due(epoch, b):
            totals = queued.drain()
            if run.strategy.job is not None:   # the job's sums so far: a resumed epoch's metrics stay whole
                totals[:2] = sum_values(run.strategy.job, totals[:2])
            run.checkpoint(on_checkpoint, TrainingState(epoch, b, *totals, epoch_seed(seed, epoch), list(history)))
    return queued.finish()


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


def _shared_start(job, state, seed, per_epoch):
    """In a job, rank 0's seed (the data order) and start (a checkpoint it read), for every worker; the other
    workers' sums of a started epoch start at zero. Returns ``(state, seed)``."""
    if job is None:
        return state, seed
    shared = broadcast_object(job, {"seed": seed, "start": state._asdict()})
    seed, state = shared["seed"], TrainingState(**shared["start"])
    _check_start(state, seed, per_epoch)
    if job.rank != 0:
        state = state._replace(loss_sum=0.0, correct=0.0)
    return state, seed


def _epoch_metrics(strategy, dataset, epoch, totals, batch_size):
    """The finished epoch's metrics: the train sums (over every worker of a job) and the test accuracy."""
    n_train = len(dataset.train_labels)
    if strategy.job is not None:   # each worker summed the loss and the correct predictions of its slices
        totals[:2] = sum_values(strategy.job, totals[:2])
    test_acc = strategy.evaluate(iterate_batches(dataset.test_images, dataset.test_labels, batch_size))
    return {"epoch": epoch, "train_loss": totals[0] / n_train, "train_acc": totals[1] / n_train,
            "test_acc": test_acc, "seconds": totals[2], "images_per_second": n_train / totals[2]}


def _shared_optimizer_state(job, optimizer, strategy, optimizer_state):
    """Give the optimizer the checkpoint's state (rank 0's, broadcast in a job), laid out on the strategy."""
    params = strategy.params()
    if job is not None:
        resumed = broadcast_object(job, {"resumed": bool(optimizer_state)})["resumed"]
        if not resumed:
            return
        if job.rank != 0 or not optimizer_state:   # receive rank 0's, whatever this worker was given
            optimizer_state = {name: [param.zeros_like().as_in_context(mx.cpu()) for param in params]
                               for name in optimizer.state_names()}
        for k, name in enumerate(optimizer.state_names()):
            broadcast_arrays(job, KEYS["state"] + k, optimizer_state[name])
    if optimizer_state:
        load_state(optimizer, strategy.groups(), params, optimizer_state)


def _feedback_group(strategy):
    """The replicas of a strategy whose reducer keeps error feedback (a codec's residuals), or None."""
    reducer = getattr(strategy, "reducer", None)
    if reducer is None or reducer.codec is None:
        return None
    return strategy.device_params


def _gather_feedback(strategy):
    """Every worker's error-feedback state under ``"w<rank>/"`` names (``parallel.compress.feedback``), on rank
    0 (``{}`` elsewhere, and without compression). In a job, a collective call."""
    group = _feedback_group(strategy)
    if group is None:
        return {}
    local = strategy.reducer.state(group)
    job = strategy.job
    if job is None:
        return job_names(0, local)
    names = sorted(local)   # the same on every worker: the same layout, the same steps taken
    gathered = gather_arrays(job, KEYS["feedback"], [local[name] for name in names])
    if gathered is None:
        return {}
    return {name: value for rank, arrays in enumerate(gathered)
            for name, value in job_names(rank, dict(zip(names, arrays))).items()}


def _host_array(value):
    """An NDArray or numpy array as a float32 NDArray on the host."""
    return value.astype("float32").copyto(mx.cpu()) if isinstance(value, mx.nd.NDArray) else \
        mx.nd.array(value, dtype="float32")


def _shared_feedback(strategy, saved):
    """Give the compressor its share of a checkpoint's error-feedback state ``saved`` (rank 0's, broadcast in a
    job): its own arrays on the same layout, the residuals' sum on another (``parallel.compress.feedback``)."""
    group = _feedback_group(strategy)
    if group is None:
        if saved:
            raise ValueError("compression_state: the checkpoint holds compression residuals but this run "
                             "compresses nothing; resume it with the same compression")
        return
    job = strategy.job
    if job is not None:   # rank 0's, whatever this worker was given
        saved = (saved or {}) if job.rank == 0 else {}
        names = broadcast_object(job, {name: list(value.shape) for name, value in saved.items()})
        if names:
            arrays = [_host_array(saved[name]) if job.rank == 0 else mx.nd.zeros(tuple(shape))
                      for name, shape in sorted(names.items())]
            broadcast_arrays(job, KEYS["feedback"] + 1, arrays)
            saved = dict(zip(sorted(names), arrays))
    local, note = place(saved or {}, 0 if job is None else job.rank, 1 if job is None else job.num_workers,
                        len(group))
    if note is not None:
        warnings.warn(note, stacklevel=3)
    strategy.reducer.load_state(local, group)


def fit(dataset, ctx_list, num_epochs, batch_size, lr=None, seed=0, algorithm=DEFAULT_ALGORITHM, progress=False,
        on_epoch=None, strategy="data", stages=None, boundaries=None, micro_batches=None, params=None, start=None,
        stop=None, on_checkpoint=None, job=None, model="lenet", aux=None, optimizer=None, accumulate=1,
        optimizer_state=None, checkpoint_every=None, compression=None, trace=None, compression_state=None):
    """Train LeNet or ResNet-18 from scratch over ``ctx_list`` with data parallelism or another ``strategy``.

    Parameters
    ----------
    dataset : parallel.data.Dataset
        Train and test images (n, 28, 28) uint8 and labels.
    ctx_list : list of mxnet.Context
        Distinct contexts, at least one.
    num_epochs, batch_size : int
        Both >= 1. The last batch of an epoch may be smaller; it is trained on, not dropped.
    lr : float, optional
        Plain SGD at this learning rate, finite and > 0, within float32's range (``parallel.validate.check_lr``).
        Give ``lr`` or ``optimizer``.
    seed : int
        0 .. 2**32-1. Seeds the initial parameters and the shuffling (``epoch_seed``); the same seed gives
        the same run.
    algorithm : str
        Allreduce algorithm (see ``parallel.comm.allreduce``).
    progress : bool
        Show a tqdm progress bar per epoch (on stderr) that counts finished batches.
    on_epoch : callable, optional
        Called with each epoch's metrics dict and the history so far, after the epoch.
    strategy : str or strategy object
        One of ``parallel.strategies.STRATEGIES`` (built by ``make_strategy``), or a strategy already built
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
        ``on_checkpoint(state, params, aux, optimizer_state, compression_state)`` with a ``TrainingState``, the
        model's trainable live arrays and its others (the strategy's ``params()`` and ``aux()``; ``aux`` is
        ``[]`` for LeNet), the optimizer's whole state (``parallel.optim.gather_state``: ``{}`` for plain SGD),
        and, with ``compression``, every worker's error feedback (residuals, PowerSGD's ``Q`` matrices, named
        by worker and context as ``parallel.compress.feedback`` says; ``{}`` without compression, and on the
        workers but rank 0 of a job, which all take part in gathering it): after every epoch
        (the state then points at the next epoch's first batch), after every ``checkpoint_every`` optimizer
        steps, and when ``stop`` stops the run. Not called when the loss becomes NaN or infinite.
    model : str
        ``"lenet"`` or ``"resnet18"`` (``parallel.models.MODELS``), with a strategy name; a strategy object
        brings its own model.
    job : parallel.job.Job, optional
        Train as one worker of a distributed job (``parallel.job.join()``; data strategy only). Every
        worker calls ``fit`` with the same dataset and arguments; the parameters, ``seed`` and ``start``
        are rank 0's (the others' are ignored). Each worker trains its slice of every global batch
        (``batch_size`` stays the global batch), and the loss and accuracies are summed over the workers,
        so every worker returns the same history but for ``seconds`` (for ResNet-18 the test accuracy
        scores each worker's slice with that worker's BatchNorm statistics). Let ``on_epoch`` and
        ``on_checkpoint`` act on rank 0 alone when one copy of what they write is wanted. A state saved by
        ``stop`` mid-epoch holds rank 0's share of that epoch's loss and accuracy so far (the parameters
        are the job's), so after resuming, that epoch's train metrics leave out the other workers' batches
        before the stop.

    optimizer : parallel.optim.Optimizer, optional
        Instead of ``lr``: SGD with momentum, Adam or AdamW, with a schedule, clipping and ``zero`` sharding
        (data and hybrid strategies; model and pipeline keep each stage's state on its context and refuse
        ``zero``). Its step count is set from the start position: one step per batch.
    accumulate : int
        Run each batch as this many micro-batches before its update (``parallel.step.step_replicas``); a batch
        with fewer examples (an epoch's short last one) runs one per example.
    optimizer_state : dict, optional
        With ``start``, the checkpoint's optimizer state (``Checkpoint.optimizer_state``: whole, from any layout);
        in a job, rank 0's is given to every worker.
    checkpoint_every : int, optional
        Also call ``on_checkpoint`` after every this many optimizer steps (counted from the first step of the
        run, so a resumed run checkpoints where the uninterrupted one does), the steps in flight finished
        first; not after an epoch's last batch, whose checkpoint is the epoch's. In a job every worker must
        give the same value; the state's sums are then the whole job's so far.
    compression : str or parallel.compress.Codec, optional
        Data parallelism: sum the gradients between the contexts as compressed payloads with error feedback
        (``"fp16"``, ``"2bit"``, ``"topk:RATIO"``, ``"powersgd:RANK"``; see ``parallel.compress``). Its state
        (what error feedback has not sent yet) goes to ``on_checkpoint`` and comes back as ``compression_state``.
    trace : str or os.PathLike, optional
        Record steps ``TRACE_FIRST`` .. ``TRACE_FIRST + TRACE_STEPS - 1`` of this run (the first is left out: it
        allocates) with MXNet's profiler and write a Chrome trace there (``parallel.trace``); in a job of several
        workers, each writes the path with ``.workerR`` before its extension.
    compression_state : dict, optional
        With ``start`` and ``compression``, the checkpoint's error feedback (``Checkpoint.compression_state``,
        rank 0's in a job): on the layout that saved it, every context and worker continues from its own
        residuals and the run stays bitwise the uninterrupted one; on another layout, the sum of the residuals
        goes to the first context of rank 0 (``parallel.compress.feedback.place``), so nothing is lost.

    Returns
    -------
    (list of dict, object)
        One dict per epoch with ``epoch``, ``train_loss``, ``train_acc``, ``test_acc``, ``seconds``,
        ``images_per_second`` (a resumed run's history includes the checkpoint's epochs); and the trained
        model, the strategy's ``model``: for ``"data"`` the replicas (``device_params``, one per context;
        LeNet's eight arrays are ``device_params[0]``, a block's replica also holds ``.aux``), else the
        ``ModelParallel``, ``Pipeline`` or ``Hybrid`` object (``.params()`` and ``.aux()`` give them). Either is
        what ``parallel.export`` takes (``export_lenet``, or ``export_gluon`` for ResNet-18). The host queues
        at most ``IN_FLIGHT`` steps ahead of the devices, then reads the oldest step's loss.

    Raises
    ------
    NonFiniteLossError
        When the loss becomes NaN or infinite, naming the epoch and the batch.
    TrainingStopped
        When ``stop()`` returned True.
    ValueError, TypeError
        For an argument out of range (checked before any training).
    """
    check_int(num_epochs, "num_epochs", low=1)
    check_int(batch_size, "batch_size", low=1)
    optimizer = as_optimizer(lr, optimizer)
    check_int(accumulate, "accumulate", low=1, high=batch_size)
    check_seed(seed)
    if checkpoint_every is not None:
        check_int(checkpoint_every, "checkpoint_every", low=1)
    per_epoch = num_batches(len(dataset.train_labels), batch_size)
    state = start if start is not None else TrainingState(1, 0, 0.0, 0.0, 0.0, epoch_seed(seed, 1), [])
    _check_start(state, seed, per_epoch)
    if isinstance(strategy, str):
        check_options(strategy, stages, boundaries, micro_batches, batch_size, job is not None, optimizer.zero,
                      algorithm)
        strategy = make_strategy(strategy, init_model(model, seed, params, aux), ctx_list, stages, boundaries,
                                 micro_batches, batch_size, Reducer(algorithm, compression=compression, job=job))
    elif compression not in (None, "none"):
        raise ValueError("compression: fit got a strategy object; pass compression to make_strategy instead")
    elif job is not None and strategy.job is not job:
        raise ValueError("job: fit got a job but the strategy was built without it; pass job to make_strategy")
    state, seed = _shared_start(strategy.job, state, seed, per_epoch)
    _shared_optimizer_state(strategy.job, optimizer, strategy, optimizer_state)
    _shared_feedback(strategy, compression_state)
    optimizer.num_update = (state.epoch - 1) * per_epoch + state.batch   # one optimizer step per batch
    run = _Run(strategy, optimizer, accumulate, dataset, seed, batch_size, checkpoint_every, trace)
    history = list(state.history)
    try:
        for epoch in range(state.epoch, num_epochs + 1):
            totals = _train_epoch(run, epoch, state, stop, on_checkpoint, progress, history)
            metrics = _epoch_metrics(strategy, dataset, epoch, totals, batch_size)
            history.append(metrics)
            if on_epoch is not None:
                on_epoch(metrics, history)
            run.checkpoint(on_checkpoint, TrainingState(epoch + 1, 0, 0.0, 0.0, 0.0, epoch_seed(seed, epoch + 1),
                                                        list(history)))
    finally:
        run.end_trace()   # a run shorter than the traced steps still writes what it recorded
    return history, strategy.model
