"""Communication between contexts: copy parameters to a context, and allreduce.

``allreduce`` leaves the elementwise *sum* of all arrays in every array (not the mean): the SGD step
divides by the global batch size.
"""
import mxnet as mx

__all__ = ["get_params", "allreduce", "check_same_arrays", "ALLREDUCE_ALGORITHMS"]


def get_params(params, ctx):
    """Copy ``params`` to ``ctx`` and attach a gradient buffer to each copy.

    Parameters
    ----------
    params : list of NDArray
        Parameters on any context; they are not modified.
    ctx : mxnet.Context
        Where the copies live.

    Returns
    -------
    list of NDArray
        New arrays on ``ctx`` with ``attach_grad()`` done (gradients start at zero).
    """
    if not isinstance(ctx, mx.Context):
        raise TypeError(f"ctx must be an mxnet Context such as mx.cpu(0), got {ctx!r}")
    copies = []
    for i, param in enumerate(params):
        if not isinstance(param, mx.nd.NDArray):
            raise TypeError(f"params[{i}] must be an NDArray, got {type(param).__name__}")
        copy = param.copyto(ctx)
        copy.attach_grad()
        copies.append(copy)
    return copies


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


ALLREDUCE_ALGORITHMS = {"naive": _naive}


def allreduce(arrays, algorithm="naive"):
    """Sum ``arrays`` elementwise, in place: afterwards every array holds the sum of all of them.

    Parameters
    ----------
    arrays : list of NDArray
        One array per context, all of one shape and dtype. Modified in place.
    algorithm : str
        One of ``ALLREDUCE_ALGORITHMS``. ``"naive"`` reduces onto ``arrays[0]`` and broadcasts back.

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
