"""Accuracy of a model spread over contexts (and workers), computed on all of them: each shard is scored on its
own context, by its own replica."""
import functools

import mxnet as mx

from .job import sum_values, worker_slice
from .models.gluon import as_net
from .models.lenet import lenet_cached
from .split import split_and_load

__all__ = ["accuracy", "evaluate_accuracy"]


def accuracy(data_iter, predictors, ctx_list, job=None, collective=False):
    """Fraction of correct argmax predictions over ``data_iter``, each batch split over the predictors.

    Parameters
    ----------
    data_iter : iterable of (NDArray, NDArray)
        Batches of inputs and labels.
    predictors : list of callable, or callable
        ``predictors[i](X_shard)`` returns the logits of a shard that lives on ``ctx_list[i]``, on any
        context (model parallelism returns them on its last stage's context); or one function of every shard at
        once, ``predictors(X_shards)`` -> their logits (a strategy whose replicas compute in lockstep).
    ctx_list : list of mxnet.Context
        Where each predictor takes its input; the correct counts are summed on ``ctx_list[0]``.
    job : parallel.job.Job, optional
        In a distributed job, every worker scores its slice of each batch (``worker_slice``, as in training)
        and the counts are summed over the workers: every worker returns the same accuracy. Every worker
        must call it, with the same batches.
    collective : bool
        In a job, a function of every shard is called for every batch, also with no shard (a worker without an
        example): its forward makes collectives (ZeRO-3's gathers).

    Returns
    -------
    float
        Accuracy in [0, 1]. Blocks once, at the end, to read the count.
    """
    if not callable(predictors) and len(predictors) != len(ctx_list):
        raise ValueError(f"{len(predictors)} predictors but ctx_list has {len(ctx_list)} contexts; "
                         "give one per context")
    predict = predictors if callable(predictors) else functools.partial(_each, predictors)
    correct = mx.nd.zeros((1,), ctx=ctx_list[0])
    total = 0
    for X, y in data_iter:
        total += X.shape[0]
        if job is not None:
            start, stop = worker_slice(X.shape[0], len(ctx_list), job.rank, job.num_workers)
            if start == stop:
                if collective:
                    predict([])
                continue
            X, y = X[start:stop], y[start:stop]
        for out, y_shard in zip(predict(split_and_load(X, ctx_list)), split_and_load(y, ctx_list)):
            right = out.argmax(axis=1) == y_shard.as_in_context(out.context).astype(out.dtype)
            correct += right.sum().astype(correct.dtype).as_in_context(ctx_list[0])
    if total == 0:
        raise ValueError("data_iter yielded no examples")
    correct = float(correct.asscalar())
    if job is not None:   # the workers' counts
        correct = sum_values(job, [correct])[0]
    return correct / total


def evaluate_accuracy(data_iter, device_params, ctx_list, net=lenet_cached, job=None):
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
        (``lenet_cached``), ``net=lenet`` runs op by op. A gluon block runs as ``GluonNet(block)``, with
        BatchNorm's running statistics (identical on every replica after synchronized training).
    job : parallel.job.Job, optional
        In a distributed job: each worker scores its slice of each batch and the counts are summed over the
        workers, so every worker returns the same accuracy (see ``accuracy``).

    Returns
    -------
    float
        Accuracy in [0, 1]. Blocks once, at the end, to read the count.
    """
    if len(device_params) != len(ctx_list):
        raise ValueError(f"device_params has {len(device_params)} replicas but ctx_list has "
                         f"{len(ctx_list)} contexts")
    net = as_net(net)
    predictors = [functools.partial(_apply, net, params) for params in device_params]
    return accuracy(data_iter, predictors, ctx_list, job)


def _apply(net, params, X):
    return net(X, params)


def _each(predictors, X_shards):
    return [predict(X) for predict, X in zip(predictors, X_shards)]
