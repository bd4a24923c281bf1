"""Data parallelism: one replica of the model per context, the batch split across them, the gradients summed.

``DataParallel`` is a wrapper in the style of PyTorch's ``nn.DataParallel`` (scatter, replicate, parallel apply,
gather) for a model the package cannot lay out itself: any function of (inputs, params), or a gluon Block whose
parameters it moves in place. It has no step of its own: ``train_step`` is ``parallel.step.train_step`` (the
textbook's step, the one every strategy takes) and ``step``/``update`` the package's one update
(``parallel.optim.optimizer_step``). ``make_strategy`` (the training loop, ``python -m parallel.train``) lays every
layout out with the composed strategy, ``Hybrid``, the data preset included. ``DataParallel(module, ctx_list)`` wraps a
gluon Block, or a function of (inputs, params) with ``params=[...]``. Calling it splits the batch across the
contexts (``split_and_load``: shards differ by at most one example), runs one replica per shard, and concatenates
the outputs on ``ctx_list[0]``:

>>> import mxnet as mx
>>> from mxnet import autograd, gluon
>>> from parallel.strategies import DataParallel
>>> net = gluon.nn.Dense(2, in_units=5)
>>> net.initialize()
>>> model = DataParallel(net, [mx.cpu(0), mx.cpu(1)])   # net's parameters now live on both contexts
>>> X, Y = mx.nd.random.normal(shape=(30, 5)), mx.nd.random.normal(shape=(30, 2))
>>> with autograd.record():
...     out = model(X)                                   # X (30, 5) -> shards (15, 5) -> output (30, 2)
...     loss = ((out - Y) ** 2).sum()
>>> loss.backward()                                      # each context gets its own shard's gradient
>>> model.step(lr=0.1, batch_size=30)                    # allreduce_grads() then update(): sum, then SGD
>>> out.shape, out.context
((30, 2), cpu(0))

Unlike PyTorch, which copies the module to every device on every call, the replicas persist between
calls (gluon Parameters live on several contexts; a function's ``params`` are copied once with
``get_params``), so after ``backward`` each context holds the gradient of its own shard and
``allreduce_grads`` sums them, as gluon's ``Trainer.allreduce_grads`` does: afterwards the primary
(``ctx_list[0]``) and every replica hold the sum. ``gluon.Trainer(net.collect_params(), ...).step`` sums
the contexts' gradients itself: use it *instead of* ``step``/``allreduce_grads``, never both.
"""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon.parameter import DeferredInitializationError

from ..comm.reducer import as_reducer
from ..comm.replica import aux_of, get_params
from ..evaluate import evaluate_accuracy
from ..job import broadcast_aux, broadcast_params
from ..layout import Layout
from ..models.gluon import GluonNet
from ..models.recompute import Recompute
from ..optim.zero import ReplicatedStore
from ..split import split_and_load
from ..optim.optimizers import SGD
from ..optim.zero import optimizer_step, update_groups
from ..step import may_skip_parameters, train_step, zero_grads
from ..validate import check_contexts
from .base import ArrayPlace, Strategy

__all__ = ["DataParallel", "data_parallel", "replicate", "parallel_apply", "gather", "describe_replicas",
           "batchnorm_across"]


def replicate(params, ctx_list, bucket_mb=None):
    """One copy of ``params`` per context (``get_params``): the replicas of a function's parameters.

    Returns
    -------
    list of list of NDArray
        ``device_params[i]`` on ``ctx_list[i]``, gradients attached (in buckets of at most ``bucket_mb`` MiB; None:
        one buffer); ``params`` is not modified.
    """
    check_contexts(ctx_list)
    return [get_params(params, ctx, bucket_mb) for ctx in ctx_list]


def parallel_apply(module, X_shards, device_params=None):
    """Run the replica ``i`` on shard ``i``.

    Parameters
    ----------
    module : gluon.Block or callable
        A Block (its parameters must live on every shard's context: it reads ``param.data(X.context)``)
        or a function ``module(X, params)``.
    X_shards : list of NDArray
        Shard ``i`` on context ``i``.
    device_params : list of list of NDArray, optional
        For a function: ``device_params[i]`` is the replica on shard ``i``'s context.

    Returns
    -------
    list
        One output per shard, on the shard's context. MXNet queues each context's work on its own
        worker, so the replicas compute concurrently though this loop is sequential.
    """
    if isinstance(module, gluon.Block):
        return [module(X_shard) for X_shard in X_shards]
    return [module(X_shard, params) for X_shard, params in zip(X_shards, device_params)]


def gather(outputs, ctx):
    """Concatenate the replicas' outputs along the first axis on ``ctx``.

    Parameters
    ----------
    outputs : list of NDArray, or list of tuples of NDArray
        One output per replica; tuples (several outputs per replica) are gathered element by element.
    ctx : mxnet.Context

    Returns
    -------
    NDArray or tuple of NDArray
        On ``ctx``. Inside ``autograd.record()`` the copies are recorded: the gradient of the gathered
        output flows back to each replica's context.
    """
    first = outputs[0]
    if isinstance(first, (list, tuple)):
        return type(first)(gather(list(parts), ctx) for parts in zip(*outputs))
    if len(outputs) == 1:
        return first.as_in_context(ctx)
    return mx.nd.concat(*[out.as_in_context(ctx) for out in outputs], dim=0)


def _block_params(block):
    return [param for param in block.collect_params().values() if param.grad_req != "null"]


def _place_block(block, ctx_list):
    """Put every parameter of ``block`` on every context of ``ctx_list`` (in place, values kept)."""
    for param in block.collect_params().values():
        try:
            placed = param.list_ctx()
        except RuntimeError:
            raise ValueError(f"parameter {param.name!r} of the block is not initialized; call "
                             "block.initialize() before wrapping the block in DataParallel") from None
        if placed != list(ctx_list):
            param.reset_ctx(ctx_list)


def data_parallel(module, X, ctx_list, device_params=None, output_ctx=None):
    """The functional twin of ``DataParallel``: scatter ``X``, apply the replicas, gather the outputs.

    Parameters
    ----------
    module : gluon.Block or callable
        A Block whose parameters already live on every context of ``ctx_list``, or a function
        ``module(X, params)``.
    X : NDArray
        A batch; any batch size >= 1 (a batch smaller than ``len(ctx_list)`` uses that many contexts).
    ctx_list : list of mxnet.Context
    device_params : list of list of NDArray, optional
        For a function: one replica per context (``replicate(params, ctx_list)``).
    output_ctx : mxnet.Context, optional
        Where the outputs are gathered; default ``ctx_list[0]``.

    Returns
    -------
    NDArray (or tuple of NDArray)
        The outputs of the whole batch, in order, on ``output_ctx``; equal to running ``module`` on one
        context. Nothing waits for the devices.
    """
    check_contexts(ctx_list)
    if not isinstance(module, gluon.Block):
        if not callable(module):
            raise TypeError(f"module must be a gluon Block or a function of (inputs, params), got {module!r}")
        if device_params is None or len(device_params) != len(ctx_list):
            got = "none" if device_params is None else len(device_params)
            raise ValueError(f"a function needs one parameter replica per context: {len(ctx_list)} contexts "
                             f"but {got} replicas; pass device_params=replicate(params, ctx_list)")
    X_shards = split_and_load(X, ctx_list)
    outputs = parallel_apply(module, X_shards, device_params)
    return gather(outputs, ctx_list[0] if output_ctx is None else output_ctx)


def describe_replicas(reducer, num_contexts, accumulate=1, batchnorm=None, recomputed=None, statistics=False):
    """The line of a layout of data replicas alone, whoever runs it (``DataParallel``, or the composed strategy of
    the data preset): how the ``num_contexts`` replicas are summed (``reducer``, and its job's workers), what
    BatchNorm normalises over when each batch runs as ``accumulate`` micro-batches (``batchnorm``: None without
    BatchNorm, else whether its statistics are synchronized over the contexts), how many blocks are recomputed
    (``recomputed``, None: none), and whether the model has running ``statistics`` (in a job: ``batchnorm_across``)."""
    summed = reducer.describe(num_contexts)
    line = "one replica per context" + (f", {summed}" if summed else "")
    if batchnorm is not None and (num_contexts > 1 or accumulate > 1):
        over = "the whole batch" if accumulate == 1 else f"each of the {accumulate} micro-batches alone"
        line += (f", BatchNorm over {over}" if batchnorm or num_contexts == 1 else
                 ", BatchNorm per context" + ("" if accumulate == 1 else " and micro-batch"))
    if recomputed is not None:
        line += f", activations recomputed in backward ({recomputed} blocks)"
    job = reducer.job
    if job is not None:
        line += f", then over {job.num_workers} worker(s) through {job.describe()}"
        if reducer.codec is not None:
            line += f" as {reducer.codec.spec} payloads"
        if statistics:
            line += f" ({batchnorm_across(job)})"
    return line


def batchnorm_across(job):
    """What BatchNorm normalises over in a step of ``job``, in words for a run's header (``job.statistics``)."""
    if job.statistics == "job":
        return ("BatchNorm over every worker's slice of the batch: each BatchNorm's statistics gathered through the "
                "job, one sum forward and one backward")
    return "BatchNorm statistics per worker: each over its own slice (--batchnorm-stats worker), not one model"


class _BlockFunction:
    """A gluon Block as a function ``net(X, params)`` that ignores ``params``: the Block reads its own
    parameters on ``X``'s context."""

    def __init__(self, block):
        self.block = block

    def __call__(self, X, params):
        return self.block(X)


class DataParallel(Strategy):
    """Run ``module`` data-parallel over ``ctx_list``: the data strategy, and PyTorch's ``nn.DataParallel`` for
    MXNet contexts.

    Parameters
    ----------
    module : callable or gluon.Block
        A function ``module(X, params)`` of a replica's arrays (``lenet_cached``, or a ``GluonNet`` for a gluon
        network on flat replicas, as the training loop uses), given its initial ``params``. Or a gluon Block,
        initialized on any context: its parameters are moved, in place, to every context of ``ctx_list``
        (``Parameter.reset_ctx``; values kept), and it normalises BatchNorm per context, as gluon does.
    ctx_list : list of mxnet.Context
        Distinct contexts; ``ctx_list[0]`` holds the primary copy and receives the outputs.
    params : list of NDArray or gluon.Block, optional
        Required for a function, refused for a Block: its initial parameters (LeNet's arrays, or a gluon block
        whose arrays ``get_params`` copies into flat replicas), copied to every context; not modified.
    reducer : parallel.Reducer or str, optional
        How the gradients are summed (``parallel.comm.Reducer``; an algorithm's name for ``Reducer(name)``, the
        default ``Reducer()``): its algorithm, its buckets (a function's replicas are laid out in them, so that a
        bucket's sum starts while backward computes the earlier layers), its compression, and its ``job``: with
        a job, train as one worker of a distributed job (a function module only): every worker's replicas get
        rank 0's parameters and running statistics (a collective call: every worker must make it), each step
        trains this worker's slice of the global batch and sums the gradients over the workers, evaluation
        combines the workers' counts. BatchNorm normalises over the whole global batch, every worker's slice
        (``parallel.comm.statistics``; per worker when ``job.statistics == "worker"``).
        A gluon Block's gradients, an array a parameter, are summed in the reducer's buckets too (packed into flat
        buffers it keeps: ``Reducer.reduce_arrays``), through its hook or codec, in one process.

    Attributes
    ----------
    module, ctx_list, reducer
    job : parallel.job.Job or None
        The reducer's job.
    name : str
        ``"data"``.
    device_params : list of list of NDArray
        For a function: the replica on each context, ``device_params[0]`` the primary. For a Block: each
        context's ``param.data(ctx)`` (parameters with ``grad_req='null'`` left out), in
        ``collect_params()`` order; ``param.data(ctx).grad`` is ``param.grad(ctx)``.
    """

    name = "data"

    def __init__(self, module, ctx_list, params=None, reducer=None):
        self.ctx_list = check_contexts(ctx_list)
        self.module, self.reducer = module, as_reducer(reducer)
        codec = self.reducer.codec
        self.layout = Layout("data", recompute=isinstance(module, Recompute),
                             compression="none" if codec is None else codec.spec)
        self._store = None
        if isinstance(module, gluon.Block):
            if params is not None:
                raise TypeError("params= is for a function of (inputs, params); a gluon Block holds its own "
                                "parameters: drop params=")
            if self.job is not None:
                raise TypeError("a reducer with a job takes a function of (inputs, params) on flat replicas, not a "
                                "gluon Block; pass GluonNet(block) with params=block")
            _place_block(module, self.ctx_list)
            self._net = _BlockFunction(module)
        elif callable(module):
            if params is None:
                raise TypeError(f"module {getattr(module, '__name__', module)!r} is a function: pass its "
                                "parameters with params=[...] (e.g. init_lenet_params())")
            self._device_params = self.reducer.replicate(params, self.ctx_list)
            self._net = module
            if self.job is not None:
                broadcast_params(self.job, self._device_params)
                broadcast_aux(self.job, self._device_params)
        else:
            raise TypeError(f"module must be a gluon Block or a function of (inputs, params), got {module!r}")

    def __repr__(self):
        return f"DataParallel({self.describe()})"

    @property
    def device_params(self):
        if isinstance(self.module, gluon.Block):
            params = _block_params(self.module)
            return [[param.data(ctx) for param in params] for ctx in self.ctx_list]
        return self._device_params

    @property
    def model(self):
        """What the training loop returns for data parallelism: ``device_params``, one replica per context."""
        return self.device_params

    def describe(self, accumulate=1):
        """One line: how the replicas are kept and summed, and what BatchNorm normalises over when each batch
        runs as ``accumulate`` micro-batches (each on its own statistics): ``describe_replicas``."""
        net = self._net.full if isinstance(self._net, Recompute) else self._net
        batchnorm = net.sync_batchnorm if isinstance(net, GluonNet) and net.has_batchnorm else None
        recomputed = len(self._net.segments) if isinstance(self._net, Recompute) else None
        return describe_replicas(self.reducer, len(self.ctx_list), accumulate, batchnorm, recomputed,
                                 bool(self.aux()))

    def places(self):
        """Every trained array lies whole on every replica (``ReplicatedStore``): the primary's, live."""
        if self._store is None or isinstance(self.module, gluon.Block):
            self._store = ReplicatedStore(self.device_params)
        return [ArrayPlace([self._store], j) for j in range(len(self._store.group[0]))]

    def aux(self):
        """The primary replica's arrays that are not trained (BatchNorm's running statistics), live; ``[]``
        when there are none (LeNet, or a Block, whose own Parameters hold them)."""
        return aux_of(self.device_params[0])

    def __call__(self, X):
        return self.forward(X)

    def forward(self, X):
        """Scatter ``X``, run the replicas, gather the outputs on ``ctx_list[0]`` (see ``data_parallel``).

        A batch smaller than ``len(ctx_list)`` leaves contexts without a shard: their gradients are
        zeroed here, in place, so that a later reduction (``allreduce_grads`` or gluon's ``Trainer``)
        adds nothing stale from them. Under ``autograd.record()`` with a module that may leave a parameter out
        of a step (a gluon Block run imperatively, a function other than a cached graph:
        ``parallel.step.may_skip_parameters``), every gradient is zeroed first: a parameter the step did not use
        gets a zero gradient on every context, not the one of the last step that used it.
        """
        # a batch split_and_load takes (anything else, it refuses below, naming the type)
        n = X.shape[0] if isinstance(X, (mx.nd.NDArray, np.ndarray)) and X.ndim else len(self.ctx_list)
        if autograd.is_recording() and may_skip_parameters(self._net) and not self._accumulating():
            try:   # a parameter this forward does not reach must not keep its last gradient
                groups = self.groups()
            except DeferredInitializationError:
                groups = []
            with autograd.pause():
                zero_grads(groups)
        elif n < len(self.ctx_list):
            try:
                idle = self.device_params[n:]
            except DeferredInitializationError:   # shapes not known yet: no gradient exists to go stale
                idle = []
            with autograd.pause():
                for params in idle:
                    for param in params:
                        param.grad[:] = 0
        device_params = None if isinstance(self.module, gluon.Block) else self._device_params
        return data_parallel(self.module, X, self.ctx_list, device_params)

    def _accumulating(self):
        """Whether a Block's gradients add up over backward passes (``grad_req='add'``): then they are the user's."""
        return isinstance(self.module, gluon.Block) and any(p.grad_req == "add" for p in _block_params(self.module))

    def allreduce_grads(self):
        """Sum the gradients of all replicas, in place: the primary and every replica hold the sum.

        Call after ``backward()`` and before an update of your own (or use ``step``). Contexts that got
        no shard in the last ``forward`` (a batch smaller than ``len(ctx_list)``) contribute zero.
        """
        self.reducer.reduce(self.device_params)

    def update(self, lr, batch_size):
        """SGD on every replica, in place: ``param -= lr * param.grad / batch_size``, through the package's one
        update (``parallel.optim.zero.update_groups``, as ``train_step``'s)."""
        update_groups(SGD(lr), self.groups(), batch_size, self.reducer)

    def step(self, lr, batch_size):
        """``allreduce_grads()`` then ``update(lr, batch_size)``: one synchronous SGD step on every replica
        (``parallel.optim.optimizer_step``, as ``train_step``'s).

        ``batch_size`` is the global batch: the summed gradient is divided by it, as in ``train_batch``.
        """
        optimizer_step(SGD(lr), self.groups(), batch_size, self.reducer)

    def train_step(self, X, y, lr=None, loss=None, optimizer=None, accumulate=1):
        """One whole step on the batch: ``parallel.train_step`` over the replicas (forward, backward, allreduce,
        update), plain SGD at ``lr`` or ``optimizer``'s update (``zero`` shards its state over the contexts), with
        ``accumulate`` micro-batches; returns (summed loss, correct count), each (1,) on ``ctx_list[0]``, not
        waited for."""
        kwargs = {} if loss is None else {"loss": loss}
        return train_step(X, y, self.device_params, self.ctx_list, lr, net=self._net, reducer=self.reducer,
                          optimizer=optimizer, accumulate=accumulate, **kwargs)

    def groups(self):
        """The replicas as ``parallel.optim.optimizer_step`` takes them: one group of one replica per context."""
        return [self.device_params]

    def evaluate(self, data_iter):
        """Accuracy over ``data_iter``, each batch split across the replicas (see ``evaluate_accuracy``)."""
        return evaluate_accuracy(data_iter, self.device_params, self.ctx_list, net=self._net, job=self.job)
