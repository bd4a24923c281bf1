"""Model parallelism: LeNet cut into stages, each stage on its own context.

A *stage* is a run of consecutive layers of ``parallel.models.LENET_LAYERS`` (conv1, conv2, dense1, dense2).
Stage boundaries are layer indices: ``boundaries=[2]`` makes the stages [0, 2) and [2, 4) (the convolutional
part, then the dense part); ``stages=N`` splits the four layers as evenly as possible. Stage ``s`` runs on
``ctx_list[s]``; its output is copied to the next stage's context inside ``autograd.record()``, where MXNet
records the copy, so the backward pass sends gradients back across the same contexts:

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

Only one stage computes at a time (stage s+1 waits for stage s): the point is to fit a model that does not
fit on one device, not speed. ``parallel.strategies.pipeline`` overlaps the stages with micro-batches.
"""
from mxnet import autograd

from ..comm import get_params
from ..evaluate import accuracy
from ..models import LENET_LAYERS, LENET_SHAPES, lenet_layers, softmax_cross_entropy
from ..settings import DEFAULT_STAGES
from ..split import shard_sizes
from ..step import check_lr, loss_and_correct, update_replicas
from ._checks import check_batch, check_contexts, is_int

__all__ = ["stage_ranges", "forward_stages", "ModelParallel"]



def stage_ranges(stages=None, boundaries=None, num_layers=len(LENET_LAYERS)):
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
        Layers in the model (LeNet's four by default).

    Returns
    -------
    list of (int, int)
        ``[(0, b1), (b1, b2), ..., (bn, num_layers)]``: consecutive, non-empty, covering every layer.

    Raises
    ------
    ValueError, TypeError
        For more stages than layers, a boundary outside the model, unsorted or repeated boundaries.
    """
    if stages is not None and boundaries is not None:
        raise ValueError(f"give stages or boundaries, not both (got stages={stages!r}, "
                         f"boundaries={list(boundaries)!r})")
    if boundaries is None:
        stages = DEFAULT_STAGES if stages is None else stages
        if not is_int(stages):
            raise TypeError(f"stages must be an int, got {stages!r}")
        if not 1 <= stages <= num_layers:
            raise ValueError(f"{stages} stages cannot split LeNet's {num_layers} layers; "
                             f"use 1 to {num_layers} stages")
        cuts, start = [], 0
        for size in shard_sizes(num_layers, stages)[:-1]:
            start += size
            cuts.append(start)
    else:
        cuts = list(boundaries)
        for b in cuts:
            if not is_int(b):
                raise TypeError(f"stage boundaries must be layer indices (ints), got {b!r}")
            if not 1 <= b < num_layers:
                raise ValueError(f"stage boundary {b} is outside LeNet's {num_layers} layers; a boundary b "
                                 f"cuts before layer b, so use values in 1..{num_layers - 1}")
        if any(a >= b for a, b in zip(cuts, cuts[1:])):
            raise ValueError(f"stage boundaries {cuts} must be strictly increasing without repeats, "
                             f"e.g. {sorted(set(cuts))}")
    edges = [0] + [int(b) for b in cuts] + [num_layers]
    return list(zip(edges[:-1], edges[1:]))


def _describe(ranges):
    """'conv1,conv2 | dense1,dense2': the layer names of each stage."""
    return " | ".join(",".join(name for name, _ in LENET_LAYERS[start:stop]) for start, stop in ranges)


def forward_stages(X, stage_params, ranges):
    """Run ``X`` through the stages; each stage runs on the context of its parameters.

    Parameters
    ----------
    X : NDArray
        Images (batch, 1, 28, 28) on any context; they are copied to the first stage's context.
    stage_params : list of list of NDArray
        ``stage_params[s]`` holds the parameters of layers ``ranges[s]``, all on one context.
    ranges : list of (int, int)
        From ``stage_ranges``.

    Returns
    -------
    NDArray
        Logits (batch, 10) on the last stage's context. Inside ``autograd.record()`` the copies between
        contexts are recorded, so ``backward`` sends each stage's input gradient back to the previous
        stage's context. Nothing waits for the devices.
    """
    for params, (start, stop) in zip(stage_params, ranges):
        X = lenet_layers(X.as_in_context(params[0].context), params, start, stop)
    return X


class ModelParallel:
    """LeNet cut into stages, stage ``s`` on ``ctx_list[s]``, trained with the same SGD step as ``train_batch``.

    Parameters
    ----------
    params : list of NDArray
        LeNet's eight parameters (``init_lenet_params``); copied, not modified.
    ctx_list : list of mxnet.Context
        Distinct contexts, at least one per stage; stage ``s`` lives on ``ctx_list[s]`` and contexts beyond
        the number of stages are not used.
    stages, boundaries
        Where to cut, see ``stage_ranges`` (default: two stages, [0, 2) and [2, 4)).

    Attributes
    ----------
    ranges : list of (int, int)
        The layer range of each stage.
    ctx_list : list of mxnet.Context
        The contexts used, one per stage.
    stage_params : list of list of NDArray
        ``stage_params[s]``: the parameters of stage ``s`` on ``ctx_list[s]``, gradients attached
        (from ``get_params``). Updated in place by ``train_step``.
    """

    def __init__(self, params, ctx_list, stages=None, boundaries=None):
        if len(params) != len(LENET_SHAPES):
            raise ValueError(f"params has {len(params)} arrays but LeNet takes {len(LENET_SHAPES)}; "
                             "use init_lenet_params")
        self.ranges = stage_ranges(stages, boundaries)
        check_contexts(ctx_list, len(self.ranges), f"{len(self.ranges)} stages")
        self.ctx_list = list(ctx_list[:len(self.ranges)])
        self.stage_params = [get_params(params[2 * start:2 * stop], ctx)
                             for (start, stop), ctx in zip(self.ranges, self.ctx_list)]

    def __repr__(self):
        return f"{type(self).__name__}({self.describe()})"

    def describe(self):
        """One line: the stages and where they run, e.g. 'conv1,conv2 @ cpu(0) | dense1,dense2 @ cpu(1)'."""
        return " | ".join(f"{names} @ {ctx}" for names, ctx in
                          zip(_describe(self.ranges).split(" | "), self.ctx_list))

    def params(self):
        """LeNet's eight parameters in ``LENET_SHAPES`` order: the live arrays, each on its stage's context."""
        return [param for params in self.stage_params for param in params]

    def forward(self, X):
        """Logits of ``X`` on the last stage's context (see ``forward_stages``)."""
        return forward_stages(X, self.stage_params, self.ranges)

    def __call__(self, X):
        return self.forward(X)

    def update(self, lr, batch_size):
        """SGD on every stage, in place: ``param -= lr * param.grad / batch_size`` (``update_replicas``)."""
        update_replicas(self.stage_params, lr, batch_size)

    def _train_parts(self, X_parts, y_parts, lr, batch_size, loss):
        """Forward every part (recorded), then one backward over all of their losses, then one update.

        ``autograd.backward`` over the list of losses sums each parameter's gradient over the parts: the
        gradient of the whole batch, as on one context.
        """
        with autograd.record():
            outputs = [self.forward(X_part) for X_part in X_parts]
            losses = [loss(out, y_part) for out, y_part in zip(outputs, y_parts)]
        autograd.backward(losses)
        self.update(lr, batch_size)
        return loss_and_correct(outputs, y_parts, losses, self.ctx_list[0])

    def train_step(self, X, y, lr, loss=softmax_cross_entropy):
        """One SGD step on the whole batch: forward through the stages, backward, update every stage.

        Parameters
        ----------
        X, y : NDArray
            A batch of images and labels (any context, any batch size >= 1).
        lr : float
            Learning rate; the summed gradient is divided by ``len(X)``, as in ``train_batch``.
        loss : callable
            ``loss(outputs, y)`` returns per-example losses.

        Returns
        -------
        (NDArray, NDArray)
            Summed loss and count of correct predictions, each (1,) on ``ctx_list[0]``, not yet computed.
            ``stage_params`` are updated in place.
        """
        check_lr(lr)
        check_batch(X, y, loss)
        return self._train_parts([X], [y.as_in_context(self.ctx_list[-1])], lr, X.shape[0], loss)

    def evaluate(self, data_iter):
        """Accuracy over ``data_iter``, whole batches through the stages (see ``parallel.evaluate.accuracy``)."""
        return accuracy(data_iter, [self.forward], self.ctx_list[:1])
