"""Communication between contexts: copy parameters to a context, and allreduce.

``allreduce`` leaves the elementwise *sum* of all arrays in every array (not the mean): the SGD step
divides by the global batch size.
"""
import mxnet as mx
from mxnet import autograd

__all__ = ["get_params", "FlatReplica", "allreduce", "check_same_arrays", "ALLREDUCE_ALGORITHMS",
           "DEFAULT_ALGORITHM"]


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

    Calling ``attach_grad()`` on a member would give it a separate gradient and break the link.
    """

    def __init__(self, views, data, grad):
        super().__init__(views)
        self.data = data
        self.grad = grad


def get_params(params, ctx):
    """Copy ``params`` to ``ctx`` with gradients attached, all in one flat buffer.

    Parameters
    ----------
    params : list of NDArray
        Parameters on any context; they are not modified.
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


def check_same_arrays(arrays, name="arrays"):
    """Check that ``arrays`` are NDArrays of one shape and dtype on distinct contexts.

    Raises
    ------
    TypeError, ValueError
        Naming the offending index.
    """
    if not isinstance(arrays, (list, tuple)) or not arrays:
        raise TypeError(f"{name} must be a non-empty list of NDArrays, got {arrays!r}")
    first = arrays[0]
    seen = {}
    for i, array in enumerate(arrays):
        if not isinstance(array, mx.nd.NDArray):
            raise TypeError(f"{name}[{i}] must be an NDArray, got {type(array).__name__}")
        if array.shape != first.shape:
            raise ValueError(f"{name}[{i}] has shape {array.shape} but {name}[0] has {first.shape}; "
                             "allreduce needs one shape")
        if array.dtype != first.dtype:
            raise ValueError(f"{name}[{i}] has dtype {array.dtype.__name__} but {name}[0] has "
                             f"{first.dtype.__name__}; allreduce needs one dtype")
        if array.context in seen:
            raise ValueError(f"{name}[{i}] and {name}[{seen[array.context]}] are both on {array.context}; "
                             "allreduce needs one array per context")
        seen[array.context] = i


def _naive(arrays):
    """The textbook: add every array into the first one, then copy the sum back to the others."""
    total = arrays[0]
    for array in arrays[1:]:
        total += array.copyto(total.context)   # runs on the first context
    for array in arrays[1:]:
        total.copyto(array)                    # broadcast: one copy per other context


def _fused(arrays):
    """One reduction: gather copies on the first context, sum them with one add_n, broadcast back."""
    ctx = arrays[0].context
    mx.nd.add_n(*[arrays[0]] + [array.copyto(ctx) for array in arrays[1:]], out=arrays[0])
    for array in arrays[1:]:
        arrays[0].copyto(array)


ALLREDUCE_ALGORITHMS = {"naive": _naive, "fused": _fused}

#: The algorithm ``train_batch`` and the CLI use unless told otherwise: the fastest measured
#: (see benchmarks/); ``allreduce`` itself defaults to the textbook's.
DEFAULT_ALGORITHM = "fused"


def allreduce(arrays, algorithm="naive"):
    """Sum ``arrays`` elementwise, in place: afterwards every array holds the sum of all of them.

    Parameters
    ----------
    arrays : list of NDArray
        One array per context, all of one shape and dtype. Modified in place.
    algorithm : str
        One of ``ALLREDUCE_ALGORITHMS``. ``"naive"`` (the textbook) adds each array into ``arrays[0]``
        one by one, then broadcasts back; ``"fused"`` sums all copies with one ``add_n``.

    Returns
    -------
    list of NDArray
        ``arrays`` itself. The work is queued on MXNet's engine: the call does not block; reading an
        array (``asnumpy()``) waits for it.
    """
    check_same_arrays(arrays)
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; choose one of "
                         f"{', '.join(sorted(ALLREDUCE_ALGORITHMS))}")
    if len(arrays) > 1:
        ALLREDUCE_ALGORITHMS[algorithm](arrays)
    return arrays
