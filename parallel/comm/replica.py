"""Replicas: a model's parameters copied to a context with their gradients, in one flat buffer.

``get_params(params, ctx)`` is the textbook's first step of data parallelism: copy the parameters to a context
and attach gradients; ``allreduce_grads`` sums the replicas' gradients. Here the copies are views into one flat buffer (a ``FlatReplica``, still a list), so one
allreduce and one fused update move the whole model. A gluon block is replicated the same way
(``block_state`` reads its arrays, by role).
"""
import mxnet as mx
from mxnet import autograd, gluon

from . import DEFAULT_ALGORITHM
from .algorithms import allreduce

__all__ = ["FlatReplica", "get_params", "block_state", "allreduce_grads", "grads_of"]


class FlatReplica(list):
    """The parameters of one replica: a list of arrays that are views into one flat buffer.

    It is a list, so the textbook code (``for param in params: ...``) works unchanged; besides, the
    whole replica is reachable at once, which is what makes one reduction and one update per step
    possible (like DDP's buckets and Horovod's tensor fusion).

    Attributes
    ----------
    data : NDArray
        1-D buffer holding every parameter; ``self[i]`` is a reshaped view of a slice of it.
    grad : NDArray
        1-D buffer holding every gradient; ``self[i].grad`` is the matching view of it.

    names : list of str
        The parameters' names, for a replica of a gluon block (``get_params(block, ctx)``); else empty.
    aux : list of NDArray
        The block's arrays that are not trained (BatchNorm's running statistics, frozen parameters),
        copies on the same context, in ``aux_names``' order; empty for a list of arrays.

    Calling ``attach_grad()`` on a member would give it a separate gradient and break the link.
    """

    def __init__(self, views, data, grad, names=(), aux=(), aux_names=()):
        super().__init__(views)
        self.data = data
        self.grad = grad
        self.names = list(names)
        self.aux = list(aux)
        self.aux_names = list(aux_names)


def get_params(params, ctx):
    """Copy ``params`` to ``ctx`` with gradients attached, all in one flat buffer.

    Parameters
    ----------
    params : list of NDArray, or mxnet.gluon.Block
        Parameters on any context; they are not modified. A gluon block (initialized, run once so that
        its shapes are known) gives its trainable parameters, in its registration order, and keeps the
        others (BatchNorm's running statistics) as copies in the replica's ``aux``.
    ctx : mxnet.Context
        Where the copies live.

    Returns
    -------
    FlatReplica or list of NDArray
        New arrays on ``ctx`` (gradients start at zero). When all ``params`` share one dtype they are
        views into one buffer (a ``FlatReplica``, still a list); otherwise a plain list of copies.
    """
    if not isinstance(ctx, mx.Context):
        raise TypeError(f"ctx must be an mxnet Context such as mx.cpu(0), got {ctx!r}")
    if isinstance(params, gluon.Block):
        names, arrays, aux_names, aux = block_state(params)
        if len({array.dtype for array in arrays}) > 1:
            raise ValueError("the block's trainable parameters have several dtypes; cast the block to one "
                             "(block.cast(dtype)) to replicate it in one flat buffer")
        replica = get_params(arrays, ctx)
        return FlatReplica(replica, replica.data, replica.grad, names, [a.copyto(ctx) for a in aux], aux_names)
    for i, param in enumerate(params):
        if not isinstance(param, mx.nd.NDArray):
            raise TypeError(f"params[{i}] must be an NDArray, got {type(param).__name__}")
    if not params or len({param.dtype for param in params}) != 1:
        copies = [param.copyto(ctx) for param in params]
        for copy in copies:
            copy.attach_grad()
        return copies
    data = mx.nd.concat(*[param.reshape(-1) for param in params], dim=0).copyto(ctx)
    grad = mx.nd.zeros(data.shape, ctx=ctx, dtype=data.dtype)
    views, grads, offset = [], [], 0
    for param in params:   # basic slices and reshapes of an NDArray share its memory
        views.append(data[offset:offset + param.size].reshape(param.shape))
        grads.append(grad[offset:offset + param.size].reshape(param.shape))
        offset += param.size
    autograd.mark_variables(views, grads)
    return FlatReplica(views, data, grad)


def block_state(block):
    """The arrays of an initialized gluon block, by role: ``(names, arrays, aux_names, aux_arrays)``.

    ``names``/``arrays`` are the trainable parameters (``grad_req != "null"``), ``aux_names``/``aux_arrays``
    the rest (BatchNorm's running statistics, frozen parameters), each in the block's registration order.
    The arrays are the block's own (first context's) data, not copies.

    Raises
    ------
    TypeError
        ``block`` is not a gluon ``Block``.
    ValueError
        A parameter is not initialized, or its shape is not known yet (deferred initialization).
    """
    if not isinstance(block, gluon.Block):
        raise TypeError(f"expected a gluon Block, got {type(block).__name__}")
    names, arrays, aux_names, aux_arrays = [], [], [], []
    for param in block.collect_params().values():
        try:
            data = param.list_data()[0]
        except (RuntimeError, mx.MXNetError) as error:   # not initialized, or deferred (shape unknown)
            raise ValueError(f"parameter {param.name} of the block has no value yet ({type(error).__name__}): "
                             "call block.initialize() and run the block once on an example batch, "
                             "e.g. block(X[:1]), so that gluon knows every shape") from None
        if param.grad_req == "null":
            aux_names.append(param.name)
            aux_arrays.append(data)
        else:
            names.append(param.name)
            arrays.append(data)
    return names, arrays, aux_names, aux_arrays


def allreduce_grads(device_params, algorithm=DEFAULT_ALGORITHM, active=None, compressor=None):
    """Sum the replicas' gradients, in place: afterwards every replica's ``param.grad`` holds the sum.

    Parameters
    ----------
    device_params : list of list of NDArray
        One replica per context (from ``get_params``).
    algorithm : str
        See ``parallel.comm.allreduce``. Flat replicas (``FlatReplica``) are reduced in one call over their
        gradient buffers, unless ``"naive"``: one call per tensor, as in the textbook.
    active : int, optional
        Replicas ``active..`` computed nothing this step (a batch smaller than the number of replicas):
        their gradients are zeroed first, so they contribute nothing and stale gradients never leak in.
    compressor : parallel.compress.Compressor, optional
        Move compressed payloads between the contexts instead of the flat gradient buffers, with error
        feedback (``parallel.compress.compressed_allreduce``); flat replicas only.
    """
    flat = all(isinstance(params, FlatReplica) for params in device_params)
    for params in device_params[len(device_params) if active is None else active:]:
        for grad in grads_of(params):
            grad[:] = 0
    if compressor is not None and len(device_params) > 1:
        if not flat:
            raise ValueError("compression works on flat replicas: build them with get_params from parameters of "
                             "one dtype, or train without compression")
        compressor.reduce([params.grad for params in device_params], algorithm,
                          [param.shape for param in device_params[0]])
    elif flat and algorithm != "naive":            # the whole model in one reduction
        allreduce([params.grad for params in device_params], algorithm)
    else:                                          # the textbook: one reduction per tensor
        for i in range(len(device_params[0])):
            allreduce([params[i].grad for params in device_params], algorithm)


def grads_of(params):
    """A replica's gradient buffers: ``[params.grad]`` for a ``FlatReplica`` (one buffer), else each array's."""
    return [params.grad] if isinstance(params, FlatReplica) else [param.grad for param in params]
