"""Accuracy of a model spread over contexts, computed on all of them."""
import functools

import mxnet as mx

from .model import lenet_cached
from .split import split_and_load

__all__ = ["accuracy", "evaluate_accuracy"]


def accuracy(data_iter, predictors, ctx_list):
    """Fraction of correct argmax predictions over ``data_iter``, each batch split over the predictors.

    Parameters
    ----------
    data_iter : iterable of (NDArray, NDArray)
        Batches of inputs and labels.
    predictors : list of callable
        ``predictors[i](X_shard)`` returns the logits of a shard that lives on ``ctx_list[i]``, on any
        context (model parallelism returns them on its last stage's context).
    ctx_list : list of mxnet.Context
        Where each predictor takes its input; the correct counts are summed on ``ctx_list[0]``.

    Returns
    -------
    float
        Accuracy in [0, 1]. Blocks once, at the end, to read the count.
    """
    if len(predictors) != len(ctx_list):
        raise ValueError(f"{len(predictors)} predictors but ctx_list has {len(ctx_list)} contexts; "
                         "give one per context")
    correct = mx.nd.zeros((1,), ctx=ctx_list[0])
    total = 0
    for X, y in data_iter:
        for X_shard, y_shard, predict in zip(split_and_load(X, ctx_list), split_and_load(y, ctx_list),
                                             predictors):
            out = predict(X_shard)
            right = out.argmax(axis=1) == y_shard.as_in_context(out.context).astype(out.dtype)
            correct += right.sum().as_in_context(ctx_list[0])
        total += X.shape[0]
    if total == 0:
        raise ValueError("data_iter yielded no examples")
    return float(correct.asscalar()) / total


def evaluate_accuracy(data_iter, device_params, ctx_list, net=lenet_cached):
    """Fraction of correct argmax predictions of a replicated model over ``data_iter``.

    Each batch is split across ``ctx_list`` and each shard is scored on its own context with its own
    replica, so evaluation uses every device, not only the first.

    Parameters
    ----------
    data_iter : iterable of (NDArray, NDArray)
        Batches of inputs and labels.
    device_params : list of list of NDArray
        One replica per context (all equal after ``train_batch``).
    ctx_list : list of mxnet.Context
    net : callable
        ``net(X, params)`` returns the outputs; the default is the cached graph training uses
        (``lenet_cached``), ``net=lenet`` runs op by op.

    Returns
    -------
    float
        Accuracy in [0, 1]. Blocks once, at the end, to read the count.
    """
    if len(device_params) != len(ctx_list):
        raise ValueError(f"device_params has {len(device_params)} replicas but ctx_list has "
                         f"{len(ctx_list)} contexts")
    predictors = [functools.partial(_apply, net, params) for params in device_params]
    return accuracy(data_iter, predictors, ctx_list)


def _apply(net, params, X):
    return net(X, params)
