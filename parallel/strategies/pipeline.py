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
across its replicas) train the one-context model. Without BatchNorm the pipeline is exact.
"""
from ..models import softmax_cross_entropy
from ..settings import DEFAULT_MICRO_BATCHES
from ..split import split_and_load
from ..step import check_lr
from ._checks import is_int
from .model_parallel import ModelParallel

__all__ = ["Pipeline", "bubble_fraction", "DEFAULT_MICRO_BATCHES"]


def _check_micro_batches(micro_batches):
    if not is_int(micro_batches):
        raise TypeError(f"micro_batches must be an int, got {micro_batches!r}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")


def bubble_fraction(stages, micro_batches):
    """GPipe's idle fraction ``(K-1)/(M+K-1)`` for K ``stages`` and M ``micro_batches``.

    Returns
    -------
    float
        0 for one stage; tends to 0 as M grows.
    """
    _check_micro_batches(micro_batches)
    if not is_int(stages) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
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

    Attributes
    ----------
    micro_batches : int
    ranges, ctx_list, stage_params
        As for ``ModelParallel``.
    """

    def __init__(self, model, ctx_list, stages=None, boundaries=None, micro_batches=DEFAULT_MICRO_BATCHES):
        _check_micro_batches(micro_batches)
        super().__init__(model, ctx_list, stages, boundaries)
        self.micro_batches = int(micro_batches)

    def describe(self):
        """One line: the stages, where they run, and the number of micro-batches."""
        return f"{super().describe()}, {self.micro_batches} micro-batches"

    def bubble_fraction(self):
        """``(K-1)/(M+K-1)`` for this pipeline's K stages and M micro-batches."""
        return bubble_fraction(len(self.ranges), self.micro_batches)

    def train_step(self, X, y, lr, loss=softmax_cross_entropy, micro_batches=None):
        """One SGD step on the batch, computed in micro-batches; the same step as ``train_batch`` (but for
        BatchNorm, which normalises each micro-batch).

        Parameters
        ----------
        X, y : NDArray
            A batch of images and labels with at least ``micro_batches`` examples.
        lr : float
            Learning rate; the gradient summed over every micro-batch is divided by ``len(X)``.
        loss : callable
            ``loss(outputs, y)`` returns per-example losses.
        micro_batches : int, optional
            Overrides ``self.micro_batches`` for this step (e.g. a short last batch of an epoch).

        Returns
        -------
        (NDArray, NDArray)
            Summed loss and count of correct predictions, each (1,) on ``ctx_list[0]``, not yet computed.
            ``stage_params`` are updated in place.

        Raises
        ------
        ValueError
            When the batch has fewer examples than micro-batches.
        """
        check_lr(lr)
        self._check_batch(X, y, loss)
        m = self.micro_batches if micro_batches is None else micro_batches
        _check_micro_batches(m)
        if m > X.shape[0]:
            raise ValueError(f"a batch of {X.shape[0]} examples cannot form {m} micro-batches; "
                             f"use at most {X.shape[0]} micro-batches or a larger batch")
        # split_and_load over M copies of one context: M micro-batches, sizes differing by at most one
        X_parts = split_and_load(X, [self.ctx_list[0]] * m)
        y_parts = split_and_load(y, [self.ctx_list[-1]] * m)
        return self._train_parts(X_parts, y_parts, lr, X.shape[0], loss, y)
