"""LeNet written from scratch: parameters are plain arrays, the network is a function of (X, params).

The textbook's variant: conv 20x3x3, ReLU, avg-pool 2, conv 50x5x5, ReLU, avg-pool 2,
dense 800->128 ReLU, dense 128->10, trained with softmax cross-entropy.
"""
import collections

import mxnet as mx
import numpy as np
from mxnet import gluon

from ..validate import check_bool, check_int, check_seed
from .base import Net

__all__ = ["LENET_SHAPES", "LENET_PARAM_NAMES", "LENET_LAYERS", "init_lenet_params", "lenet", "lenet_layers",
           "LenetStage", "lenet_cached", "CachedNet", "cached_graph", "GraphCache", "softmax_cross_entropy",
           "BACKWARD_BULK_SIZE"]

#: Shapes of the eight LeNet parameters, in the order ``lenet`` takes them.
LENET_SHAPES = [
    (20, 1, 3, 3), (20,),      # conv1 weight, bias
    (50, 20, 5, 5), (50,),     # conv2 weight, bias
    (800, 128), (128,),        # dense1 weight, bias
    (128, 10), (10,),          # dense2 weight, bias
]

#: Names of LeNet's eight parameters, in ``LENET_SHAPES`` order: what checkpoints and exports store them as.
LENET_PARAM_NAMES = ("conv1_weight", "conv1_bias", "conv2_weight", "conv2_bias",
                     "dense1_weight", "dense1_bias", "dense2_weight", "dense2_bias")


def init_lenet_params(seed=0, scale=0.01, dtype="float32"):
    """Fresh LeNet parameters on the CPU: weights ~ normal(0, scale), biases zero.

    Parameters
    ----------
    seed : int
        0 .. 2**32-1. Seed of a private ``numpy.random.RandomState``; the global MXNet and numpy seeds are untouched,
        so the same seed always gives the same parameters.
    scale : float
        Standard deviation of the weights.
    dtype : str
        Data type of the arrays.

    Returns
    -------
    list of NDArray
        Eight arrays on ``mx.cpu()`` with shapes ``LENET_SHAPES``, without gradients attached
        (``get_params`` copies them to a context and attaches gradients).
    """
    check_seed(seed)
    rng = np.random.RandomState(seed)
    return [mx.nd.array(rng.normal(0.0, scale, shape) if len(shape) > 1 else np.zeros(shape), dtype=dtype)
            for shape in LENET_SHAPES]


def _relu(F, X):
    # Activation(act_type="relu") rather than F.relu: the same function, but MXNet's CPU build runs it
    # with oneDNN (MKL-DNN), which made a LeNet forward+backward ~11% faster here (57.6 -> 51.3 ms).
    return F.Activation(X, act_type="relu")


def _conv_block(F, X, W, b, kernel, num_filter):
    h = _relu(F, F.Convolution(X, W, b, kernel=kernel, num_filter=num_filter))
    return F.Pooling(h, pool_type="avg", kernel=(2, 2), stride=(2, 2))


def _dense(F, X, W, b, num_hidden):
    # ``X W + b`` with W of shape (in, out), the textbook's layout, as MXNet's FullyConnected (which takes the
    # weight as (out, in), hence the transpose). Not ``dot``: on CPU contexts ``dot`` calls the OpenBLAS 0.3.13
    # bundled with MXNet 1.9.1 (an OpenMP build), which hangs for good when two contexts run a matrix product
    # at the same time with more than one OpenMP thread each (seen here: hybrid parallelism, whose replicas run
    # a stage in lockstep, hung at its first batch with OMP_NUM_THREADS=2). FullyConnected runs on oneDNN in
    # float32, which is safe to call from several threads.
    return F.FullyConnected(X, F.transpose(W), b, num_hidden=num_hidden, flatten=True)


#: LeNet as a sequence of layers: (name, function of (F, X, W, b)). Each layer takes two parameters,
#: so layer ``i`` owns ``params[2*i:2*i+2]``. Model and pipeline parallelism cut the model between layers.
LENET_LAYERS = [
    ("conv1", lambda F, X, W, b: _conv_block(F, X, W, b, (3, 3), 20)),
    ("conv2", lambda F, X, W, b: _conv_block(F, X, W, b, (5, 5), 50)),
    ("dense1", lambda F, X, W, b: _relu(F, _dense(F, X, W, b, LENET_SHAPES[5][0]))),
    ("dense2", lambda F, X, W, b: _dense(F, X, W, b, LENET_SHAPES[7][0])),
]


def lenet_layers(X, params, start=0, stop=None, F=None):
    """Run layers ``start .. stop-1`` of LeNet (a *stage*) on ``X``.

    Parameters
    ----------
    X : NDArray or Symbol
        The input of layer ``start``: images (batch, 1, 28, 28) for layer 0, else the previous stage's output.
    params : list of NDArray or Symbol
        The parameters of these layers only: ``2 * (stop - start)`` arrays, two per layer.
    start, stop : int
        Layer range, ``0 <= start < stop <= len(LENET_LAYERS)``; ``stop`` defaults to the last layer.
    F : module, optional
        ``mx.nd`` or ``mx.sym``; inferred from ``X``.

    Returns
    -------
    NDArray or Symbol
        The output of layer ``stop - 1``, computed on the context of ``X``.
    """
    stop = len(LENET_LAYERS) if stop is None else stop
    if not 0 <= start < stop <= len(LENET_LAYERS):
        raise ValueError(f"layer range [{start}, {stop}) is outside LeNet's {len(LENET_LAYERS)} layers")
    if len(params) != 2 * (stop - start):
        raise ValueError(f"layers [{start}, {stop}) take {2 * (stop - start)} parameters, got {len(params)}")
    if F is None:
        F = mx.sym if isinstance(X, mx.sym.Symbol) else mx.nd
    for i, (_, layer) in enumerate(LENET_LAYERS[start:stop]):
        X = layer(F, X, params[2 * i], params[2 * i + 1])
    return X


class LenetStage:
    """LeNet's layers ``start .. stop-1`` (a stage, as model parallelism cuts it) as a function
    ``net(X, params)`` of their parameters: ``lenet_layers(X, params, start, stop)``."""

    def __init__(self, start, stop):
        self.start, self.stop = start, stop

    def __call__(self, X, params):
        return lenet_layers(X, params, self.start, self.stop)


def lenet(X, params, F=None):
    """Forward pass of LeNet.

    Parameters
    ----------
    X : NDArray or Symbol
        Images of shape (batch, 1, 28, 28) on the same context as ``params``.
    params : list of NDArray or Symbol
        The eight parameters in ``LENET_SHAPES`` order.
    F : module, optional
        ``mx.nd`` or ``mx.sym``; inferred from ``X``. Passing symbols lets the same definition
        run as a cached graph inside a ``HybridBlock``.

    Returns
    -------
    NDArray or Symbol
        Logits of shape (batch, 10), on the context of ``X`` (computed there, asynchronously).
    """
    return lenet_layers(X, params, F=F)


#: Operators a cached graph's backward pass runs as one engine operation (MXNet's ``backward_bulk_size``; its
#: default is 15, ``MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD``). Bounded, the gradients appear layer by layer, so
#: that a ``Reducer`` bucket's sum starts while the earlier layers' backward runs; with 15, LeNet's backward is
#: three operations and its last bucket is written with the rest. Measured (benchmarks/overlap.py): bounding it
#: costs LeNet and ResNet-18 nothing measurable on CPU contexts.
BACKWARD_BULK_SIZE = 2


def cached_graph(symbol, data_names, backward_bulk_size=None, static=True):
    """``symbol`` as MXNet's ``CachedOp`` with static memory and shapes, its inputs but ``data_names`` declared as
    *parameters* (``param_indices``), as gluon declares a hybridized block's parameters, its backward pass run in
    engine operations of at most ``backward_bulk_size`` operators (default ``BACKWARD_BULK_SIZE``, read at the
    call).

    The declaration matters for speed: MXNet binds a static graph's parameters once and runs the operators that
    read them in engine bulks, where it re-binds, one by one, every operator that reads a *data* input at every
    call. Measured on LeNet (batch 256, ``OMP_NUM_THREADS=2``), the whole step with the weights as data inputs
    took 57.1 / 62.4 / 70.1 ms at K = 1 / 2 / 4 contexts, declared as parameters 57.0 / 57.9 / 65.9 ms: the two
    contexts overlap again. A graph must then be called with the same parameter arrays every time: given other
    arrays, MXNet 1.9.1 re-binds its forward pass but its backward still writes the first arrays' gradients
    (``GraphCache`` keeps one graph per set of arrays).

    ``static=False`` leaves out ``static_alloc`` and ``static_shape``: a static graph keeps the memory of every
    array it computes for as long as it lives, which a network run block by block to hold fewer activations at
    once (``parallel.models.recompute``) cannot afford; without, the arrays go back to MXNet's pool after use.

    Returns
    -------
    (mxnet.ndarray.CachedOp, list of str)
        The graph and the names of its inputs, in the order it takes them.
    """
    inputs = symbol.list_inputs()
    data = [i for i, name in enumerate(inputs) if name in data_names]
    flags = [("static_alloc", static), ("static_shape", static), ("data_indices", data),
             ("param_indices", [i for i in range(len(inputs)) if i not in data]),
             ("backward_bulk_size", int(BACKWARD_BULK_SIZE if backward_bulk_size is None else backward_bulk_size))]
    return mx.nd.CachedOp(symbol, flags=flags), inputs


class GraphCache:
    """Cached graphs per context, by a key and by the very arrays bound as their parameters, at most ``max_size``
    per context, the least recently used dropped first.

    A replica passes its own arrays at every call, so one graph serves it for good; other arrays (another replica
    on the context, new copies) get their own graph. The entry holds the arrays, so their identity (``id``) cannot
    be reused by other arrays while the graph lives.
    """

    def __init__(self, max_size):
        self.max_size = check_int(max_size, "max_size", low=1)
        self.built = 0
        self._graphs = {}   # context -> OrderedDict((key, ids of the bound arrays) -> (graph, bound arrays))

    def get(self, ctx, key, bound, build):
        """The graph for ``key`` on ``ctx`` bound to the arrays ``bound``, made by ``build()`` on a miss."""
        graphs = self._graphs.setdefault(ctx, collections.OrderedDict())
        full_key = (key, tuple(map(id, bound)))
        entry = graphs.get(full_key)
        if entry is None:
            entry = graphs[full_key] = (build(), list(bound))
            self.built += 1
            if len(graphs) > self.max_size:   # bound the memory the cached graphs hold
                graphs.popitem(last=False)
        graphs.move_to_end(full_key)
        return entry[0]

    def keys(self, ctx):
        """The keys of the graphs kept for ``ctx``, least recently used first."""
        return [key for key, _ in self._graphs.get(ctx, {})]


class CachedNet(Net):
    """The same network function, run as a cached graph (``static_alloc``, ``static_shape``, the parameters declared
    as such: ``cached_graph``).

    Calling it has the signature of the function it wraps, ``net(X, params)``, and gives the same values
    and gradients: MXNet records the graph once and then runs it without Python in the loop. There is one
    graph per context and input shape: contexts never share cached memory, and a shape that comes and goes
    (an epoch's short last batch) does not make a ``static_shape`` graph re-plan its memory every time.

    Every context a run uses keeps its graphs, however many contexts there are; only the shapes are bounded,
    per context. A graph is bound to the parameter arrays it was first given (a replica's views): other arrays on
    the same context get a graph of their own.

    Parameters
    ----------
    net : callable
        ``net(X, params, F=None)`` written with ``F`` (``mx.nd`` or ``mx.sym``), like ``lenet``.
    max_shapes : int
        Graphs kept per context, one per input shape and set of parameter arrays; the least recently used is
        dropped first. A training run uses at most four per context (its shard and the epoch's short last shard,
        for training and for evaluation), which the default keeps.
    static : bool
        Static graphs (``cached_graph``), which keep their arrays' memory; False for the blocks of a network
        recomputed block by block.

    Attributes
    ----------
    graphs_built : int
        How many graphs were built so far (a cache miss builds one); a steady run stops building.
    graphs : GraphCache
        The cached graphs: ``graphs.keys(ctx)`` are the input shapes kept for ``ctx``, least recently used first.

    >>> import mxnet as mx
    >>> net = CachedNet(lenet)
    >>> params = init_lenet_params()
    >>> for _ in range(3):
    ...     out = net(mx.nd.ones((4, 1, 28, 28)), params)
    >>> out.shape, net.graphs_built
    ((4, 10), 1)
    """

    def __init__(self, net, max_shapes=4, static=True):
        self.net, self.static = net, check_bool(static, "static")
        self.max_shapes = check_int(max_shapes, "max_shapes", low=1)
        self.graphs = GraphCache(self.max_shapes)
        self._symbols = {}   # number of params -> the network's symbol

    @property
    def graphs_built(self):
        return self.graphs.built

    def symbol_for(self, count):
        """The network's symbol for ``count`` parameter arrays: inputs ``data``, ``param0`` .. ``param<count-1>``
        (made once per count). What each cached graph runs; a benchmark infers its activations' shapes from it."""
        symbol = self._symbols.get(count)
        if symbol is None:
            symbol = self._symbols[count] = self.net(mx.sym.var("data"),
                                                     [mx.sym.var(f"param{i}") for i in range(count)], F=mx.sym)
        return symbol

    def __call__(self, X, params):
        op, inputs = self.graphs.get(X.context, X.shape, params,
                                     lambda: cached_graph(self.symbol_for(len(params)), ("data",), static=self.static))
        return op(*[X if name == "data" else params[int(name[5:])] for name in inputs])

    def __repr__(self):
        return f"CachedNet({getattr(self.net, '__name__', self.net)!r})"


#: LeNet as a cached graph: same values and gradients as ``lenet``, less per-operator overhead.
lenet_cached = CachedNet(lenet)


#: Per-example softmax cross-entropy of (logits, integer labels); returns shape (batch,).
softmax_cross_entropy = gluon.loss.SoftmaxCrossEntropyLoss()
