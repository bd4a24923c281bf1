"""Split a batch across contexts: ``split_and_load`` copies shard ``i`` to context ``i``, any batch size, the
shards' sizes differing by at most one (``shard_sizes``)."""
import mxnet as mx
import numpy as np

from .mxnet_compat import host_array, rows
from .trace import issued

__all__ = ["split_and_load", "shard_sizes"]


def shard_sizes(n, k):
    """Sizes of the shards of ``n`` examples over ``k`` contexts.

    The first ``n % k`` shards get one example more, so sizes differ by at most one. When ``n < k``
    only ``n`` shards of one example exist: a context cannot run an empty shard.

    Returns
    -------
    list of int
        ``min(n, k)`` positive sizes summing to ``n``.

    Raises
    ------
    ValueError
        When ``n < 1`` or ``k < 1``.
    """
    if n < 1:
        raise ValueError("cannot split an empty batch (0 examples); give at least one example")
    if k < 1:
        raise ValueError(f"cannot split over {k} contexts; give at least one context")
    k = min(n, k)
    base, extra = divmod(n, k)
    return [base + 1 if i < extra else base for i in range(k)]


def split_and_load(data, ctx_list):
    """Split ``data`` along its first axis and copy shard ``i`` to ``ctx_list[i]``.

    Unlike the textbook (which asserts divisibility) and ``gluon.utils.split_and_load`` (which raises
    unless ``even_split=False``), any batch size works: shard sizes differ by at most one.

    Parameters
    ----------
    data : NDArray or numpy.ndarray
        A batch; its first axis is the example axis.
    ctx_list : list of mxnet.Context
        Where the shards go.

    Returns
    -------
    list of NDArray
        ``min(len(data), len(ctx_list))`` shards, shard ``i`` on ``ctx_list[i]``; a list even for one
        context. A batch with fewer examples than contexts leaves the trailing contexts without a shard.
        A shard already on its context is a view, not a copy (the one-context fast path).

    Raises
    ------
    ValueError
        For an empty batch (0 examples), examples that hold no values (a 0 in the trailing shape), a
        scalar, or an empty ``ctx_list``; checked before any MXNet call.
    TypeError
        When ``data`` is not an array or ``ctx_list`` is not a list of contexts.
    """
    if isinstance(ctx_list, mx.Context):
        raise TypeError(f"ctx_list must be a list of contexts, got the single context {ctx_list}; "
                        f"write [{ctx_list!r}]")
    if not ctx_list:
        raise ValueError("ctx_list is empty; give at least one context")
    for i, ctx in enumerate(ctx_list):
        if not isinstance(ctx, mx.Context):
            raise TypeError(f"ctx_list[{i}] must be an mxnet Context such as mx.cpu(0), got {ctx!r}")
    if not isinstance(data, (np.ndarray, mx.nd.NDArray)):
        raise TypeError(f"data must be an NDArray or numpy array, got {type(data).__name__}")
    # Check the shape before any MXNet call: MXNet's legacy shapes read a 0 as "unknown", so an empty
    # array fails inside MXNet with an unhelpful MXNetError.
    shape = tuple(data.shape)   # read once: each read of an NDArray's shape is a call into MXNet
    if not shape:
        raise ValueError("data is a scalar; split_and_load needs an array with an example axis")
    if shape[0] == 0:
        raise ValueError(f"cannot split an empty batch: data has shape {shape}, so 0 examples; "
                         "give at least one example")
    if 0 in shape:
        raise ValueError(f"data has shape {shape}: each example has a 0 in its shape and holds "
                         "no values; split_and_load needs examples with at least one value")
    if isinstance(data, np.ndarray):
        data = host_array(data, data.dtype)
    shards, start, here = [], 0, data.context
    with issued("load", lambda: [data]):   # a trace names the copies load (parallel.trace)
        for size, ctx in zip(shard_sizes(shape[0], len(ctx_list)), ctx_list):
            shard = data if size == shape[0] else rows(data, start, start + size)
            shards.append(shard if ctx == here else shard.copyto(ctx))
            start += size
    return shards
