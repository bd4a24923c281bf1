"""Any gluon ``HybridBlock`` on the from-scratch path: a function ``net(X, params)`` of flat replicas.

``get_params(block, ctx)`` (``parallel.comm``) copies a block's parameters to a context as one flat
buffer, like LeNet's; ``GluonNet(block)`` is the block as the function the training step calls,
``net(X, params)``: the block's graph (``block(mx.sym.var("data"))``) run as a cached graph with the
replica's arrays as its inputs. The block's own ``Parameter`` objects are read once, by ``get_params``,
and never used afterwards: every replica is independent, exactly like the textbook's ``get_params``.

BatchNorm. A network with BatchNorm normalises each context's shard by that shard's own mean and
variance, so K contexts do not train the same model as one (whose statistics cover the whole batch).
``GluonNet(block, sync_batchnorm=True)`` (the default) restores the invariant: in training, its
``forward_all`` runs the graph on every context in lockstep, one operator at a time, and at every
BatchNorm pools each context's per-channel sums and sums of squared deviations (``_Moments``, whose
backward is one fused pass) through copies that autograd records, so the backward pass flows through
the same reduction and every gradient is the one-context gradient. The running statistics are then computed from the same bits
on every context, so every replica keeps identical running statistics and evaluation agrees on any
context. MXNet's ``contrib.nn.SyncBatchNorm`` is not used: it averages the contexts' means with equal
weights, which is wrong for shards of unequal size (a batch of 10 over 4 contexts), and it synchronises
inside the engine with a barrier keyed by a global name.
"""
import functools
import itertools
import json
import weakref

import mxnet as mx
from mxnet import autograd, gluon

from ..comm.replica import Replica, aux_names_of, aux_of, block_state, names_of
from ..comm.statistics import combine, idle, pooled, row, workers
from ..mxnet_compat import nd_operator
from ..validate import check_bool, check_int
from .base import Net
from .lenet import GraphCache, cached_graph

__all__ = ["Chain", "GluonNet", "as_net", "set_block_params"]


def set_block_params(block, params):
    """Copy a replica (from ``get_params(block, ctx)``) back into ``block``'s parameters, on every context.

    Use it to hand the trained model to gluon: ``block.export(...)``, ``block(X)``, a ``gluon.Trainer``.
    """
    names, _, aux_names, _ = block_state(block)
    if list(names_of(params) or ()) != names or aux_names_of(params) != aux_names:
        raise ValueError("params is not a replica of this block: make it with get_params(block, ctx)")
    by_name = block.collect_params()
    for name, array in zip(names + aux_names, list(params) + aux_of(params)):
        by_name[name].set_data(array)


class Chain(gluon.HybridBlock):
    """``blocks`` run one after the other, each taking what the one before returns (a tuple as that many
    arguments): a ``HybridSequential`` whose blocks may take and return several arrays. The blocks are shared,
    not copied."""

    def __init__(self, blocks, **kwargs):
        super().__init__(**kwargs)
        for i, block in enumerate(blocks):
            self.register_child(block, str(i))

    def hybrid_forward(self, F, *inputs):
        for block in self._children.values():
            out = block(*inputs)
            inputs = out if isinstance(out, (list, tuple)) else (out,)
        return inputs[0] if len(inputs) == 1 else tuple(inputs)


class GluonNet(Net):
    """A gluon ``HybridBlock`` as the function ``net(X, params)`` of a replica from ``get_params(block, ctx)``.

    ``net(X, params)`` runs the block's graph on ``X``'s context as a cached graph (``static_alloc``,
    ``static_shape``, parameters declared as such: ``cached_graph``; one graph per context, input shape and
    mode, training or not) whose inputs are the replica's arrays: the
    same values and gradients as the block itself. In training (inside ``autograd.record()``) BatchNorm
    layers update the replica's running statistics (``params.aux``); outside, they use them.

    Parameters
    ----------
    block : mxnet.gluon.HybridBlock
        Initialized, with known shapes (run it once on an example batch). Its graph is taken once, here:
        change the block afterwards and make a new ``GluonNet``.
    sync_batchnorm : bool
        With several contexts, train BatchNorm on the statistics of the whole batch (``forward_all``,
        which ``train_step`` calls), so K contexts train the same model as one. ``False``: each context
        normalises its own shard (what ``gluon.Trainer`` training does), faster but not the same model.
    max_shapes : int
        Cached graphs kept per context (one per input shape), least recently used dropped first.
    static : bool
        Run static graphs (``cached_graph``), which keep their arrays' memory; False for blocks of a network
        recomputed block by block.
    num_inputs : int
        How many arrays the block takes, ``block(X)`` or ``block(X, H, ...)``: ``net(X, params)`` then takes a
        tuple of as many arrays as ``X``. A block that returns a tuple gives a tuple (a part of a residual block
        passes its input on to the next part: ``parallel.models.resnet.Residual.parts``).

    Attributes
    ----------
    names, aux_names : list of str
        The trainable parameters (a replica's order) and the others (``params.aux``'s order).
    has_batchnorm : bool
        Whether the graph holds a BatchNorm.
    """

    def __init__(self, block, sync_batchnorm=True, max_shapes=4, static=True, num_inputs=1):
        if not isinstance(block, gluon.HybridBlock):
            raise TypeError(f"block must be a gluon HybridBlock (its graph is needed), got {type(block).__name__}")
        check_bool(sync_batchnorm, "sync_batchnorm")
        check_int(max_shapes, "max_shapes", low=1)
        self.static = check_bool(static, "static")
        check_int(num_inputs, "num_inputs", low=1)
        self.names, trained, self.aux_names, others = block_state(block)
        self.data_names = ("data",) + tuple(f"data{i}" for i in range(1, num_inputs))
        out = block(*[mx.sym.var(name) for name in self.data_names])
        if isinstance(out, (list, tuple)) and all(isinstance(o, mx.sym.Symbol) for o in out):
            out = mx.sym.Group(list(out))
        if not isinstance(out, mx.sym.Symbol):
            raise ValueError("the block must return a symbol or a tuple of them")
        self.symbol, self.num_outputs = out, len(out.list_outputs())
        inputs = self.symbol.list_inputs()
        known = set(self.data_names) | set(self.names) | set(self.aux_names)
        unknown = [name for name in inputs if name not in known]
        missing = [name for name in self.data_names if name not in inputs]
        if unknown or missing:
            raise ValueError(f"the block's graph takes inputs {unknown or ['(not all its data)']} that are not its "
                             f"parameters; GluonNet runs blocks of num_inputs={num_inputs} input(s)")
        self._inputs = inputs
        graph = json.loads(self.symbol.tojson())
        self._nodes, self._heads = graph["nodes"], graph["heads"]
        self.has_batchnorm = any(node["op"] in ("BatchNorm", "_contrib_SyncBatchNorm") for node in self._nodes)
        arrays = dict(zip(self.names + self.aux_names, trained + others))   # a fixed gamma is not trained
        #: every BatchNorm that normalises by the batch in training: (node index, channels, dtype), in graph order
        self._batchnorms = [(index, arrays[self._nodes[node["inputs"][1][0]]["name"]].shape[0],
                             arrays[self._nodes[node["inputs"][1][0]]["name"]].dtype)
                            for index, node in enumerate(self._nodes)
                            if node["op"] == "BatchNorm" and not _global_stats(node.get("attrs", {}))]
        self.sync_batchnorm = sync_batchnorm
        # what names this net's BatchNorm gathers in a job (with the node's index): a number no other net of the
        # process ever has. Not ``id(self)``: a net made where a freed one lay has its id, so it took over the freed
        # net's keys on the worker whose allocator reused the address while the others numbered new ones, and the
        # job hung (its first step's sums under keys the others never pushed)
        self._gathers_as = next(_NUMBERS)
        self.max_shapes = int(max_shapes)
        self._graphs = GraphCache(self.max_shapes)   # per context, by (shape, training) and the bound arrays

    @property
    def graphs_built(self):
        return self._graphs.built

    def __repr__(self):
        return (f"GluonNet({len(self.names)} trainable arrays, {len(self.aux_names)} others, "
                f"sync_batchnorm={self.sync_batchnorm})")

    def _arrays(self, X, params):
        names = names_of(params)
        if names is not None and list(names) != self.names:
            raise ValueError("params is a replica of another block: make it with get_params(block, ctx) "
                             "from the block this GluonNet wraps")
        if len(params) != len(self.names) or len(aux_of(params)) != len(self.aux_names):
            raise ValueError(f"params holds {len(params)} arrays (+{len(aux_of(params))} others) "
                             f"but the block has {len(self.names)} (+{len(self.aux_names)}); make it with "
                             "get_params(block, ctx)")
        by_name = dict(zip(self.names, params))
        by_name.update(zip(self.aux_names, aux_of(params)))
        by_name.update(zip(self.data_names, self._data(X)))
        return by_name

    def _data(self, X):
        """The block's inputs: ``X`` itself, or the tuple of its ``num_inputs`` arrays."""
        if len(self.data_names) == 1:
            return (X,)
        if not isinstance(X, (list, tuple)) or len(X) != len(self.data_names):
            raise ValueError(f"the block takes {len(self.data_names)} arrays, a tuple of them, got {type(X).__name__}")
        return tuple(X)

    def _result(self, outputs):
        """One output as an array, several as a tuple."""
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        return outputs[0] if self.num_outputs == 1 else tuple(outputs)

    def __call__(self, X, params):
        training = autograd.is_training()
        if not training:
            # In inference MXNet's oneDNN convolution reorders its weight array in place into a blocked
            # layout, which a view into a replica's flat buffer cannot take (it writes past the view, or
            # fails MXNet's is_view check and crashes the process): run on copies, made for this call.
            params = Replica([param.copy() for param in params], names_of(params), aux_of(params))
        by_name = self._arrays(X, params)
        arrays = [by_name[name] for name in self._inputs]
        # Training passes the replica's own arrays at every call: declared as parameters, which MXNet binds once and
        # bulks (``cached_graph``), one graph per replica. Inference passes fresh copies, which would re-bind a graph
        # that declares them: there every input is data, and one graph serves every call.
        bound = [array for name, array in zip(self._inputs, arrays) if name not in self.data_names] if training else ()
        data = self._data(X)
        graph = self._graphs.get(data[0].context, (tuple(x.shape for x in data), training), bound,
                                 lambda: cached_graph(self.symbol, self._inputs if not training else self.data_names,
                                                      static=self.static)[0])
        return self._result(graph(*arrays))

    def forward_all(self, X_shards, device_params):
        """The outputs of every shard on its replica's context, in one forward of the whole batch.

        With BatchNorm, ``sync_batchnorm`` and more than one shard, or inside a job's step
        (``parallel.comm.statistics.across_workers``), in training: the graph is run on all contexts in lockstep,
        operator by operator, and each BatchNorm normalises over the whole batch, of every worker in a job (see the
        module's docstring). A job's worker without an example still makes each BatchNorm's collectives. Otherwise
        ``[self(X, params) for ...]``.
        """
        if len(X_shards) != len(device_params):
            raise ValueError(f"{len(X_shards)} shards but {len(device_params)} replicas")
        synced = self._synced()
        job = workers() if synced else None
        if not synced or (len(X_shards) == 1 and job is None):
            return [self(X, params) for X, params in zip(X_shards, device_params)]
        values = [self._arrays(X, params) for X, params in zip(X_shards, device_params)]
        outputs = {}   # node index -> list over contexts of the node's outputs (a list each)
        for index, node in enumerate(self._nodes):
            if node["op"] == "null":
                outputs[index] = [[value[node["name"]]] for value in values]
                continue
            attrs = {key: value for key, value in node.get("attrs", {}).items() if not key.startswith("__")}
            inputs = [[outputs[i][k][j] for i, j, _ in node["inputs"]] for k in range(len(values))]
            if node["op"] == "BatchNorm" and not _global_stats(attrs):
                gather = None if job is None else functools.partial(combine, job, (self._gathers_as, index))
                outputs[index] = [[out] for out in _sync_batchnorm(inputs, attrs, gather)]
            else:
                outputs[index] = [_invoke(node["op"], args, attrs) for args in inputs]
        return [self._result([outputs[i][k][j] for i, j, _ in self._heads]) for k in range(len(values))]

    def _synced(self):
        """Whether this forward normalises over more than a shard: BatchNorm, ``sync_batchnorm``, training."""
        return self.has_batchnorm and self.sync_batchnorm and autograd.is_training()

    def idle_all(self, parts):
        """In a job's step (``across_workers``), in training: each BatchNorm's gathers with the other workers
        without an example (``parallel.comm.statistics.idle``), and the running statistics of every replica of
        ``parts`` updated with what they give, as the workers with examples update theirs."""
        job = workers() if self._synced() else None
        for index, channels, dtype in self._batchnorms if job is not None else ():
            moments = idle(job, (self._gathers_as, index), channels, dtype)
            if moments is None:   # no worker had an example: the running statistics stay
                continue
            mean, var = moments
            attrs = self._nodes[index].get("attrs", {})
            momentum = float(attrs.get("momentum", 0.9))
            inputs = [self._nodes[i]["name"] for i, _, _ in self._nodes[index]["inputs"]]
            for part in parts:
                by_name = dict(zip(self.aux_names, aux_of(part)))
                _update_running(by_name[inputs[3]], by_name[inputs[4]], mean, var, momentum)


def _global_stats(attrs):
    """Whether a BatchNorm node normalises by its running statistics, in training too."""
    return attrs.get("use_global_stats", "False") in ("True", "1", "true")


def _invoke(op, args, attrs):
    """Run the operator called ``op`` on ``args`` with ``attrs`` (strings, as in a symbol's JSON)."""
    result = nd_operator(op)(*args, **attrs)
    return result if isinstance(result, list) else [result]


#: Exactly representable in every float type, and summing to 1 in each: a BatchNorm given these as its
#: variance and eps divides by sqrt(1) = 1 exactly (see ``_affine``).
_UNIT_EPS = 2.0 ** -10


def _affine(x, scale, shift, axis):
    """``scale * x + shift`` per channel along ``axis`` (recorded: gradients reach all three).

    Written as MXNet's fused BatchNorm operator with fixed statistics (mean 0, variance + eps = 1 exactly):
    its backward computes the per-channel gradients of ``scale`` and ``shift`` in one fused pass, where
    ``broadcast_mul``/``broadcast_add`` reduce them with MXNet's generic kernel, 10-15x slower on CPU.
    """
    zeros = mx.nd.zeros(scale.shape, ctx=scale.context, dtype=scale.dtype)
    unit = mx.nd.full(scale.shape, 1.0 - _UNIT_EPS, ctx=scale.context, dtype=scale.dtype)
    return mx.nd.BatchNorm(x, scale, shift, zeros, unit, eps=_UNIT_EPS, use_global_stats=True, fix_gamma=False,
                           axis=axis)


def _channel_sums(x, axis):
    """The sum over every axis of ``x`` but ``axis``, shape ``(channels,)`` (recorded).

    For the usual layout (channels on axis 1 of a 3- to 5-D array) a global sum pooling, whose backward
    is fast, then a sum over the batch; otherwise MXNet's ``sum`` over the other axes.
    """
    if axis == 1 and 3 <= x.ndim <= 5:
        pooled = mx.nd.Pooling(x, kernel=(1,) * (x.ndim - 2), global_pool=True, pool_type="sum")
        return pooled.reshape((x.shape[0], x.shape[1])).sum(axis=0)
    return x.sum(axis=tuple(a for a in range(x.ndim) if a != axis))


def _sync_batchnorm(inputs, attrs, gather=None):
    """BatchNorm in training over the union of the shards; ``inputs[k]`` = (x, gamma, beta, mean, var).

    Two passes over each shard, as MXNet's own BatchNorm (``_Moments``): its per-channel sums and sums of squared
    deviations from its own mean, pooled over the contexts on the first (``pooled``: Chan et al.'s update, recorded
    copies, so the backward pass flows through the same reduction) into the batch's mean and (biased) variance.
    ``gather(count, sums, squares)`` (``parallel.comm.statistics.combine`` over a job's workers): the mean and
    variance of every worker's batch from this worker's count, sums and sums of squared deviations from its mean.
    Each shard is then normalised in one fused pass, ``x scale + (beta - mean scale)`` (``_affine``).
    """
    xs = [args[0] for args in inputs]
    axis = int(attrs.get("axis", 1)) % xs[0].ndim
    eps, momentum = float(attrs.get("eps", 1e-3)), float(attrs.get("momentum", 0.9))
    fix_gamma = attrs.get("fix_gamma", "True") in ("True", "1", "true")
    counts = [x.size // x.shape[axis] for x in xs]
    moments = [_Moments(axis)(x) for x in xs]
    if len(xs) == 1:
        sums, squares = moments[0]
    else:   # one row a context, (count, sums, squared deviations), pooled on the first context
        first = xs[0].context
        rows = [row(n, s.as_in_context(first), q.as_in_context(first)) for n, (s, q) in zip(counts, moments)]
        _, sums, squares = pooled(mx.nd.stack(*rows, axis=0))
    if gather is not None:   # this worker's count, sums and squared deviations, combined with the other workers'
        mean, var = gather(sum(counts), sums, squares)
    else:
        mean, var = sums / sum(counts), squares / sum(counts)
    outputs = []
    for x, gamma, beta, running_mean, running_var in inputs:
        here, there = mean.as_in_context(x.context), var.as_in_context(x.context)
        scale = (there + eps).rsqrt()
        if not fix_gamma:
            scale = scale * gamma
        outputs.append(_affine(x, scale, beta - here * scale, axis))   # centred on the batch's mean in the same pass
        _update_running(running_mean, running_var, here, there, momentum)
    return outputs


class _Moments(autograd.Function):
    """``x``'s per-channel sums and sums of squared deviations from its own per-channel mean, along ``axis``, with a
    backward pass of one fused operator: ``d/dx = dsums + 2 (x - mean) dsquares`` (the mean's own derivative adds
    nothing: the deviations sum to zero), where recording the forward's five operators would take as many backward
    passes over ``x``."""

    def __init__(self, axis):
        super().__init__()
        self.axis = axis

    def forward(self, x):
        count = max(x.size // x.shape[self.axis], 1)
        sums = _channel_sums(x, self.axis)
        mean = sums / count
        centered = _affine(x, mx.nd.ones_like(mean), -mean, self.axis)
        self.save_for_backward(x, mean)
        return sums, _channel_sums(mx.nd.square(centered), self.axis)

    def backward(self, dsums, dsquares):
        # MXNet hands a custom function its gradients, and takes back its result, in arrays labelled with the device
        # type and number of the engine's run (``c_api_function.cc``, ``Backward``): x's own device on a GPU, but
        # cpu(0) for every CPU context, where x's memory is the same memory. So the result goes back under that label.
        x, mean = self.saved_tensors
        label, ctx = dsums.context, x.context
        scale = 2 * dsquares.as_in_context(ctx)
        return _affine(x, scale, dsums.as_in_context(ctx) - mean * scale, self.axis).as_in_context(label)


def _update_running(running_mean, running_var, mean, var, momentum):
    """What MXNet's BatchNorm does to its running statistics (the batch's biased variance), in place, unrecorded."""
    with autograd.pause():
        running_mean[:] = running_mean * momentum + mean.as_in_context(running_mean.context) * (1 - momentum)
        running_var[:] = running_var * momentum + var.as_in_context(running_var.context) * (1 - momentum)


#: Where ``GluonNet._gathers_as`` comes from: one number a net made in this process.
_NUMBERS = itertools.count()

#: Each gluon block's ``GluonNet`` (``as_net``), kept beside the block rather than on it (the block is the user's:
#: nothing is written onto it), for as long as the block lives (a ``GluonNet`` holds no reference to its block).
_GLUON_NETS = weakref.WeakKeyDictionary()


def as_net(net, sync_batchnorm=True):
    """``net`` as a function ``net(X, params)``: a gluon ``HybridBlock`` becomes its ``GluonNet`` (made once
    per block and setting, and kept while the block lives; nothing is written onto the block), anything else is
    returned as it is."""
    if isinstance(net, gluon.Block):
        cached = _GLUON_NETS.get(net)
        if cached is None or cached.sync_batchnorm != sync_batchnorm:
            cached = _GLUON_NETS[net] = GluonNet(net, sync_batchnorm=sync_batchnorm)
        return cached
    return net
