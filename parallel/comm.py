"""Communication between contexts: copy parameters to a context, and allreduce.

``allreduce`` leaves the elementwise *sum* of all arrays in every array (not the mean): the SGD step
divides by the global batch size.
"""
import math
import numbers
from collections import namedtuple

import mxnet as mx
from mxnet import autograd

from .settings import DEFAULT_ALGORITHM

__all__ = ["get_params", "FlatReplica", "allreduce", "check_same_arrays", "ALLREDUCE_ALGORITHMS",
           "DEFAULT_ALGORITHM", "bytes_moved", "BytesMoved"]


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


def _copy(src, dst):
    """Copy ``src`` to ``dst`` (a Context: returns a new array there; an NDArray: fills it, returns it).

    Every copy between contexts in the algorithms below goes through here, so a test can count the
    bytes they move. Queued on the engine; does not block.
    """
    return src.copyto(dst)


def _naive(arrays):
    """The textbook: add every array into the first one, then copy the sum back to the others."""
    total = arrays[0]
    for array in arrays[1:]:
        total += _copy(array, total.context)   # runs on the first context
    for array in arrays[1:]:
        _copy(total, array)                    # broadcast: one copy per other context


def _fused(arrays):
    """One reduction: gather copies on the first context, sum them with one add_n, broadcast back."""
    ctx = arrays[0].context
    mx.nd.add_n(*[arrays[0]] + [_copy(array, ctx) for array in arrays[1:]], out=arrays[0])
    for array in arrays[1:]:
        _copy(arrays[0], array)


def _chunk_bounds(n, k):
    """``k + 1`` offsets cutting ``n`` elements into ``k`` chunks whose sizes differ by at most one.

    The first ``n % k`` chunks get one element more; with ``n < k`` the last chunks are empty.
    """
    base, extra = divmod(n, k)
    bounds = [0]
    for i in range(k):
        bounds.append(bounds[-1] + base + (i < extra))
    return bounds


def _ring(arrays):
    """Ring allreduce: reduce-scatter, then all-gather, over the flat arrays cut into K chunks.

    Context ``i`` only ever sends to context ``i + 1`` (mod K). In round ``s = 0 .. K-2`` of the
    *reduce-scatter*, context ``i`` sends chunk ``i - s`` (mod K) and the receiver adds it into its own
    copy of that chunk; afterwards context ``i`` holds the full sum of chunk ``i + 1``. In round ``s`` of
    the *all-gather*, context ``i`` sends chunk ``i + 1 - s``, now complete, and the receiver overwrites
    its copy: every context ends with the very same bits, each chunk summed once, in one order.
    Each context sends (and receives) ``2 (K-1) / K`` of the array, whatever K: bandwidth-optimal.
    """
    k = len(arrays)
    bounds = _chunk_bounds(arrays[0].size, k)
    chunks = [[flat[a:b] if a < b else None    # views; with fewer elements than K some chunks are empty
               for a, b in zip(bounds, bounds[1:])] for flat in [array.reshape(-1) for array in arrays]]
    for s in range(k - 1):                     # reduce-scatter
        for i in range(k):
            c, dst = (i - s) % k, (i + 1) % k
            if chunks[i][c] is not None:
                chunks[dst][c] += _copy(chunks[i][c], arrays[dst].context)   # the add runs on dst
    for s in range(k - 1):                     # all-gather
        for i in range(k):
            c, dst = (i + 1 - s) % k, (i + 1) % k
            if chunks[i][c] is not None:
                _copy(chunks[i][c], chunks[dst][c])


def _tree(arrays):
    """Tree allreduce: pairwise sums in ceil(log2 K) rounds, then a broadcast down the same tree.

    In reduction round ``r`` (stride ``2**r``), context ``i`` with ``i % 2**(r+1) == 0`` receives the
    partial sum of context ``i + 2**r`` (if it exists) and adds it to its own, so context 0 ends with the
    total. The broadcast replays the rounds backwards: context ``i`` copies the total to ``i + 2**r``.
    K need not be a power of two. Context 0 sends and receives ``ceil(log2 K)`` whole arrays.
    """
    k = len(arrays)
    strides = []
    while 2 ** len(strides) < k:
        strides.append(2 ** len(strides))
    for stride in strides:                            # reduce: pairs at distance `stride`
        for i in range(0, k - stride, 2 * stride):
            arrays[i] += _copy(arrays[i + stride], arrays[i].context)
    for stride in reversed(strides):                  # broadcast: the same pairs, backwards
        for i in range(0, k - stride, 2 * stride):
            _copy(arrays[i], arrays[i + stride])


#: The algorithms by name; ``parallel.settings.ALLREDUCE_NAMES`` lists the same names for the CLI, before MXNet loads.
ALLREDUCE_ALGORITHMS = {"naive": _naive, "fused": _fused, "ring": _ring, "tree": _tree}

BytesMoved = namedtuple("BytesMoved", ["total", "per_context_max"])
BytesMoved.__doc__ = """Bytes an allreduce copies between contexts.

total : int
    Sum of the sizes of all copies between contexts (each copy counted once).
per_context_max : int
    The busiest context's traffic: the maximum over contexts of max(bytes it sends, bytes it
    receives). With one full-duplex link per context (GPUs) this bounds the time; on one machine's
    shared memory ``total`` does.
"""


def bytes_moved(algorithm, nbytes, k, itemsize=4):
    """Bytes that ``allreduce(arrays, algorithm)`` copies between contexts, for K arrays of ``nbytes``.

    With ``n = nbytes``: ``naive`` and ``fused`` move ``2 (K-1) n`` in total (K-1 arrays in, K-1 out
    of the first context, which is the busiest: ``(K-1) n`` each way); ``tree`` moves ``2 (K-1) n`` too,
    but its busiest context (the root) sends and receives ``ceil(log2 K) n``; ``ring`` moves
    ``2 (K-1) n`` as well, spread evenly: each context sends and receives ``2 (K-1) n / K``
    (exactly so when the element count is a multiple of K; otherwise chunks differ by one element).
    Sums are not counted, only copies. K = 1 moves nothing.

    Parameters
    ----------
    algorithm : str
        One of ``ALLREDUCE_ALGORITHMS``.
    nbytes : int
        Size of one array in bytes (``array.size * itemsize``).
    k : int
        Number of contexts, >= 1.
    itemsize : int
        Bytes per element (4 for float32): the ring cuts at element boundaries.

    Returns
    -------
    BytesMoved
        ``(total, per_context_max)`` in bytes.
    """
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; choose one of "
                         f"{', '.join(sorted(ALLREDUCE_ALGORITHMS))}")
    for name, value, low in (("nbytes", nbytes, 0), ("k", k, 1), ("itemsize", itemsize, 1)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if nbytes % itemsize:
        raise ValueError(f"nbytes={nbytes} is not a whole number of {itemsize}-byte elements; "
                         "give nbytes = array.size * itemsize")
    n, total = nbytes, 2 * (k - 1) * nbytes
    if k == 1:
        return BytesMoved(0, 0)
    if algorithm == "ring":   # context i sends every chunk but i+1 (reduce-scatter) and i+2 (all-gather)
        bounds = _chunk_bounds(n // itemsize, k)
        sizes = [(b - a) * itemsize for a, b in zip(bounds, bounds[1:])]
        return BytesMoved(total, 2 * n - min(sizes[(i + 1) % k] + sizes[(i + 2) % k] for i in range(k)))
    if algorithm == "tree":
        return BytesMoved(total, math.ceil(math.log2(k)) * n)
    return BytesMoved(total, (k - 1) * n)




def allreduce(arrays, algorithm="naive"):
    """Sum ``arrays`` elementwise, in place: afterwards every array holds the sum of all of them.

    Parameters
    ----------
    arrays : list of NDArray
        One array per context, all of one shape and dtype. Modified in place.
    algorithm : str
        One of ``ALLREDUCE_ALGORITHMS``. ``"naive"`` (the textbook) adds each array into ``arrays[0]``
        one by one, then broadcasts back; ``"fused"`` sums all copies with one ``add_n``; ``"ring"``
        (reduce-scatter + all-gather in chunks) and ``"tree"`` (pairwise sums in log2 K rounds) spread
        the copies over all contexts. ``bytes_moved`` says how many bytes each copies.

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
