"""Pipeline parallelism: micro-batches flow through model-parallel stages (GPipe's schedule).

The batch splits into M micro-batches (sizes differ by at most one, as ``shard_sizes`` splits). The host
queues every micro-batch's forward through every stage, then one backward over all M losses, which sums
each parameter's gradient over the micro-batches; then one SGD update for the batch. MXNet's engine runs
each context's work in order but different contexts concurrently, so stage s can work on micro-batch m+1
while stage s+1 works on micro-batch m. With K stages, each stage idles for K-1 of the M+K-1 slots of
the forward (and of the backward): the *bubble fraction* ``(K-1)/(M+K-1)``:

>>> import mxnet as mx
>>> from parallel import init_lenet_params
>>> from parallel.strategies import Pipeline
>>> model = Pipeline(init_lenet_params(seed=0), [mx.cpu(0), mx.cpu(1)], stages=2, micro_batches=4)
>>> X, y = mx.nd.ones((8, 1, 28, 28)), mx.nd.array([0, 1, 2, 3, 4, 5, 6, 7])
>>> loss_sum, correct = model.train_step(X, y, lr=0.2)   # the same step as train_batch on one context
>>> model.bubble_fraction()                              # (2-1) / (4+2-1)
0.2

The overlap needs stages that compute at the same time on separate hardware; CPU contexts that share the
same cores cannot (see benchmarks/pipeline.py).

BatchNorm. A gluon ``HybridSequential`` with BatchNorm (``init_resnet18()``) is *not* trained as on one
context: each micro-batch is normalised by its own mean and variance, and the running statistics are
updated once per micro-batch, as GPipe does. Gradients are then those of M smaller batches, not of the
batch; ``ModelParallel`` (the whole batch through each stage) and ``Hybrid`` (statistics synchronized
across its replicas) train the one-context model. Without BatchNorm (LeNet, the ViT) the pipeline is exact.
"""
from ..models.lenet import softmax_cross_entropy
from ..step import step_replicas
from ..validate import check_bool, check_int
from . import DEFAULT_MICRO_BATCHES
from .model import MicroBatches, ModelParallel, _unsharded

__all__ = ["Pipeline", "bubble_fraction"]


def _check_micro_batches(micro_batches):
    return check_int(micro_batches, "micro_batches", low=1)


def bubble_fraction(stages, micro_batches):
    """GPipe's idle fraction ``(K-1)/(M+K-1)`` for K ``stages`` and M ``micro_batches``.

    Returns
    -------
    float
        0 for one stage; tends to 0 as M grows.
    """
    _check_micro_batches(micro_batches)
    check_int(stages, "stages", low=1)
    return (stages - 1) / (micro_batches + stages - 1)


class Pipeline(ModelParallel):
    """``ModelParallel`` trained on micro-batches: all forwards, all backwards, one update per batch.

    The same step as ``train_batch`` on one context for LeNet and for blocks without BatchNorm; a block's
    BatchNorm normalises each micro-batch separately (see the module's docstring), so with BatchNorm it is
    another model.

    Parameters
    ----------
    model, ctx_list, stages, boundaries
        As for ``ModelParallel`` (LeNet's parameters or a gluon ``HybridSequential``): stage ``s`` on
        ``ctx_list[s]``.
    micro_batches : int
        M >= 1, micro-batches per batch. ``train_step`` refuses a batch with fewer than M examples.
    short_batches : bool
        True: a batch with fewer than M examples (an epoch's short last batch) runs in one micro-batch per
        example instead of being refused (what the training loop asks for).

    Attributes
    ----------
    micro_batches : int
    ranges, ctx_list, stage_params
        As for ``ModelParallel``.
    """

    name = "pipeline"

    def __init__(self, model, ctx_list, stages=None, boundaries=None, micro_batches=DEFAULT_MICRO_BATCHES,
                 short_batches=False):
        self.micro_batches = _check_micro_batches(micro_batches)
        self.short_batches = check_bool(short_batches, "short_batches")
        super().__init__(model, ctx_list, stages, boundaries)

    def describe(self, accumulate=1):
        """One line: the stages, where they run, and the number of micro-batches."""
        return f"{super().describe()}, {self.micro_batches} micro-batches"

    def bubble_fraction(self):
        """``(K-1)/(M+K-1)`` for this pipeline's K stages and M micro-batches."""
        return bubble_fraction(len(self.ranges), self.micro_batches)

    def train_step(self, X, y, lr=None, loss=softmax_cross_entropy, micro_batches=None, optimizer=None, accumulate=1):
        """One optimizer step on the batch, computed in micro-batches; the same step as ``train_batch`` (but for
        BatchNorm, which normalises each micro-batch).

        Parameters
        ----------
        X, y : NDArray
            A batch of images and labels with at least ``micro_batches`` examples.
        lr : float, optional
            Plain SGD at this rate; the gradient summed over every micro-batch is divided by ``len(X)``.
        loss : callable
            ``loss(outputs, y)`` returns per-example losses.
        micro_batches : int, optional
            Overrides ``self.micro_batches`` for this step (e.g. a short last batch of an epoch).
        optimizer : parallel.optim.Optimizer, optional
            Instead of ``lr`` (see ``ModelParallel.train_step``; ``zero`` must be 0).
        accumulate : int
            Parts of the batch run one after another, each pipelined in its micro-batches, before the update.

        Returns
        -------
        (NDArray, NDArray)
            Summed loss and count of correct predictions, each (1,) on ``ctx_list[0]``, not yet computed.
            ``stage_params`` are updated in place.

        Raises
        ------
        ValueError
            When the batch has fewer examples than micro-batches (unless ``short_batches``).
        """
        m = _check_micro_batches(self.micro_batches if micro_batches is None else micro_batches)
        if m > X.shape[0] >= 1:
            if not self.short_batches:
                raise ValueError(f"micro_batches={m} cannot split a batch of {X.shape[0]} examples; use at most "
                                 f"{X.shape[0]} micro-batches or a larger batch")
            m = X.shape[0]
        # M micro-batches through one model, sizes differing by at most one (split_and_load's split)
        return step_replicas(MicroBatches(self, m), X, y, lr, loss, optimizer=_unsharded(optimizer, self.name),
                             accumulate=accumulate)
