"""The training loop, ``fit``: epochs of shuffled batches through a built strategy, a few steps in flight,
checkpoints and stops.

``fit(dataset, strategy, optimizer, config)`` trains whatever ``strategy`` holds (``parallel.make_strategy``: any
model of ``parallel.models.MODELS``, any parallel style, in one process or as one worker of a distributed job) with
the optimizer's step on the batches ``config`` (a ``parallel.config.RunConfig``) describes. It reports nothing
itself: ``on_epoch`` and ``on_checkpoint`` receive what it measured (``parallel.report`` formats and writes it). A
tiny run on two CPU contexts:

>>> import mxnet as mx
>>> from parallel import RunConfig, fit, init_model, make_strategy, synthetic_dataset
>>> strategy = make_strategy("data", init_model("lenet", seed=0), [mx.cpu(0), mx.cpu(1)])
>>> history, device_params = fit(synthetic_dataset(num_train=512, num_test=128), strategy, 0.2,
...                              RunConfig(epochs=2, batch_size=64))
>>> [sorted(m) for m in history][0]
['epoch', 'images_per_second', 'seconds', 'test_acc', 'train_acc', 'train_loss', 'workers']
>>> [m["epoch"] for m in history], len(device_params)
([1, 2], 2)
"""
import collections
import dataclasses
import math
import numbers
import sys
import time
import warnings

from tqdm import tqdm

import mxnet as mx

from .board import Board, config_table
from .checkpoint import Checkpoint, Snapshot, TrainingState
from .comm.algorithms import buffer_bytes, copied_bytes
from .comm.replica import data_of
from .compress.feedback import job_names, place
from .config import RunConfig
from .data import iterate_batches, num_batches
from .data.batches import epoch_seed
from .job import KEYS, broadcast_arrays, broadcast_object, gather_arrays, sum_values
from .optim.zero import as_optimizer, memory_table
from .strategies.base import Strategy
from .trace import trace, worker_path
from .validate import BadType, BadValue

__all__ = ["fit", "check_start", "memory_of", "NonFiniteLossError", "TrainingStopped", "IN_FLIGHT", "TRACE_FIRST",
           "TRACE_STEPS", "trace_first"]

#: ``fit(trace=...)`` records steps TRACE_FIRST .. TRACE_FIRST + TRACE_STEPS - 1 of the run (counted from 1): the
#: first step allocates. A run of fewer steps records those it has from ``trace_first``: at least its last one.
TRACE_FIRST, TRACE_STEPS = 2, 3


def trace_first(steps):
    """The first step (counted from 1) ``fit(trace=...)`` records of a run of ``steps`` steps: ``TRACE_FIRST``, or
    the last step of a shorter run; None for a run of no step, which writes no trace.

    >>> [trace_first(steps) for steps in (0, 1, 2, 3, 100)]
    [None, 1, 2, 2, 2]
    """
    return min(TRACE_FIRST, steps) or None

#: How many steps the host queues ahead of the devices. It then waits for the oldest step, reads its loss
#: (checking it is finite) and advances the progress bar: the bar counts finished batches, not queued ones,
#: and a NaN stops the run at the batch where it appeared. Two queued steps keep the devices busy while
#: Python queues the next one.
IN_FLIGHT = 2


class NonFiniteLossError(BadValue):
    """The training loss became NaN or infinite: the run diverged. The message names the likely causes, the
    optimizer's hyper-parameters set away from their defaults (``lr`` when none is), as a ``BadValue`` naming
    them, so that the CLI names its flags."""

    @classmethod
    def at(cls, value, epoch, batch, changed):
        """The error for a loss that became ``value`` at ``batch`` of ``epoch``; ``changed`` maps the optimizer's
        hyper-parameters set away from their defaults to their values (``Optimizer.changed``)."""
        return cls.diverged(f"the loss became {value} at epoch {epoch}, batch {batch} (training diverged)", changed)

    @classmethod
    def parameters(cls, epoch, batch, changed):
        """The error for parameters found non-finite after ``batch`` of ``epoch`` (the loss may stay finite: a
        saturated activation hides an infinite weight)."""
        return cls.diverged(f"the parameters became NaN or infinite by epoch {epoch}, batch {batch} (training "
                            "diverged)", changed)

    @classmethod
    def diverged(cls, where, changed):
        """The error naming the likely causes of ``where`` (what became non-finite, when)."""
        if not changed or list(changed) == ["lr"]:   # nothing else was touched: the rate is too large for the model
            return cls("lr", f"{{lr}} is too large: {where}; lower it")
        named = [f"{{{name}={value:g}}}" for name, value in changed.items()]
        if len(named) == 1:
            return cls(next(iter(changed)), f"{named[0]} is likely too large (set away from its default): {where}; "
                                            "lower it")
        return cls(next(iter(changed)), f"{where}; the likely causes are the settings away from their defaults, "
                                        f"{', '.join(named[:-1])} or {named[-1]}: lower them")


def finite_parameters(strategy):
    """Whether every trained array the strategy holds on this worker is finite, and in a job on every worker (a
    collective: every worker calls it at the same point). An array times 0 sums to 0 exactly when it holds no NaN
    or infinity; one read for all the arrays."""
    sums = [mx.nd.sum(array * 0).as_in_context(mx.cpu())
            for group in strategy.groups() for replica in group
            for array in data_of(replica) if array.size]
    bad = float(mx.nd.add_n(*sums).asscalar() != 0) if sums else 0.0   # NaN != 0
    if strategy.job is not None:
        bad = sum_values(strategy.job, [bad])[0]
    return not bad


def memory_of(strategy, optimizer):
    """What each context of ``strategy`` holds for training now (``memory_table``; docs/memory.md, "What a context
    holds"): its parameters, gradients and optimizer state, ZeRO-3's gather buffers, and as temporary buffers every
    buffer the package keeps there between steps: the receive buffers its reductions and collectives keep
    (``buffer_bytes``: the allreduce's, a reduce-scatter's, tensor ranks' f and g, a codec's) and the strategy's
    own (ZeRO-3's unit gradient). Measure it after a step: the receive buffers are allocated by the first."""
    gathered, own = strategy.memory_buffers()
    temporary = buffer_bytes()
    for ctx, nbytes in own.items():
        temporary[ctx] = temporary.get(ctx, 0) + nbytes
    table = memory_table(optimizer, strategy.groups(), gathered, temporary)
    activations = {str(ctx): entry for ctx, entry in strategy.activations().items()}
    for row in table:   # tensor ranks: what the last step's forward kept for backward (not in the totals)
        if row["context"] in activations:
            row["activations"] = activations[row["context"]]
    return table


class TrainingStopped(Exception):
    """``fit`` stopped at a batch boundary because ``stop()`` asked it to; ``state`` says where."""

    def __init__(self, state):
        super().__init__(f"stopped at epoch {state.epoch} after {state.batch} batch(es)")
        self.state = state


class _Epoch:
    """One epoch's steps in flight: queue a step's (loss, correct) and read the oldest once ``IN_FLIGHT`` are
    queued; ``totals`` holds the summed loss, correct predictions and seconds of the finished batches."""

    def __init__(self, epoch, per_epoch, skip, totals, progress, changed, board=None):
        self.epoch, self.totals, self.changed, self.board = epoch, list(totals), changed, board
        self.in_flight = collections.deque()   # (batch number, loss, correct count, step's log) of the queued steps
        self.bar = tqdm(total=per_epoch, initial=skip, desc=f"epoch {epoch}", unit="batch", leave=False,
                        disable=not progress, file=sys.stderr)
        self.started = self.finished = time.perf_counter()   # finished: when the last step's loss was read

    def queue(self, batch, loss, correct, logged=None):
        self.in_flight.append((batch, loss, correct, logged))
        if len(self.in_flight) > IN_FLIGHT:
            self._finish_oldest()

    def _finish_oldest(self):
        batch, loss, correct, logged = self.in_flight.popleft()
        value = float(loss.asnumpy()[0])   # waits for the step
        if not math.isfinite(value):
            raise NonFiniteLossError.at(value, self.epoch, batch, self.changed)
        self.totals[0] += value
        self.totals[1] += float(correct.asnumpy()[0])
        self.bar.update(1)
        if logged is not None:
            self._log(value, *logged)

    def _log(self, loss, step, lr, grad_norm, examples, share, moved, pushed):
        """Write a finished step's scalars (``parallel.board.STEP_TAGS``) where its loss is read: its gradient norm
        was queued with it, so reading it here waits for no more than the step's own work."""
        now = time.perf_counter()
        seconds, self.finished = now - self.finished, now
        self.board.scalars({"train/loss": loss / share, "train/lr": lr,
                            "train/grad_norm": None if grad_norm is None else float(grad_norm.asscalar()),
                            "train/examples_per_second": examples / seconds if seconds > 0 else None,
                            "comm/bytes_moved": moved, "comm/bytes_pushed": pushed}, step)

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
    """What every epoch of a ``fit`` shares: the strategy, the optimizer, the data, the configuration (its seed
    rank 0's in a job)."""

    def __init__(self, strategy, optimizer, dataset, config, seed, steps, on_step=None):
        self.strategy, self.optimizer, self.dataset, self.config = strategy, optimizer, dataset, config
        self.on_step = on_step
        self.accumulate, self.batch_size, self.checkpoint_every = config.accumulate, config.batch_size, \
            config.checkpoint_every
        self.seed = seed
        self.per_epoch = num_batches(len(dataset.train_labels), self.batch_size)
        self.trace_path, self.steps_run, self.tracing = config.trace, 0, None
        self.trace_first = trace_first(steps)   # this run's ``steps``: a short run traces what it has
        self.board = None   # rank 0's TensorBoard writer (config.logdir), opened by fit

    def checkpoint_due(self, epoch, batch):
        """Whether ``checkpoint_every`` asks for a checkpoint after ``batch`` of ``epoch``: after every
        ``checkpoint_every``-th optimizer step counted from the run's first (so a resumed run writes them where
        the uninterrupted one does), but not after an epoch's last batch, where the epoch's own is written."""
        step = (epoch - 1) * self.per_epoch + batch
        return bool(self.checkpoint_every) and batch < self.per_epoch and step % self.checkpoint_every == 0

    def step(self, X, y):
        self.steps_run += 1
        if self.trace_path is not None and self.steps_run == self.trace_first:
            job = self.strategy.job
            self.tracing = trace(worker_path(self.trace_path, job), None if job is None else job.rank,
                                 self.strategy.ctx_list).__enter__()
        job, optimizer, board = self.strategy.job, self.optimizer, self.board
        if board is not None:   # the step's bytes, for the board alone
            moved, pushed = copied_bytes(), None if job is None else job.pushed
        optimizer.grad_norm = None
        out = self.strategy.train_step(X, y, optimizer=optimizer, accumulate=min(self.accumulate, X.shape[0]))
        if self.tracing is not None and self.steps_run == self.trace_first + TRACE_STEPS - 1:
            self.end_trace()
        if board is None:
            return (*out, None)
        n, t = X.shape[0], optimizer.num_update   # the step's loss sums this worker's share of the n examples
        return (*out, (t, optimizer.lr_at(t), optimizer.grad_norm, n, n / (1 if job is None else job.num_workers),
                       copied_bytes() - moved, None if job is None else job.pushed - pushed))

    def end_trace(self):
        """Write the trace being recorded, if any (after its last step, or when the run ends sooner)."""
        if self.tracing is not None:
            tracing, self.tracing = self.tracing, None
            tracing.__exit__(None, None, None)

    def check_parameters(self, epoch, batch):
        """Raise ``NonFiniteLossError`` unless the parameters are finite after ``batch`` of ``epoch``."""
        if not finite_parameters(self.strategy):
            raise NonFiniteLossError.parameters(epoch, batch, self.optimizer.changed())

    def checkpoint(self, on_checkpoint, state):
        """Hand ``on_checkpoint`` a ``Snapshot``: the position, the model's arrays, the optimizer's whole state and
        every worker's error feedback, read after the queued steps (in a job, every worker takes part; rank 0
        gets the arrays). A sharded strategy's (ZeRO-3) arrays are ``LazyArrays``, gathered one at a time as the
        checkpoint is written (a worker that does not write reads them too: ``parallel.checkpoint.read_all``)."""
        if on_checkpoint is not None:
            strategy = self.strategy
            if state.batch:   # within an epoch (an epoch's end was checked as it ended)
                self.check_parameters(state.epoch, state.batch)
            feedback = _gather_feedback(strategy)
            on_checkpoint(Snapshot(state, strategy.lazy_params(), strategy.aux(), strategy.gather_state(self.optimizer),
                                   feedback))


def _train_epoch(run, epoch, state, stop, on_checkpoint, history):
    """Train one epoch from ``state`` (its first batch, or where a checkpoint left it); return the totals, or
    raise ``TrainingStopped`` after writing the checkpoint when ``stop()`` asks."""
    dataset, batch_size, seed = run.dataset, run.batch_size, run.seed
    per_epoch = num_batches(len(dataset.train_labels), batch_size)
    resumed = epoch == state.epoch
    skip = state.batch if resumed else 0
    queued = _Epoch(epoch, per_epoch, skip, [state.loss_sum, state.correct, state.seconds] if resumed else [0.0] * 3,
                    run.config.progress, run.optimizer.changed(), run.board)
    batches = iterate_batches(dataset.train_images, dataset.train_labels, batch_size, shuffle=True,
                              seed=epoch_seed(seed, epoch), start=skip)
    for b, (X, y) in enumerate(batches, start=skip + 1):
        if stop is not None and stop():
            here = TrainingState(epoch, b - 1, *queued.finish(), epoch_seed(seed, epoch), history)
            run.checkpoint(on_checkpoint, here)
            raise TrainingStopped(here)
        run.strategy.count_activations(b == per_epoch)
        queued.queue(b, *run.step(X, y))
        if run.on_step is not None:
            run.on_step(epoch, b)
        if run.checkpoint_due(epoch, b):
            totals = queued.drain()
            if run.strategy.job is not None:   # the job's sums so far: a resumed epoch's metrics stay whole
                totals[:2] = sum_values(run.strategy.job, totals[:2])
            run.checkpoint(on_checkpoint, TrainingState(epoch, b, *totals, epoch_seed(seed, epoch), list(history)))
    return queued.finish()


def check_start(state, seed, per_epoch):
    """Raise ``BadValue``/``BadType`` (naming ``resume``) unless ``state`` is a position this run can continue
    from."""
    if not isinstance(state, TrainingState):
        raise BadType("resume", f"{{resume}}.state must be a TrainingState (a checkpoint's state), got "
                                f"{type(state).__name__}")
    if state.epoch < 1 or not 0 <= state.batch < per_epoch:
        raise BadValue("resume", f"{{resume}} points at epoch {state.epoch}, batch {state.batch}, but an epoch here "
                                 f"has {per_epoch} batches; the checkpoint belongs to another batch size or dataset")
    if len(state.history) != state.epoch - 1:
        raise BadValue("resume", f"{{resume}} is in epoch {state.epoch} but holds {len(state.history)} finished "
                                 "epochs")
    if state.shuffle_seed != epoch_seed(seed, state.epoch):
        raise BadValue("resume", f"{{resume}} orders epoch {state.epoch} with seed {state.shuffle_seed}, but "
                                 f"{{seed={seed}}} gives {epoch_seed(seed, state.epoch)}: the data order would change")


def _shared_start(job, state, seed, per_epoch):
    """In a job, rank 0's seed (the data order) and start (a checkpoint it read), for every worker; the other
    workers' sums of a started epoch start at zero. Returns ``(state, seed)``."""
    if job is None:
        return state, seed
    shared = broadcast_object(job, {"seed": seed, "start": state._asdict()})
    seed, state = shared["seed"], TrainingState(**shared["start"])
    check_start(state, seed, per_epoch)
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
            "test_acc": test_acc, "seconds": totals[2], "images_per_second": n_train / totals[2],
            "workers": 1 if strategy.job is None else strategy.job.num_workers}


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
        strategy.load_state(optimizer, optimizer_state)


def _feedback_state(strategy):
    """This worker's error-feedback state of every group of ``strategy`` whose reducer keeps it (a codec's
    residuals), each group's under ``"g<group>/"`` when there are several; ``{}`` without compression."""
    groups = strategy.feedback_groups()
    local = {}
    for g, group in enumerate(groups):
        prefix = f"g{g}/" if len(groups) > 1 else ""
        local.update({prefix + name: value for name, value in strategy.reducer.state(group).items()})
    return local


def _gather_feedback(strategy):
    """Every worker's error-feedback state under ``"w<rank>/"`` names (``parallel.compress.feedback``), on rank
    0 (``{}`` elsewhere, and without compression). In a job, a collective call."""
    if not strategy.feedback_groups():
        return {}
    local = _feedback_state(strategy)
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
    groups = strategy.feedback_groups()
    if not groups:
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
                        len(groups[0]), len(groups))
    if note is not None:
        warnings.warn(note, stacklevel=3)
    for g, group in enumerate(groups):
        prefix = f"g{g}/" if len(groups) > 1 else ""
        strategy.reducer.load_state({name[len(prefix):]: value for name, value in local.items()
                                     if name.startswith(prefix)}, group)


def _run_settings(config, strategy, optimizer, dataset):
    """The run's configuration as ``{setting: value}``: the layout, the contexts, the optimizer, the data and the
    ``RunConfig``'s fields (what ``config_table`` writes as the board's text)."""
    job = strategy.job
    rows = {"strategy": strategy.name, "layout": strategy.describe(config.accumulate),
            "contexts": ", ".join(str(ctx) for ctx in strategy.ctx_list),
            "workers": 1 if job is None else job.num_workers, "optimizer": optimizer.describe(),
            "train examples": len(dataset.train_labels), "test examples": len(dataset.test_labels)}
    rows.update((field.name, getattr(config, field.name)) for field in dataclasses.fields(config))
    return rows


def _open_board(run):
    """``config.logdir``: every worker's steps record their gradient norm (with ZeRO-3 in a job its shards' norms
    are a collective), and rank 0 opens the TensorBoard writer (``parallel.board.Board``) with the run's
    configuration as text."""
    config, strategy = run.config, run.strategy
    if config.logdir is None:
        return
    run.optimizer.record_norm = True
    if strategy.job is None or strategy.job.rank == 0:   # one writer in a job, as Horovod's and torchrun's users expect
        run.board = Board(config.logdir)
        run.board.text("config", config_table(_run_settings(config, strategy, run.optimizer, run.dataset)))


def _close_board(run, recorded):
    """Close the TensorBoard writer, if any (it flushes), and give the optimizer back its ``record_norm``."""
    run.optimizer.record_norm, run.optimizer.grad_norm = recorded, None
    if run.board is not None:
        board, run.board = run.board, None
        board.close()


def _check_strategy(strategy, optimizer):
    """A built strategy (``make_strategy``), and ZeRO-3 on both the optimizer and the layout or neither."""
    if not isinstance(strategy, Strategy):
        raise BadType("strategy", f"{{strategy}} must be a built strategy (parallel.make_strategy, DataParallel, "
                                  f"Hybrid and its presets), got {strategy!r}")
    if (optimizer.zero == 3) != (strategy.layout.zero == 3):
        raise BadValue("zero", f"the optimizer's zero={optimizer.zero} but the strategy's layout has zero="
                               f"{strategy.layout.zero}: ZeRO-3 shards the parameters the strategy lays out, so give "
                               "make_strategy and the optimizer the same {zero}")


def fit(dataset, strategy, optimizer, config, on_epoch=None, on_checkpoint=None, stop=None, resume=None,
        on_step=None):
    """Train the model ``strategy`` holds on ``dataset`` for ``config.epochs`` epochs.

    Parameters
    ----------
    dataset : parallel.data.Dataset
        Train and test images (n, 28, 28) uint8 and labels.
    strategy : object
        A built strategy (``parallel.make_strategy``: data, model, pipeline or hybrid parallelism, its model, its
        contexts and its ``Reducer``, with the job in a distributed run). Its parameters are trained in place.
    optimizer : parallel.optim.Optimizer or float
        SGD with momentum, Adam or AdamW with a schedule, clipping and ``zero`` sharding (data and hybrid
        strategies), or a float: plain SGD at that learning rate. Its step count is set from the start position:
        one step per batch.
    config : parallel.config.RunConfig
        Epochs, the global batch, the seed that orders the examples, micro-batches per batch (``accumulate``; a
        batch with fewer examples runs one per example), ``checkpoint_every``, ``trace``, ``progress``, and
        ``logdir``: TensorBoard's event files (``parallel.board``: each step's loss, learning rate, gradient norm,
        examples a second and bytes moved, read where the loss is read, so no step waits for them; each epoch's
        metrics and memory; the configuration), written by rank 0 alone in a job, closed when ``fit`` returns or
        raises.
    on_epoch : callable, optional
        Called with each epoch's metrics dict and the history so far, after the epoch.
    on_checkpoint : callable, optional
        ``on_checkpoint(snapshot)`` with a ``parallel.checkpoint.Snapshot``: the position (``TrainingState``), the
        model's trainable live arrays and its others (the strategy's ``params()`` and ``aux()``), the optimizer's
        whole state (``parallel.optim.gather_state``: ``{}`` for plain SGD), and every worker's error feedback
        (``parallel.compress.feedback``; ``{}`` without compression, and on the workers but rank 0 of a job,
        which all take part in gathering it): after every epoch (the state then points at the next epoch's first
        batch), after every ``config.checkpoint_every`` optimizer steps (counted from the first step of the run,
        so a resumed run checkpoints where the uninterrupted one does; not after an epoch's last batch, whose
        checkpoint is the epoch's), and when ``stop`` stops the run. Not called when the loss becomes NaN.
    stop : callable, optional
        ``stop()`` is asked before each batch; when it returns True the queued steps are finished,
        ``on_checkpoint`` is called and ``TrainingStopped`` is raised: the run stops at a batch boundary.
    on_step : callable, optional
        ``on_step(epoch, batch)`` after each step is queued, before it has run (it does not wait for the devices):
        the arrays and buffers the step uses are allocated by then (what ``parallel.report`` measures after the
        run's first step).
    resume : parallel.checkpoint.Snapshot or Checkpoint, optional
        Where to continue: a snapshot ``on_checkpoint`` got, or a loaded checkpoint (its ``state``, its
        ``optimizer_state``, its ``compression_state``; the strategy must have been built from its ``params``
        and ``aux``). On the layout that saved it the run ends bitwise equal to a run never interrupted; in a job,
        rank 0's is given to every worker. Error feedback on another layout: the residuals' sum goes to rank 0's
        first context (``parallel.compress.feedback.place``), so nothing is lost.

    In a distributed job (a strategy built with a ``Reducer`` whose ``job`` is set) every worker calls ``fit``
    with the same dataset and arguments; the parameters, the seed and ``resume`` are rank 0's. Each worker trains
    its slice of every global batch (``config.batch_size`` stays the global batch), and the loss and accuracies
    are summed over the workers, so every worker returns the same history but for ``seconds``. Let ``on_epoch``
    and ``on_checkpoint`` act on rank 0 alone when one copy of what they write is wanted.

    Returns
    -------
    (list of dict, object)
        One dict per epoch with ``epoch``, ``train_loss``, ``train_acc``, ``test_acc``, ``seconds``,
        ``images_per_second`` (a resumed run's history includes the checkpoint's epochs); and the strategy's
        ``model``: for data parallelism the replicas (``device_params``), else the strategy. The host queues at
        most ``IN_FLIGHT`` steps ahead of the devices, then reads the oldest step's loss.

    Raises
    ------
    NonFiniteLossError
        When the loss becomes NaN or infinite, naming the epoch and the batch, or the parameters do (checked at
        each epoch's end and before each checkpoint within an epoch).
    TrainingStopped
        When ``stop()`` returned True.
    ValueError, TypeError
        For an argument out of range (checked before any training), naming it.
    """
    if not isinstance(config, RunConfig):
        raise BadType("config", f"{{config}} must be a parallel.RunConfig, got {config!r}")
    optimizer = as_optimizer(None, optimizer) if not isinstance(optimizer, numbers.Real) or \
        isinstance(optimizer, bool) else as_optimizer(optimizer, None)
    _check_strategy(strategy, optimizer)
    if resume is not None and not isinstance(resume, (Snapshot, Checkpoint)):
        raise BadType("resume", f"{{resume}} must be a parallel.checkpoint.Snapshot (on_checkpoint's) or a loaded "
                                f"Checkpoint, got {type(resume).__name__}")
    config.check_fits(len(dataset.train_labels))
    per_epoch = num_batches(len(dataset.train_labels), config.batch_size)
    state = TrainingState(1, 0, 0.0, 0.0, 0.0, epoch_seed(config.seed, 1), []) if resume is None else resume.state
    check_start(state, config.seed, per_epoch)
    state, seed = _shared_start(strategy.job, state, config.seed, per_epoch)
    _shared_optimizer_state(strategy.job, optimizer, strategy, None if resume is None else resume.optimizer_state)
    _shared_feedback(strategy, None if resume is None else resume.compression_state)
    optimizer.num_update = (state.epoch - 1) * per_epoch + state.batch   # one optimizer step per batch
    strategy.reducer.steps = optimizer.num_update   # a compression's warm-up resumes where it was
    steps = max(0, (config.epochs - state.epoch + 1) * per_epoch - state.batch)
    run = _Run(strategy, optimizer, dataset, config, seed, steps, on_step)
    history = list(state.history)
    recorded = optimizer.record_norm
    counting = strategy.count_activations(False)   # each epoch's last step only: what its memory table reads
    try:
        _open_board(run)
        for epoch in range(state.epoch, config.epochs + 1):
            totals = _train_epoch(run, epoch, state, stop, on_checkpoint, history)
            run.check_parameters(epoch, per_epoch)
            metrics = _epoch_metrics(strategy, dataset, epoch, totals, config.batch_size)
            metrics.update(strategy.epoch_metrics())   # what the strategy measured while it trained (its experts)
            history.append(metrics)
            if run.board is not None:
                run.board.epoch(metrics, memory_of(strategy, optimizer))
            if on_epoch is not None:
                on_epoch(metrics, history)
            run.checkpoint(on_checkpoint, TrainingState(epoch + 1, 0, 0.0, 0.0, 0.0, epoch_seed(seed, epoch + 1),
                                                        list(history)))
    finally:
        run.end_trace()   # a run shorter than the traced steps still writes what it recorded
        _close_board(run, recorded)   # also on an error, a stop or Ctrl-C: what was written stays readable
        strategy.count_activations(counting)
    return history, strategy.model
