"""Model parallelism: a model cut into stages, each stage on its own context.

A *stage* is a run of consecutive layers: of ``parallel.models.LENET_LAYERS`` (conv1, conv2, dense1, dense2)
for LeNet's parameter list, or of the children of a gluon ``HybridSequential`` (``init_resnet18()`` has seven:
stem, four stages of residual blocks, pooling, classifier; ``init_vit()`` six: patch embedding, four Transformer
blocks, head). Stage boundaries are layer (child) indices:
``boundaries=[2]`` makes the stages [0, 2) and [2, 4) (LeNet's convolutional part, then its dense part);
``stages=N`` splits the layers as evenly as possible. Stage ``s`` runs on ``ctx_list[s]``; its output is copied
to the next stage's context inside ``autograd.record()``, where MXNet records the copy, so the backward pass
sends gradients back across the same contexts:

>>> import mxnet as mx
>>> from parallel import init_lenet_params
>>> from parallel.strategies import ModelParallel
>>> model = ModelParallel(init_lenet_params(seed=0), [mx.cpu(0), mx.cpu(1)], boundaries=[2])
>>> model
ModelParallel(conv1,conv2 @ cpu(0) | dense1,dense2 @ cpu(1))
>>> X, y = mx.nd.ones((8, 1, 28, 28)), mx.nd.array([0, 1, 2, 3, 4, 5, 6, 7])
>>> loss_sum, correct = model.train_step(X, y, lr=0.2)   # the same step as train_batch on one context
>>> loss_sum.shape, loss_sum.context
((1,), cpu(0))

A gluon block is cut at its children; each stage is a ``HybridSequential`` of its children, run as one cached
graph (``GluonNet``) on a flat replica of its own parameters (``get_params(stage, ctx)``). The whole batch
goes through every stage, so BatchNorm sees the whole batch: the same model as one context.

>>> from parallel import init_resnet18
>>> ModelParallel(init_resnet18(seed=0), [mx.cpu(0), mx.cpu(1)], boundaries=[3])
ModelParallel(children 0-2 @ cpu(0) | 3-6 @ cpu(1))

Only one stage computes at a time (stage s+1 waits for stage s): the point is to fit a model that does not
fit on one device, not speed. ``parallel.strategies.pipeline`` overlaps the stages with micro-batches.
"""
from ..comm.replica import get_params
from ..evaluate import accuracy
from ..models.lenet import LENET_LAYERS, LenetStage, softmax_cross_entropy
from ..models.registry import behaviour_of
from ..split import shard_sizes
from ..step import step_replicas
from ..validate import BadValue, check_contexts, check_int
from . import DEFAULT_STAGES

__all__ = ["stage_ranges", "forward_stages", "ModelParallel", "MicroBatches"]


def _unsharded(optimizer, strategy):
    """``optimizer``, refused when it asks to shard state that the ``strategy`` never replicates."""
    if optimizer is not None and getattr(optimizer, "zero", 0):
        raise ValueError(f"zero={optimizer.zero} shards replicated state, but the {strategy} strategy holds one copy "
                         f"of each stage, with its optimizer state, on its own context; use zero=0")
    return optimizer


def stage_ranges(stages=None, boundaries=None, num_layers=len(LENET_LAYERS), what=None, unit="layer"):
    """The layer range ``(start, stop)`` of each stage.

    Parameters
    ----------
    stages : int, optional
        Number of stages, 1 .. ``num_layers``; the layers are split as evenly as possible, earlier stages
        taking the extra layer (``shard_sizes``). Defaults to ``DEFAULT_STAGES`` when ``boundaries`` is None.
    boundaries : sequence of int, optional
        Layer indices where a new stage starts, strictly increasing, each in 1 .. ``num_layers - 1``:
        boundary ``b`` cuts between layer ``b - 1`` and layer ``b``. ``[]`` is one stage.
        Give ``stages`` or ``boundaries``, not both.
    num_layers : int
        Layers in the model (LeNet's four by default; a ``HybridSequential``'s ``len(block)`` children).
    what, unit : str
        How error messages name the model's layers (default "LeNet's 4 layers") and one of them ("layer").

    Returns
    -------
    list of (int, int)
        ``[(0, b1), (b1, b2), ..., (bn, num_layers)]``: consecutive, non-empty, covering every layer.

    Raises
    ------
    ValueError, TypeError
        For more stages than layers, a boundary outside the model, unsorted or repeated boundaries.
    """
    what = f"LeNet's {num_layers} layers" if what is None else what
    if stages is not None and boundaries is not None:
        raise BadValue("stages", "{stages} and {boundaries} both say where to cut; give one of them")
    if boundaries is None:
        stages = check_int(DEFAULT_STAGES if stages is None else stages, "stages")
        if not 1 <= stages <= num_layers:
            raise BadValue("stages", f"{{stages={stages}|{stages} stages}} cannot split {what}; use 1 to {num_layers} "
                                     "stages")
        cuts, start = [], 0
        for size in shard_sizes(num_layers, stages)[:-1]:
            start += size
            cuts.append(start)
    else:
        cuts = list(boundaries)
        for i, b in enumerate(cuts):
            check_int(b, f"boundaries[{i}]")
            if not 1 <= b < num_layers:
                raise BadValue("boundaries", f"{{boundaries|stage boundary}} {b} is outside {what}; a boundary b cuts "
                                             f"before {unit} b, so use values in 1..{num_layers - 1}")
        if any(a >= b for a, b in zip(cuts, cuts[1:])):
            raise BadValue("boundaries", f"{{boundaries}} {cuts} must be strictly increasing without repeats, "
                                         f"e.g. {sorted(set(cuts))}")
    edges = [0] + [int(b) for b in cuts] + [num_layers]
    return list(zip(edges[:-1], edges[1:]))


def _cut(model, stages=None, boundaries=None):
    """``model`` cut into stages (a ``parallel.models.registry.Cut``), not yet placed: where its behaviour cuts
    it (``behaviour_of(model).layers``), at ``stage_ranges``."""
    behaviour = behaviour_of(model)
    return behaviour.cut(model, stage_ranges(stages, boundaries, *behaviour.layers(model)))


def _forward_all(net, X_shards, device_params):
    """``net`` on every shard, each on its replica's context: ``net.forward_all`` when it has one (a
    ``GluonNet``: BatchNorm over all the shards at once), else ``[net(X, params) for ...]``."""
    method = getattr(net, "forward_all", None)
    if method is not None:
        return method(X_shards, device_params)
    return [net(X, params) for X, params in zip(X_shards, device_params)]


def forward_stages(X, stage_params, ranges, nets=None):
    """Run ``X`` through the stages; each stage runs on the context of its parameters.

    Parameters
    ----------
    X : NDArray
        Inputs on any context (LeNet's images are (batch, 1, 28, 28)); copied to the first stage's context.
    stage_params : list of list of NDArray
        ``stage_params[s]`` holds the parameters of stage ``s`` (``ranges[s]``), all on one context.
    ranges : list of (int, int)
        From ``stage_ranges``.
    nets : list of callable, optional
        ``nets[s](X, params)`` runs stage ``s`` (``ModelParallel.nets``); default: LeNet's layers ``ranges[s]``.

    Returns
    -------
    NDArray
        Outputs (LeNet's logits (batch, 10)) on the last stage's context. Inside ``autograd.record()`` the
        copies between contexts are recorded, so ``backward`` sends each stage's input gradient back to the
        previous stage's context. Nothing waits for the devices.
    """
    nets = [LenetStage(start, stop) for start, stop in ranges] if nets is None else nets
    for net, params in zip(nets, stage_params):
        X = net(X.as_in_context(params[0].context), params)
    return X


class MicroBatches:
    """A model cut into stages, run on ``m`` micro-batches of each batch, as ``parallel.step.step_replicas``
    takes it: every micro-batch enters at the first stage's context and leaves at the last one's, through the
    same parameters, so there is nothing to reduce; one update for the whole batch."""

    def __init__(self, model, m):
        self.model = model
        self.in_ctx_list = [model.ctx_list[0]] * m
        self.out_ctx_list = [model.ctx_list[-1]] * m

    def forward_all(self, X_parts):
        return [self.model.forward(X) for X in X_parts]

    def aux(self, r):
        return []   # the micro-batches share one model: none is ever idle with its own statistics

    #: ``backward`` over all the parts' losses already sums each gradient over them: each stage is a group of one,
    #: which the default reducer leaves as it is.
    reducer = None
    job = None

    def groups(self):
        return self.model.groups()


class ModelParallel:
    """A model cut into stages, stage ``s`` on ``ctx_list[s]``, trained with the same step as ``train_batch``.

    Parameters
    ----------
    model : list of NDArray, or mxnet.gluon.nn.HybridSequential
        LeNet's eight parameters (``init_lenet_params``), cut at ``LENET_LAYERS``; or an initialized gluon
        ``HybridSequential`` whose shapes are known (run it once on an example batch), cut at its children:
        stage ``s`` is a ``HybridSequential`` of its children, run as one cached graph (``GluonNet``). Copied,
        not modified.
    ctx_list : list of mxnet.Context
        Distinct contexts, at least one per stage; stage ``s`` lives on ``ctx_list[s]`` and contexts beyond
        the number of stages are not used.
    stages, boundaries
        Where to cut, see ``stage_ranges`` (default: two stages; LeNet's [0, 2) and [2, 4)).

    Attributes
    ----------
    ranges : list of (int, int)
        The layer (child) range of each stage.
    ctx_list : list of mxnet.Context
        The contexts used, one per stage.
    nets : list of callable
        ``nets[s](X, params)`` runs stage ``s``.
    stage_params : list of list of NDArray
        ``stage_params[s]``: the parameters of stage ``s`` on ``ctx_list[s]``, gradients attached (from
        ``get_params``; for a block, a ``FlatReplica`` whose ``aux`` holds the stage's BatchNorm running
        statistics). Updated in place by ``train_step``.

    Raises
    ------
    TypeError
        For a model that is neither a list of arrays nor a ``HybridSequential``.
    ValueError
        For a list that is not LeNet's eight arrays, a block without known shapes or children, a bad layout
        (``stage_ranges``), too few contexts.
    """

    name = "model"
    job = None

    def __init__(self, model, ctx_list, stages=None, boundaries=None):
        self._place(_cut(model, stages, boundaries), ctx_list)

    @property
    def model(self):
        """What the training loop returns: the strategy itself (``params()``, ``aux()``, ``forward``)."""
        return self

    @classmethod
    def _from_cut(cls, cut, ctx_list, bucket_mb=None):
        """A ``ModelParallel`` of an existing cut (``Hybrid``'s replicas share one), each stage's gradients in
        buckets of at most ``bucket_mb`` MiB (one buffer for None)."""
        model = cls.__new__(cls)
        model._place(cut, ctx_list, bucket_mb)
        return model

    def _place(self, cut, ctx_list, bucket_mb=None):
        self._cut = cut
        self.ranges = cut.ranges
        self.nets = cut.nets
        check_contexts(ctx_list, needed=len(self.ranges), what=f"{len(self.ranges)} stages")
        self.ctx_list = list(ctx_list[:len(self.ranges)])
        self.stage_params = [get_params(source, ctx, bucket_mb) for source, ctx in zip(cut.sources, self.ctx_list)]

    def __repr__(self):
        return f"{type(self).__name__}({self.describe()})"

    def describe(self, accumulate=1):
        """One line: the stages and where they run, e.g. 'conv1,conv2 @ cpu(0) | dense1,dense2 @ cpu(1)' for
        LeNet, 'children 0-2 @ cpu(0) | 3-6 @ cpu(1)' for a block. ``accumulate`` (every strategy's ``describe``
        takes it) changes nothing here."""
        return " | ".join(f"{label} @ {ctx}" for label, ctx in zip(self._cut.labels, self.ctx_list))

    def params(self):
        """The model's trainable arrays, live, each on its stage's context: LeNet's eight in ``LENET_SHAPES``
        order, or a block's in the order of its trainable names (``block_state(block)[0]``, ``names()``)."""
        arrays = [param for params in self.stage_params for param in params]
        if not self._cut.names:   # the stages' arrays, one after the other, are the model's in order
            return arrays
        by_name = dict(zip([name for params in self.stage_params for name in params.names], arrays))
        return [by_name[name] for name in self._cut.names]

    def aux(self):
        """The block's arrays that are not trained (BatchNorm's running statistics), live, each on its stage's
        context, in ``aux_names()`` order (``block_state(block)[2]``); ``[]`` for LeNet."""
        by_name = {name: array for params in self.stage_params
                   for name, array in zip(getattr(params, "aux_names", ()), getattr(params, "aux", ()))}
        return [by_name[name] for name in self._cut.aux_names]

    def names(self):
        """The block's trainable parameter names, in ``params()`` order; ``[]`` for LeNet."""
        return list(self._cut.names)

    def aux_names(self):
        """The names of ``aux()``'s arrays; ``[]`` for LeNet."""
        return list(self._cut.aux_names)

    def forward(self, X):
        """Outputs of ``X`` on the last stage's context (see ``forward_stages``); outside ``autograd.record()``
        BatchNorm uses its running statistics."""
        return forward_stages(X, self.stage_params, self.ranges, self.nets)

    def __call__(self, X):
        return self.forward(X)

    def groups(self):
        """The trained arrays as ``parallel.optim.optimizer_step`` takes them: each stage a group of one replica
        (nothing is replicated, so nothing is summed; the optimizer's state lives with each stage)."""
        return [[params] for params in self.stage_params]

    def train_step(self, X, y, lr=None, loss=softmax_cross_entropy, optimizer=None, accumulate=1):
        """One optimizer step on the whole batch: forward through the stages, backward, update every stage.

        Parameters
        ----------
        X, y : NDArray
            A batch of inputs and labels (any context, any batch size >= 1).
        lr : float, optional
            Plain SGD at this rate; the summed gradient is divided by ``len(X)``, as in ``train_batch``.
        loss : callable
            ``loss(outputs, y)`` returns per-example losses.
        optimizer : parallel.optim.Optimizer, optional
            Instead of ``lr``: the update, its state kept with each stage on its context. Its ``zero`` must be
            0: nothing here is replicated, so there is nothing to shard.
        accumulate : int
            Micro-batches run one after another before the update (``parallel.step.step_replicas``).

        Returns
        -------
        (NDArray, NDArray)
            Summed loss and count of correct predictions, each (1,) on ``ctx_list[0]``, not yet computed.
            ``stage_params`` (and a block's running statistics) are updated in place.
        """
        return step_replicas(MicroBatches(self, 1), X, y, lr, loss, optimizer=_unsharded(optimizer, self.name),
                             accumulate=accumulate)

    def evaluate(self, data_iter):
        """Accuracy over ``data_iter``, whole batches through the stages (see ``parallel.evaluate.accuracy``)."""
        return accuracy(data_iter, [self.forward], self.ctx_list[:1])
