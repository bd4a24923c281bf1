"""Split a batch across contexts."""
import mxnet as mx
import numpy as np

__all__ = ["split_and_load", "shard_sizes"]


def shard_sizes(n, k):
    """Sizes of the shards of ``n`` examples over ``k`` contexts.

    The first ``n % k`` shards get one example more, so sizes differ by at most one. When ``n < k``
    only ``n`` shards of one example exist: a context cannot run an empty shard.

    Returns
    -------
    list of int
        ``min(n, k)`` positive sizes summing to ``n``.
    """
    if n < 1:
        raise ValueError("cannot split an empty batch (0 examples); give at least one example")
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
    """
    if not ctx_list:
        raise ValueError("ctx_list is empty; give at least one context")
    if isinstance(data, np.ndarray):
        data = mx.nd.array(data, dtype=data.dtype)
    if not isinstance(data, mx.nd.NDArray):
        raise TypeError(f"data must be an NDArray or numpy array, got {type(data).__name__}")
    if data.ndim == 0:
        raise ValueError("data is a scalar; split_and_load needs an array with an example axis")
    shards, start = [], 0
    for size, ctx in zip(shard_sizes(data.shape[0], len(ctx_list)), ctx_list):
        shards.append(data[start:start + size].as_in_context(ctx))
        start += size
    return shards
