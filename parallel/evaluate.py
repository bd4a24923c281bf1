"""Accuracy of a replicated model, computed on all contexts."""
import mxnet as mx

from .model import lenet
from .split import split_and_load

__all__ = ["evaluate_accuracy"]


def evaluate_accuracy(data_iter, device_params, ctx_list, net=lenet):
    """Fraction of correct argmax predictions over ``data_iter``.

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
        ``net(X, params)`` returns the outputs.

    Returns
    -------
    float
        Accuracy in [0, 1]. Blocks once, at the end, to read the count.
    """
    if len(device_params) != len(ctx_list):
        raise ValueError(f"device_params has {len(device_params)} replicas but ctx_list has "
                         f"{len(ctx_list)} contexts")
    correct = mx.nd.zeros((1,), ctx=ctx_list[0])
    total = 0
    for X, y in data_iter:
        for X_shard, y_shard, params in zip(split_and_load(X, ctx_list), split_and_load(y, ctx_list),
                                            device_params):
            out = net(X_shard, params)
            correct += (out.argmax(axis=1) == y_shard.astype(out.dtype)).sum().as_in_context(ctx_list[0])
        total += X.shape[0]
    if total == 0:
        raise ValueError("data_iter yielded no examples")
    return float(correct.asscalar()) / total
