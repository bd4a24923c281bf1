"""The one training step every strategy takes: split, forward/backward per replica, sum, update.

``step_replicas(replicas, X, y, optimizer=...)`` is the step itself, written once: split the batch over the
replicas, run each replica's forward (recorded) and loss, check the labels, run one backward, give replicas that got
no example the first one's running statistics, then take one optimizer step everywhere
(``parallel.optim.optimizer_step``: sum the gradients, clip, update, all-gather). With ``accumulate=N`` the batch
is run as N micro-batches one after another, their gradients summed in place, before the one optimizer step.
What a "replica" is differs between strategies, behind the members of ``Replicas``:

- ``in_ctx_list`` / ``out_ctx_list``: where each replica takes its shard of ``X`` and gives its outputs (the
  labels go there);
- ``forward_backward(X_shards, y_shards, loss)``: every shard's forward through its replica, its loss and the
  backward pass; by default ``forward_all(X_shards)`` (the outputs of every shard, in lockstep where BatchNorm is
  synchronized) recorded, then ``backward(losses)``; a pipeline issues its micro-batches in its schedule's order
  instead;
- ``aux(r)``: replica ``r``'s arrays that are not trained (BatchNorm's running statistics);
- ``groups()``: the trained arrays, as groups of replicas holding the same parameters on distinct contexts
  (replica ``r`` of each group belongs to replica ``r`` of the step); ``reducer``, the ``parallel.comm.Reducer``
  that sums a group (its algorithm, buckets, hook and job; None: the default, for groups of one);
- ``adds_gradients``: whether its backward runs more than once a step (micro-batches, ZeRO-3's blocks), so that the
  step zeroes the gradients first and adds into them; ``skips_parameters``: whether a step may leave a parameter's
  gradient unwritten (then it is zeroed first).

The reduction is queued right after ``backward()`` returns, before the gradients exist: MXNet's engine starts each
bucket's sum as soon as backward has written it, while it computes the earlier layers (``parallel.comm.reducer``).

Data parallelism (``train_step``, the textbook's ``train_batch``, and ``strategies.DataParallel``) has one
replica per context (one group of K); the composed strategy (``strategies.Hybrid``: data x pipeline stages x tensor
ranks, ZeRO-3, recomputation) one chain of stages of tensor groups per replica (a group per stage and rank).
"""
import contextlib

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from .comm.reducer import as_reducer
from .engine import fence
from .comm.replica import FlatReplica, aux_of, data_of, grads_of, is_split
from .comm.statistics import Gathers, across_workers, workers
from .job import worker_slice
from .models.gluon import GluonNet, as_net
from .models.lenet import CachedNet, lenet_cached, softmax_cross_entropy
from .models.recompute import Recompute, run_net
from .mxnet_compat import sparse_label
from .optim.optimizers import SGD
from .optim.zero import as_optimizer, optimizer_step, update_groups
from .split import shard_sizes, split_and_load
from .trace import backward_heads, issued
from .validate import check_contexts, check_int

__all__ = ["check_labels", "check_batch", "sgd", "update_replicas", "loss_and_correct", "step_replicas", "idle_step",
           "worker_step", "DeviceReplicas", "train_step", "train_batch", "may_skip_parameters", "zero_grads",
           "adding_gradients", "fence_statistics", "statistics_job"]


def check_labels(y, num_classes, loss=softmax_cross_entropy):
    """Raise ``ValueError`` unless every label in ``y`` is a class index 0 .. ``num_classes - 1``.

    Softmax cross-entropy with a label outside the classes does not fail: MXNet's ``pick`` clips it to the
    last class and training goes on, silently wrong. The check runs only where it costs nothing: for a
    ``SoftmaxCrossEntropyLoss`` with integer labels (another ``loss`` may take any targets), and for labels
    on the CPU, where batches come from (reading a batch of 256 labels takes microseconds). Labels already
    on a GPU are not read: that would make the host wait for the device.

    >>> check_labels(mx.nd.array([0, 3, 9]), 10)
    >>> check_labels(mx.nd.array([0, 10, 3]), 10)
    Traceback (most recent call last):
        ...
    ValueError: label y[1] = 10 is not one of the network's 10 classes; labels must be whole numbers 0..9
    """
    sparse = isinstance(loss, gluon.loss.SoftmaxCrossEntropyLoss) and sparse_label(loss)
    if not sparse or y.context.device_type != "cpu":
        return
    labels = y.asnumpy()
    bad = np.flatnonzero(~((labels >= 0) & (labels < num_classes) & (labels == np.floor(labels))))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"label y[{i}] = {labels[i]:g} is not one of the network's {num_classes} classes; "
                         f"labels must be whole numbers 0..{num_classes - 1}")


def sgd(params, lr, batch_size):
    """Minibatch SGD, in place: ``param -= lr * param.grad / batch_size`` for every param.

    ``param.grad`` holds the gradient *summed* over the batch (allreduce sums), hence the division by the
    global batch size.
    """
    for param in params:
        param[:] = param - lr * param.grad / batch_size


def _check_replicas(device_params, ctx_list):
    check_contexts(ctx_list)
    if len(device_params) != len(ctx_list):
        raise ValueError(f"device_params has {len(device_params)} replicas but ctx_list has "
                         f"{len(ctx_list)} contexts; make one replica per context with get_params")
    for i, (params, ctx) in enumerate(zip(device_params, ctx_list)):
        if isinstance(params, FlatReplica) and params.data.context == ctx:
            continue   # every array of a flat replica is a view into its buffer, on its buffer's context
        for j, param in enumerate(params):
            if param.context != ctx:
                raise ValueError(f"device_params[{i}][{j}] is on {param.context} but ctx_list[{i}] is "
                                 f"{ctx}; build device_params with get_params(params, ctx_list[i])")


def update_replicas(device_params, lr, batch_size):
    """SGD on every replica, in place: ``param -= lr * param.grad / batch_size``, through the package's one update
    (``parallel.optim.zero.update_groups`` with ``SGD(lr)``: one fused ``sgd_update`` per array, or per bucket of
    a ``FlatReplica``). The textbook's per-tensor ``sgd`` is the same step written out.

    Parameters
    ----------
    device_params : list of list of NDArray
        Replicas whose gradients hold the gradient summed over the global batch.
    lr : float
    batch_size : int
        The global batch size, which the summed gradient is divided by.
    """
    update_groups(SGD(lr), [device_params], batch_size)


def loss_and_correct(outputs, y_shards, losses, ctx, count_correct=True):
    """Summed loss and number of correct argmax predictions over the shards, each of shape (1,) on ``ctx``.

    Each shard's sums are computed on its own context and copied to ``ctx``; nothing waits for the devices.
    Labels already of the outputs' dtype are compared as they are, one shard's sums are not added again, and with
    ``count_correct=False`` the count is not computed (None): every operator pushed costs the host time that the
    devices share on a CPU.
    """
    # named metrics in a trace; its bracket closes on the sums alone (the backward pass reads the losses)
    with issued("metrics", lambda: list(losses) + (list(outputs) if count_correct else []),
                closes_on_made=True) as made:
        sums = [l.sum() for l in losses]
        loss_sums = [s.as_in_context(ctx) for s in sums]
        if count_correct:
            counts = [(out.argmax(axis=1) == y_shard.astype(out.dtype, copy=False)).sum()
                      for out, y_shard in zip(outputs, y_shards)]
            corrects = [s.as_in_context(ctx) for s in counts]
            sums += counts + corrects
        sums += loss_sums
        if not count_correct:
            result = (loss_sums[0] if len(losses) == 1 else mx.nd.add_n(*loss_sums)), None
        elif len(losses) == 1:
            result = loss_sums[0], corrects[0]
        else:
            result = mx.nd.add_n(*loss_sums), mx.nd.add_n(*corrects)
        made += sums + [value for value in result if value is not None]
    return result


def check_accumulate(accumulate, n):
    """``accumulate`` (an int >= 1) micro-batches of a batch of ``n`` examples: at most ``n``; returns it."""
    accumulate = check_int(accumulate, "accumulate", low=1)
    if accumulate > n:
        raise ValueError(f"accumulate={accumulate} cannot split a batch of {n} examples into micro-batches; "
                         f"use at most {n}")
    return accumulate


def check_batch(X, y):
    """Raise ``ValueError`` unless ``X`` and ``y`` hold the same number of examples, at least one."""
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} examples but y has {y.shape[0]}; give one label per example")
    if X.shape[0] < 1:
        raise ValueError("X is an empty batch (0 examples); give at least one example")


def _forward_backward(replicas, X, y, loss, y_all, count_correct=True, fence=True):
    """Forward and backward of one (micro-)batch over the replicas; returns (summed loss, correct, active).

    ``fence``: order the running statistics after this backward here (``fence_statistics``); False leaves it to the
    caller, who fences once the step's reductions are queued (a fence queued now would read every gradient bucket,
    and each bucket's reduction, which writes the bucket, would wait for the whole backward pass). A batch that
    leaves replicas idle fences here whatever ``fence`` says: their copy of the statistics needs it."""
    X_shards, y_shards = split_and_load(X, replicas.in_ctx_list), split_and_load(y, replicas.out_ctx_list)
    sums = []

    def count(outputs, y_parts, losses):   # queued before the backward pass, which it then does not hold back
        sums.extend(loss_and_correct(outputs, y_parts, losses, replicas.in_ctx_list[0], count_correct))

    outputs, y_parts, losses = replicas.forward_backward(X_shards, y_shards, loss, count)
    if y_all is not None:
        check_labels(y_all, outputs[0].shape[-1], loss)   # before anything is updated
    active = len(X_shards)
    if fence or active < len(replicas.in_ctx_list):
        fence_statistics(replicas)
    for r in range(active, len(replicas.in_ctx_list)):   # an idle replica takes the first one's statistics
        for first, aux in zip(replicas.aux(0), replicas.aux(r)):
            first.copyto(aux)
    if not sums:   # a strategy whose schedule counts after its backward passes
        count(outputs, y_parts, losses)
    return (*sums, active)


class Replicas:
    """What ``step_replicas`` steps (see the module's docstring), with its defaults: a subclass defines
    ``in_ctx_list``, ``out_ctx_list``, ``groups()`` and ``forward_all(X_shards)`` (or its own
    ``forward_backward``)."""

    #: The ``parallel.comm.Reducer`` that sums each group (None: the default).
    reducer = None
    #: Whether a step runs its backward more than once (the step then zeroes the gradients and adds into them).
    adds_gradients = False
    #: Whether a step may leave a parameter's gradient unwritten (the step then zeroes every gradient first).
    skips_parameters = False
    #: Whether every replica computes whenever one does (replicas in lockstep, which refuse a batch that would leave
    #: one idle): the step's sums then count every replica of every group, whatever the number of shards.
    computes_together = False

    def forward_all(self, X_shards):
        """The outputs of every shard, each on its replica's context."""
        raise NotImplementedError

    def backward(self, losses, head_grads=None):
        """The backward pass of the last ``forward_all``, from ``head_grads`` (None: ones)."""
        autograd.backward(losses, head_grads)

    def forward_backward(self, X_shards, y_shards, loss, counted=None):
        """Every shard's forward (recorded), loss and backward; returns ``(outputs, y_shards, losses)``, one each a
        shard (a pipeline's: one each a micro-batch). With no shard (a worker of a job without an example) a
        strategy still makes every collective of a step; nothing here to make. ``counted(outputs, y_shards,
        losses)``, if given, is called once the forward is queued, before the backward: what it queues (the step's
        metrics) runs before the backward pass on each context, not in the midst of its reductions (a strategy may
        leave it uncalled; the caller then calls it)."""
        if not X_shards:
            return [], [], []
        with autograd.record(), issued("forward", lambda: X_shards + _parameters(self.groups())) as made:   # each shard
            outputs = self.forward_all(X_shards)
            losses = [loss(out, y_shard) for out, y_shard in zip(outputs, y_shards)]
            made += list(outputs) + list(losses)   # a trace's forward ends with the losses (parallel.trace)
        if counted is not None:
            counted(outputs, y_shards, losses)
        # each replica computes the gradient of its own shard, from the ones a trace's mark writes (parallel.trace)
        self.backward(losses, backward_heads(losses))
        return outputs, y_shards, losses

    def aux(self, r):
        """Replica ``r``'s arrays that are not trained (BatchNorm's running statistics)."""
        return []

    def finish_backward(self):
        """What a strategy queues once a step's backward passes are all queued, before the reduction (sequence
        parallelism's sums over the tensor ranks): nothing by default."""

    def groups(self):
        """The trained arrays as groups of replicas of the same parameters (``optimizer_step``'s)."""
        raise NotImplementedError


def _parameters(groups):
    """The parameter arrays of ``groups``' replicas (a ``FlatReplica``'s flat buffer): what a forward reads, and so
    what a trace's forward bracket starts after (the update before it)."""
    arrays = []
    for group in groups:
        for replica in group:   # a split replica's forward reads its first layers' piece first (a cross barrier)
            arrays += replica.pieces[-1:] if is_split(replica) else data_of(replica)
    return [array for array in arrays if isinstance(array, mx.nd.NDArray)]


def may_skip_parameters(net):
    """Whether a backward through ``net`` may leave some trained array's gradient unwritten.

    MXNet's backward writes (``grad_req='write'``) only the gradients it reaches, so a parameter a step did not
    use keeps the gradient of the last step that did, and would be applied again, silently. A fixed graph (a
    ``CachedNet`` such as ``lenet_cached``, a gluon block's ``GluonNet``, or blocks of them run by ``Recompute``)
    reaches the same arrays at every step (an array outside the graph is never written: its gradient stays zero); any other function ``net(X, params)``, or
    a gluon Block run imperatively, may take a branch that skips some: ``step_replicas`` then zeroes every
    gradient before the forward, so that an unused parameter's gradient is zero on every context and worker.
    """
    if isinstance(net, Recompute):
        return any(may_skip_parameters(segment.net) for segment in net.segments)
    return not isinstance(net, (CachedNet, GluonNet))


def zero_grads(groups):
    """Zero every gradient buffer of the replicas of ``groups``, in place (queued, not waited for)."""
    for group in groups:
        for replica in group:
            for grad in grads_of(replica):
                grad[:] = 0


def fence_statistics(replicas, first_layers=False):
    """Order every later read of a replica's running statistics after its backward pass, which writes them without
    telling MXNet's engine (BatchNorm on CPU contexts: ``parallel.engine``); ``replicas`` has ``groups()``. The
    fence reads every gradient buffer: queued after a step's reductions, it holds none of them back, but the next
    forward's first BatchNorm then waits for every sum. ``first_layers`` (a cross barrier's): a flat replica's fence
    reads its first layers' gradient buffer alone (its last bucket: the last that backward writes, once every
    BatchNorm's backward has run on that context's engine thread), queued before the reductions, where it holds back
    that bucket's sum alone, and only until backward ends."""
    for group in replicas.groups():
        for replica in group:
            aux = aux_of(replica)
            if aux:
                grads = grads_of(replica)
                fence(grads[-1:] if first_layers and isinstance(replica, FlatReplica) else grads, aux)


def _trained_arrays(groups):
    """Every trained array of ``groups`` that backward writes the gradient of, and that gradient, for re-marking how
    backward writes it (ZeRO-3's shards are written by their reductions, not by backward)."""
    arrays = [param for group in groups for replica in group for param in replica if param.grad is not None]
    return arrays, [param.grad for param in arrays]


@contextlib.contextmanager
def adding_gradients(groups):
    """Inside the ``with`` block, every backward adds its gradients into the trained arrays' buffers of ``groups``,
    zeroed on entry (``grad_req='add'``: micro-batches one after another); afterwards it writes them again."""
    arrays, grads = _trained_arrays(groups)
    zero_grads(groups)
    if arrays:
        autograd.mark_variables(arrays, grads, "add")
    try:
        yield
    finally:
        if arrays:
            autograd.mark_variables(arrays, grads, "write")


def _accumulate(replicas, X, y, loss, n, count_correct=True):
    """``n`` micro-batches of the batch one after another, their gradients summed in place (``grad_req='add'``
    from zeroed buffers); returns (summed loss, correct) over the whole batch. A batch of fewer examples (one
    worker's slice of a global batch) runs its examples one a micro-batch and the rest empty: a strategy whose
    forward and backward make collectives (ZeRO-3) makes them as often on every worker."""
    with adding_gradients(replicas.groups()):
        sizes = shard_sizes(X.shape[0], min(n, X.shape[0]))
        bounds = np.cumsum([0] + sizes + [0] * (n - len(sizes)))
        sums = []
        for a, b in zip(bounds, bounds[1:]):
            if b > a:   # the last micro-batch's fence follows the step's reductions (step_replicas)
                sums.append(_forward_backward(replicas, X[a:b], y[a:b], loss, y if a == 0 else None, count_correct,
                                              fence=b < X.shape[0]))
            else:
                replicas.forward_backward([], [], loss)
    return _sum_micro(sums)


def _sum_micro(sums):
    """The (loss, correct) sums over the micro-batches (``_forward_backward``'s results): one micro-batch's as they
    are; several added inside a ``metrics`` bracket (an operator nothing marks may run inside whichever bracket is
    open on its lane, and ``add_n`` is one an update runs too)."""
    pairs = [tuple(s[:2]) for s in sums]
    if len(pairs) == 1:
        return pairs[0]
    with issued("metrics", lambda: [value for pair in pairs for value in pair if value is not None],
                closes_on_made=True) as made:
        result = tuple(mx.nd.add_n(*column) if column[0] is not None else None for column in zip(*pairs))
        made += [value for value in result if value is not None]
    return result


def step_replicas(replicas, X, y, lr=None, loss=softmax_cross_entropy, batch_size=None, optimizer=None,
                  accumulate=1, count_correct=True):
    """One synchronous optimizer step of every replica on the batch ``X``, ``y`` (see the module's docstring).

    Parameters
    ----------
    replicas : object
        ``in_ctx_list``, ``out_ctx_list``, ``forward_all``, ``aux``, ``groups``, ``reducer``.
    X, y : NDArray
        A batch (any context, any size >= 1), split over the replicas as ``split_and_load`` splits it: a
        batch smaller than the number of replicas leaves the last ones idle.
    lr : float, optional
        Plain SGD at this rate (the textbook's step); give ``lr`` or ``optimizer``.
    loss : callable
        ``loss(outputs, y)`` returns per-example losses.
    batch_size : int, optional
        What the summed gradient is divided by: the global batch, ``len(X)`` unless this is one worker's slice.
    optimizer : parallel.optim.Optimizer, optional
        The update rule, its state, schedule, clipping and sharding (``zero``).
    accumulate : int
        Run the batch as this many micro-batches one after another (sizes differ by at most one), summing
        their gradients, then take one optimizer step: the same step as the whole batch at once, with less
        memory for activations. At most ``batch_size`` (a worker's slice of fewer examples runs the rest empty).
    count_correct : bool
        False: leave the count of correct predictions out (None), for a caller that reads the loss alone.

    Returns
    -------
    (NDArray, NDArray)
        Summed loss and count of correct argmax predictions, each of shape (1,) on ``in_ctx_list[0]``; nothing
        here waits for the devices.
    """
    check_batch(X, y)
    optimizer = as_optimizer(lr, optimizer)
    accumulate = check_accumulate(accumulate, X.shape[0] if batch_size is None else batch_size)
    if accumulate == 1 and not replicas.adds_gradients:
        if replicas.skips_parameters:   # an unused parameter's gradient is 0
            zero_grads(replicas.groups())
        loss_sum, correct, active = _forward_backward(replicas, X, y, loss, y, count_correct, fence=False)
        active = None if replicas.computes_together else active
    else:   # every gradient buffer was zeroed first: a replica idle in some micro-batch adds nothing stale
        (loss_sum, correct), active = _accumulate(replicas, X, y, loss, accumulate, count_correct), None
    replicas.finish_backward()
    reducer = as_reducer(replicas.reducer)
    cross = reducer.cross_barrier   # the next forward's BatchNorms wait for the first layers' sum alone
    if cross:
        fence_statistics(replicas, first_layers=True)
    optimizer_step(optimizer, replicas.groups(), X.shape[0] if batch_size is None else batch_size, reducer, active)
    if not cross:
        fence_statistics(replicas)   # after the reductions: each bucket's starts as soon as backward has written it
    return loss_sum, correct


def idle_step(replicas, batch_size, optimizer, count_correct=True, accumulate=1, loss=softmax_cross_entropy):
    """The step of a worker that has no example this time: its replicas make every collective of the step's
    forwards and backwards (``forward_backward`` of no shard, once a micro-batch: ZeRO-3's gathers and reductions),
    add a zero gradient to the sum over the workers, and take the same optimizer step, divided by the global
    ``batch_size``. Returns a zero loss and count, as ``step_replicas`` would."""
    if replicas.adds_gradients:
        with adding_gradients(replicas.groups()):
            for _ in range(accumulate):
                replicas.forward_backward([], [], loss)
    elif workers() is not None:   # BatchNorm's statistics over the workers: its gathers, once a micro-batch
        for _ in range(accumulate):
            replicas.forward_backward([], [], loss)
    optimizer_step(optimizer, replicas.groups(), batch_size, replicas.reducer, 0)
    zero = mx.nd.zeros((1,), ctx=replicas.in_ctx_list[0])
    return zero, zero.copy() if count_correct else None


class DeviceReplicas(Replicas):
    """Data parallelism's replicas: ``device_params[i]`` on ``ctx_list[i]``, each running ``net``: one group,
    summed by ``reducer`` over the contexts and, in a distributed job (``reducer.job``), over the workers."""

    def __init__(self, device_params, ctx_list, net=lenet_cached, reducer=None):
        self.device_params, self.in_ctx_list = device_params, list(ctx_list)
        self.out_ctx_list = self.in_ctx_list
        self.net, self.reducer = as_net(net), as_reducer(reducer)
        self.skips_parameters = may_skip_parameters(self.net)

    def forward_all(self, X_shards):
        return run_net(self.net, X_shards, self.device_params[:len(X_shards)])

    def forward_backward(self, X_shards, y_shards, loss, counted=None):
        """``Replicas.forward_backward``; with no shard, in a job's step whose BatchNorm spans the workers
        (``parallel.comm.statistics``), the net's gathers without an example (``run_net``), and the running
        statistics every replica takes from them."""
        if X_shards or workers() is None:
            return super().forward_backward(X_shards, y_shards, loss, counted)
        statistics = Gathers()
        with autograd.record(), statistics.collecting():
            run_net(self.net, [], self.device_params)
        statistics.settle()
        return [], [], []

    def aux(self, r):
        return aux_of(self.device_params[r])

    def backward(self, losses, head_grads=None):
        """The backward pass of the last forward, from ``head_grads`` (None: ones): the net's own
        (``Recompute.backward``) or autograd's."""
        if isinstance(self.net, Recompute):
            self.net.backward(losses, head_grads)
        else:
            autograd.backward(losses, head_grads)

    def groups(self):
        return [self.device_params]


def train_step(X, y, device_params, ctx_list, lr=None, net=lenet_cached, loss=softmax_cross_entropy, reducer=None,
               optimizer=None, accumulate=1):
    """One optimizer step on every replica; returns the batch's summed loss and number of correct predictions.

    Parameters
    ----------
    X, y : NDArray
        A batch of inputs and labels (any context; any batch size >= 1).
    device_params : list of list of NDArray
        ``device_params[i]`` is the replica on ``ctx_list[i]`` (from ``get_params``). Updated in place.
    ctx_list : list of mxnet.Context
    lr : float, optional
        Plain SGD at this learning rate (the textbook's step): the summed gradient divided by the global batch
        size ``len(X)``. Give ``lr`` or ``optimizer``, not both.
    net : callable or mxnet.gluon.HybridBlock
        ``net(X, params)`` returns the outputs. The default, ``lenet_cached``, is the from-scratch ``lenet``
        run as a cached graph: the same values and gradients, less overhead per step; pass ``net=lenet``
        to run it op by op. A gluon block (whose replicas come from ``get_params(block, ctx)``) runs as
        ``GluonNet(block)``: BatchNorm statistics over the whole batch; pass
        ``net=GluonNet(block, sync_batchnorm=False)`` for per-context statistics. A net that is a
        ``parallel.models.base.Net`` is given every shard in one call (its ``forward_all(X_shards, device_params)``).
    loss : callable
        ``loss(outputs, y)`` returns per-example losses.
    reducer : parallel.Reducer or str, optional
        How the gradients are summed (``parallel.comm.Reducer``): an allreduce algorithm's name (``"ring"``:
        ``Reducer("ring")``; default ``DEFAULT_ALGORITHM``), or a ``Reducer`` with its buckets, compression (its
        residuals carry over: pass the same object at every step) and ``job``. With a job, ``X`` and ``y`` are the
        *global* batch (the same on every worker): this worker trains its slice
        (``parallel.job.worker_slice``), its contexts' gradient sum is summed over the workers through the
        kvstore, and the step divides by the global batch size. Every worker must call it for every batch, even
        one whose slice is empty.
    optimizer : parallel.optim.Optimizer, optional
        The update: ``SGD`` with momentum, ``Adam``, ``AdamW``, with a schedule, clipping and ZeRO sharding
        (``parallel.optim``). It keeps its state between calls: pass the same object at every step.
    accumulate : int
        Micro-batches per batch, run one after another before one update (see ``step_replicas``).

    Returns
    -------
    (NDArray, NDArray)
        Summed loss and count of correct argmax predictions (of this worker's slice, in a job), each of shape
        (1,) on ``ctx_list[0]``. Nothing here waits for the device, except the kvstore's first use of a key.
    """
    return _data_parallel_step(X, y, device_params, ctx_list, lr, net, loss, reducer, optimizer, accumulate)


def _data_parallel_step(X, y, device_params, ctx_list, lr, net, loss, reducer, optimizer, accumulate,
                        count_correct=True):
    """``train_step``'s work; ``count_correct=False`` for ``train_batch``, whose caller reads the loss alone."""
    optimizer = as_optimizer(lr, optimizer)
    reducer = as_reducer(reducer)
    _check_replicas(device_params, ctx_list)
    check_batch(X, y)
    replicas = DeviceReplicas(device_params, ctx_list, net, reducer)
    return worker_step(replicas, X, y, loss, optimizer, accumulate, reducer.job, count_correct)


def worker_step(replicas, X, y, loss, optimizer, accumulate=1, job=None, count_correct=True):
    """``step_replicas`` on the global batch ``X``, ``y``, as one worker of ``job`` (None: the whole batch): this
    worker's slice (``parallel.job.worker_slice`` over its ``len(replicas.in_ctx_list)`` replicas), or, for a
    worker without an example, ``idle_step`` (it adds a zero gradient and takes the same step); divided by the
    global batch size."""
    n = X.shape[0]
    with across_workers(statistics_job(job)):
        if job is not None:
            start, stop = worker_slice(n, len(replicas.in_ctx_list), job.rank, job.num_workers)
            if start == stop:
                return idle_step(replicas, n, optimizer, count_correct, accumulate, loss)
            X, y = X[start:stop], y[start:stop]   # fewer examples than micro-batches: the rest run empty
        return step_replicas(replicas, X, y, loss=loss, batch_size=n, optimizer=optimizer, accumulate=accumulate,
                             count_correct=count_correct)


def statistics_job(job):
    """The job whose workers' statistics BatchNorm combines in a step of ``job`` (``job.statistics``): ``job``
    itself, or None for statistics per worker (and out of a job)."""
    return job if job is not None and job.statistics == "job" else None


def train_batch(X, y, device_params, ctx_list, lr=None, net=lenet_cached, loss=softmax_cross_entropy, reducer=None,
                optimizer=None, accumulate=1):
    """One synchronous step on every replica (the textbook's ``train_batch``).

    Splits the batch across ``ctx_list``, computes each shard's gradient on its context, sums the
    gradients with ``allreduce`` and updates every replica in place with the same step: with ``lr``, plain
    SGD ``param -= lr * summed_grad / len(X)``; with ``optimizer``, its update (see ``train_step``). With a
    ``reducer`` whose ``job`` is set (``parallel.job.join()``), ``X`` and ``y`` are the global batch and the
    gradients are summed over every worker too.

    Returns
    -------
    NDArray
        The batch's summed loss (this worker's slice in a job), shape (1,) on ``ctx_list[0]``, not yet
        computed: reading it syncs.
    """
    return _data_parallel_step(X, y, device_params, ctx_list, lr, net, loss, reducer, optimizer, accumulate,
                               count_correct=False)[0]
