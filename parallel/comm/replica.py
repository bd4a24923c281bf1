"""Replicas: a model's parameters copied to a context with their gradients, in one flat buffer, the gradients in
buckets.

``get_params(params, ctx)`` is the textbook's first step of data parallelism: copy the parameters to a context
and attach gradients; ``allreduce_grads`` sums the replicas' gradients. Here the copies are views into one flat
buffer (a ``FlatReplica``, still a list), so one update moves the whole model, and the gradients are views into
*buckets*: a few flat buffers, each holding the gradients of a run of consecutive parameters, the last
parameters in the first bucket (``bucket_ranges``). A bucket is its own array, so MXNet's engine knows when its
gradients are written: its reduction can start while the backward pass still computes the earlier layers
(``parallel.comm.reducer``, as PyTorch DDP's buckets). A gluon block is replicated the same way (``block_state``
reads its arrays, by role).

>>> bucket_ranges([100, 10, 2000, 20], itemsize=4, bucket_bytes=1000)   # elements of four parameters
[(3, 4), (2, 3), (0, 2)]
"""
from typing import NamedTuple

import mxnet as mx
from mxnet import autograd, gluon

from ..job import FlatParams
from ..validate import check_number

__all__ = ["Replica", "FlatReplica", "Bucket", "get_params", "bucket_ranges", "bucket_bytes", "block_state", "data_of",
           "is_split", "grads_of", "names_of", "aux_of", "aux_names_of"]


def bucket_bytes(bucket_mb, name="bucket_mb"):
    """``bucket_mb`` (MiB, > 0, as PyTorch DDP's ``bucket_cap_mb``) in bytes, or None for None (one bucket)."""
    if bucket_mb is None:
        return None
    return max(1, int(check_number(bucket_mb, name, positive=True) * 2 ** 20))


def bucket_ranges(sizes, itemsize, bucket_bytes):
    """The buckets of parameters with ``sizes`` elements each: ``(first, stop)`` index ranges in the order their
    gradients are reduced, the *last* parameters first (backward computes them first).

    A bucket takes parameters from the end while it holds at most ``bucket_bytes`` (a parameter larger than that
    gets a bucket of its own); ``bucket_bytes=None``: one bucket of every parameter.
    """
    if bucket_bytes is None or not sizes:
        return [(0, len(sizes))]
    buckets, stop, nbytes = [], len(sizes), 0
    for i in reversed(range(len(sizes))):
        size = sizes[i] * itemsize
        if stop > i + 1 and nbytes + size > bucket_bytes:
            buckets.append((i + 1, stop))
            stop, nbytes = i + 1, 0
        nbytes += size
    buckets.append((0, stop))
    return buckets


class Bucket(NamedTuple):
    """Where a bucket of a ``FlatReplica`` lies: its parameters ``first .. stop - 1`` and their elements
    ``start .. end - 1`` of the flat ``data`` buffer (its gradient buffer holds ``end - start`` elements)."""
    first: int
    stop: int
    start: int
    end: int


class Replica(list):
    """A replica's trained arrays (a list) that knows the block they copy: the one declared kind of replica besides a
    plain list of arrays, which is a replica without names and without other arrays. Code reads these members
    through ``names_of``, ``aux_of`` and ``aux_names_of``, which give a plain list's defaults; it never asks an
    object whether it has them.

    Attributes
    ----------
    names : list of str or None
        The trained arrays' parameter names; None when they are not known.
    aux : list of NDArray
        The block's arrays that are not trained (BatchNorm's running statistics), in ``aux_names``' order.
    aux_names : list of str
        Their parameter names (may be empty where only ``aux`` is carried).
    """

    def __init__(self, arrays, names=None, aux=(), aux_names=()):
        super().__init__(arrays)
        self.names, self.aux, self.aux_names = names, list(aux), list(aux_names)


class FlatReplica(Replica, FlatParams):
    """The parameters of one replica: a list of arrays that are views into one flat buffer, their gradients views
    into the buffers of a few buckets.

    It is a list (a ``Replica``, and the ``parallel.job.FlatParams`` a job broadcasts), so the textbook code
    (``for param in params: ...``) works unchanged; besides, the
    whole replica is reachable at once, which is what makes one reduction a bucket and one update per step
    possible (like DDP's buckets and Horovod's tensor fusion).

    Attributes
    ----------
    data : NDArray
        1-D buffer holding every parameter; ``self[i]`` is a reshaped view of a slice of it.
    buckets : list of Bucket
        The buckets, in the order they are reduced (the last parameters first).
    grads : list of NDArray
        One 1-D gradient buffer per bucket; ``self[i].grad`` is a view into its bucket's.
    grad : NDArray
        The gradient buffer when there is one bucket (``get_params``' default); with several, use ``grads``.
    names : list of str
        The parameters' names, for a replica of a gluon block (``get_params(block, ctx)``); else empty.
    aux : list of NDArray
        The block's arrays that are not trained (BatchNorm's running statistics, frozen parameters),
        copies on the same context, in ``aux_names``' order; empty for a list of arrays.
    copies : set of int
        The indices of arrays that a replica of another group holds as well (tensor parallelism's replicated
        arrays, on every rank but the first): a global norm over the groups counts them once. Empty by default.
    uncounted : list of (int, int)
        The same as element ranges of ``data`` (sorted): what a norm over shards of the buffer leaves out (ZeRO-2
        and 3). Empty by default.

    pieces : list of NDArray or None
        After ``split_parameters()``: one parameter buffer a bucket, the members views into them (a cross
        barrier's); ``data`` is then a copy the update keeps equal to them. None before.

    Calling ``attach_grad()`` on a member would give it a separate gradient and break the link.
    """

    def __init__(self, views, data, grads, buckets, names=(), aux=(), aux_names=()):
        super().__init__(views, list(names), aux, aux_names)
        self.data = data
        self.grads = list(grads)
        self.buckets = list(buckets)
        self.copies, self.uncounted = set(), []
        self.pieces = None

    def split_parameters(self):
        """Give each bucket's parameters a buffer of their own (``pieces``), with the values ``data`` holds, and make
        the members views into them: MXNet orders operations by the arrays they read and write, and every view of
        ``data`` is one array to it, so a forward pass reading the first layers would wait for every bucket's update;
        reading its bucket's piece, it waits for that bucket's alone (a *cross barrier*, BytePS's). ``data`` stays
        the copy that checkpoints, broadcasts and norms read: the update (``parallel.optim``) writes each piece,
        then copies it into ``data``. Call it before anything keeps the members (a strategy's blocks); a second
        call does nothing."""
        if self.pieces is not None:   # split already
            return
        pieces = [self.data[layout.start:layout.end].copy() for layout in self.buckets]
        views, grads = list(self), [param.grad for param in self]
        for layout, piece in zip(self.buckets, pieces):
            offset = 0
            for i in range(layout.first, layout.stop):
                size = views[i].size
                views[i] = piece[offset:offset + size].reshape(views[i].shape)
                offset += size
        autograd.mark_variables(views, grads)
        self[:] = views
        self.pieces = pieces

    @property
    def grad(self):
        if len(self.grads) != 1:
            raise AttributeError(f"this replica's gradients lie in {len(self.grads)} buckets, not one buffer; use "
                                 ".grads (one buffer a bucket) or each parameter's .grad")
        return self.grads[0]


def get_params(params, ctx, bucket_mb=None):
    """Copy ``params`` to ``ctx`` with gradients attached, all in one flat buffer.

    Parameters
    ----------
    params : list of NDArray, or mxnet.gluon.Block
        Parameters on any context; they are not modified. A gluon block (initialized, run once so that
        its shapes are known) gives its trainable parameters, in its registration order, and keeps the
        others (BatchNorm's running statistics) as copies in the replica's ``aux``.
    ctx : mxnet.Context
        Where the copies live.
    bucket_mb : float, optional
        Lay the gradients out in buckets of at most this many MiB (``bucket_ranges``), each its own buffer, so
        that a ``Reducer`` can sum a bucket while backward still runs; None (the default): one gradient buffer.

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
        replica = get_params(arrays, ctx, bucket_mb)
        return FlatReplica(replica, replica.data, replica.grads, replica.buckets, names,
                           [a.copyto(ctx) for a in aux], aux_names)
    for i, param in enumerate(params):
        if not isinstance(param, mx.nd.NDArray):
            raise TypeError(f"params[{i}] must be an NDArray, got {type(param).__name__}")
    limit = bucket_bytes(bucket_mb)
    if not params or len({param.dtype for param in params}) != 1:
        copies = [param.copyto(ctx) for param in params]
        for copy in copies:
            copy.attach_grad()
        return copies
    data = mx.nd.concat(*[param.reshape(-1) for param in params], dim=0).copyto(ctx)
    offsets = [0]
    for param in params:
        offsets.append(offsets[-1] + param.size)
    buckets = [Bucket(first, stop, offsets[first], offsets[stop])
               for first, stop in bucket_ranges([p.size for p in params], data.dtype(0).itemsize, limit)]
    grads = [mx.nd.zeros((b.end - b.start,), ctx=ctx, dtype=data.dtype) for b in buckets]
    views, grad_views = [None] * len(params), [None] * len(params)
    for b, grad in zip(buckets, grads):   # basic slices and reshapes of an NDArray share its memory
        for i in range(b.first, b.stop):
            views[i] = data[offsets[i]:offsets[i + 1]].reshape(params[i].shape)
            grad_views[i] = grad[offsets[i] - b.start:offsets[i + 1] - b.start].reshape(params[i].shape)
    autograd.mark_variables(views, grad_views)
    return FlatReplica(views, data, grads, buckets)


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


def data_of(params):
    """A replica's parameter arrays: ``[params.data]`` for a ``FlatReplica`` (its one flat buffer), else each
    array."""
    return [params.data] if isinstance(params, FlatReplica) else list(params)


def is_split(params):
    """Whether a replica's parameters lie in one buffer a bucket (``FlatReplica.split_parameters``, a cross
    barrier's): its ``pieces``, besides the flat ``data`` the update keeps equal to them."""
    return isinstance(params, FlatReplica) and params.pieces is not None


def grads_of(params):
    """A replica's gradient buffers: ``params.grads`` for a ``FlatReplica`` (one a bucket), else each array's."""
    return list(params.grads) if isinstance(params, FlatReplica) else [param.grad for param in params]


def names_of(params):
    """A replica's parameter names: ``params.names`` for a ``Replica`` (None when not known), None for a plain list."""
    return params.names if isinstance(params, Replica) else None


def aux_of(params):
    """A replica's arrays that are not trained, a new list: ``params.aux`` for a ``Replica``, ``[]`` for a plain
    list."""
    return list(params.aux) if isinstance(params, Replica) else []


def aux_names_of(params):
    """The names of ``aux_of(params)``, a new list: ``params.aux_names`` for a ``Replica``, ``[]`` for a plain list."""
    return list(params.aux_names) if isinstance(params, Replica) else []
