"""How one array is laid out over the T ranks of a tensor-parallel group: its shard spec.

A spec is a small frozen value that says which part of an array each rank holds, independent of any model:

- ``Replicated()``: every rank holds the whole array (a layer norm's scale, a row-parallel layer's bias);
- ``Split(axis, parts=1, unit=1, flatten=False)``: the array is cut along ``axis`` (of its 2-D view
  ``(shape[0], -1)`` when ``flatten``: a convolution's weight seen as (channels, pixels)). With ``parts=P`` the
  axis is P equal consecutive parts (a fused query, key and value weight), each part cut the same way; within a
  part, blocks of ``unit`` elements (a head's width) are dealt to the ranks as
  ``parallel.comm.algorithms.chunk_bounds(blocks, T)`` deals them: consecutive runs, the first ranks one block
  more when they do not divide evenly.

Each spec answers the same four questions: ``indices(length, t, T)`` (rank ``t``'s indices along the axis),
``local_shape(shape, t, T)``, ``local(array, t, T)`` (rank ``t``'s part, a copy) and ``join(parts)`` (the whole
array back from the ranks' parts). A layer says how its parameters are split by giving their specs
(``parallel.models.layers``); what moves arrays between layouts (a checkpoint, an optimizer's state) needs only
the specs.

>>> qkv = Split(axis=0, parts=3, unit=2)   # 3 parts (q, k, v) of 2 heads of width 2
>>> qkv
Split(axis=0, parts=3, unit=2, flatten=False)
>>> [qkv.indices(12, t, 2).tolist() for t in range(2)]   # rank 0: head 0 of q, of k, of v
[[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]
>>> import numpy as np
>>> whole = np.arange(24.0).reshape(12, 2)
>>> parts = [qkv.local(whole, t, 2) for t in range(2)]
>>> parts[1].shape, parts[1].context, np.array_equal(qkv.join(parts).asnumpy(), whole)   # NDArrays: on the CPU
((6, 2), cpu(0), True)
"""
from dataclasses import dataclass

import mxnet as mx
import numpy as np

from .comm.algorithms import chunk_bounds
from .validate import BadValue, BadType, check_bool, check_int

__all__ = ["Replicated", "Split"]


def _check_rank(t, T):
    check_int(T, "T", low=1)
    check_int(t, "t", low=0, high=T - 1)


def _as_nd(array):
    """``array`` as an NDArray (a numpy array goes to the CPU); its own context kept."""
    if isinstance(array, mx.nd.NDArray):
        return array
    if isinstance(array, np.ndarray):
        return mx.nd.array(array, ctx=mx.cpu(), dtype=array.dtype)
    raise BadType("array", f"{{array}} must be an NDArray or a numpy array, got {type(array).__name__}")


def _check_parts(parts):
    if not isinstance(parts, (list, tuple)) or not parts:
        raise BadType("parts", f"{{parts}} must be a non-empty list of the ranks' arrays, got {parts!r}")
    for i, part in enumerate(parts):
        if not isinstance(part, (mx.nd.NDArray, np.ndarray)):
            raise BadType("parts", f"{{parts}}[{i}] must be an NDArray or a numpy array, got {type(part).__name__}")


def _host(part):
    return part.asnumpy() if isinstance(part, mx.nd.NDArray) else np.asarray(part)


@dataclass(frozen=True)
class Replicated:
    """Every rank holds the whole array.

    >>> spec = Replicated()
    >>> spec, spec.local_shape((3, 4), 1, 2), spec.indices(3, 1, 2).tolist()
    (Replicated(), (3, 4), [0, 1, 2])
    >>> spec.join([np.ones(2), np.ones(2)]).tolist()
    [1.0, 1.0]
    """

    def indices(self, length, t, T):
        """All ``length`` indices: rank ``t`` of ``T`` holds every one."""
        _check_rank(t, T)
        return np.arange(check_int(length, "length", low=0))

    def local_shape(self, shape, t, T):
        """``shape`` itself (as a tuple)."""
        _check_rank(t, T)
        return tuple(shape)

    def local(self, array, t, T):
        """A copy of the whole ``array`` (an NDArray on its context; a numpy array gives an NDArray on the CPU).
        Queued on the engine; does not block."""
        _check_rank(t, T)
        return _as_nd(array).copy()

    def join(self, parts, shape=None):
        """``parts[0]`` (every rank holds the same array); ``shape`` is not needed."""
        _check_parts(parts)
        return parts[0]


@dataclass(frozen=True)
class Split:
    """The array cut along ``axis`` over the ranks (see the module's docstring).

    Parameters
    ----------
    axis : int
        The axis cut (of the 2-D view when ``flatten``): 0 the rows, 1 the columns of a dense layer's weight.
    parts : int
        The axis is ``parts`` equal consecutive parts, each cut the same way (3 for a fused q, k, v weight).
    unit : int
        Blocks of ``unit`` consecutive elements of a part stay together on one rank (a head's width).
    flatten : bool
        Cut the array's 2-D view ``(shape[0], -1)`` (a convolution's weight as (channels, pixels)); its local
        part is then 2-D.

    >>> spec = Split(axis=1, flatten=True)   # a (2, 1, 2, 2) convolution weight: its 4 pixels over 3 ranks
    >>> [spec.local_shape((2, 1, 2, 2), t, 3) for t in range(3)]
    [(2, 2), (2, 1), (2, 1)]
    >>> weight = np.arange(8.0).reshape(2, 1, 2, 2)
    >>> parts = [spec.local(weight, t, 3).asnumpy() for t in range(3)]
    >>> parts[0].tolist(), spec.join(parts, shape=weight.shape).shape
    ([[0.0, 1.0], [4.0, 5.0]], (2, 1, 2, 2))
    """

    axis: int
    parts: int = 1
    unit: int = 1
    flatten: bool = False

    def __post_init__(self):
        check_int(self.axis, "axis")
        check_int(self.parts, "parts", low=1)
        check_int(self.unit, "unit", low=1)
        check_bool(self.flatten, "flatten")

    def blocks(self, length):
        """How many blocks of ``unit`` elements each of the ``parts`` parts of an axis of ``length`` holds: the most
        ranks that all get a block.

        Raises
        ------
        parallel.validate.BadValue
            ``length`` is not ``parts`` parts of whole blocks.
        """
        check_int(length, "length", low=0)
        if length % (self.parts * self.unit):
            raise BadValue("length", f"an axis of {{length={length}}} is not {self.parts} part(s) of blocks of "
                                     f"{self.unit}; give the spec the layer's parts and unit")
        return length // (self.parts * self.unit)

    def indices(self, length, t, T):
        """Rank ``t``'s indices (of ``T``) along an axis of ``length`` elements, in order: a numpy int64 array."""
        _check_rank(t, T)
        blocks = self.blocks(length)
        bounds, part = chunk_bounds(blocks, T), length // self.parts
        start, stop = bounds[t] * self.unit, bounds[t + 1] * self.unit
        return np.concatenate([np.arange(p * part + start, p * part + stop) for p in range(self.parts)]
                              ).astype(np.int64)

    def _view(self, shape):
        shape = tuple(shape)
        if self.flatten:
            shape = (shape[0], int(np.prod(shape[1:], dtype=np.int64))) if shape else shape
        if not -len(shape) <= self.axis < len(shape):
            raise BadValue("axis", f"{{axis={self.axis}}} is not an axis of an array of shape {shape}")
        return shape, self.axis % len(shape)

    def local_shape(self, shape, t, T):
        """The shape of rank ``t``'s part of an array of ``shape`` (2-D when ``flatten``)."""
        view, axis = self._view(shape)
        size = len(self.indices(view[axis], t, T))
        return view[:axis] + (size,) + view[axis + 1:]

    def local(self, array, t, T):
        """Rank ``t``'s part of ``array``: a new NDArray on the array's context (a numpy array gives one on the
        CPU), 2-D when ``flatten``. Queued on the engine; does not block."""
        array = _as_nd(array)
        view, axis = self._view(array.shape)
        indices = self.indices(view[axis], t, T)
        if not len(indices):   # more ranks than blocks: this one holds none (MXNet's take refuses no index)
            return mx.nd.empty(view[:axis] + (0,) + view[axis + 1:], ctx=array.context, dtype=array.dtype)
        index = mx.nd.array(indices, ctx=array.context, dtype="int64")
        return mx.nd.take(array.reshape(view), index, axis=axis)

    def join(self, parts, shape=None):
        """The whole array from the ranks' ``parts`` (rank ``t``'s at ``t``; NDArrays or numpy arrays): numpy
        parts give a numpy array, NDArrays an NDArray on the CPU. ``shape`` is the whole array's shape: a
        flattened split needs it to give the array back in its shape (else its 2-D view). Reads the parts:
        blocks until they are computed."""
        _check_parts(parts)
        host = [_host(part) for part in parts]
        T, axis = len(host), self.axis % host[0].ndim
        length = sum(part.shape[axis] for part in host)
        whole = np.empty(host[0].shape[:axis] + (length,) + host[0].shape[axis + 1:], dtype=host[0].dtype)
        for t, part in enumerate(host):
            index = [slice(None)] * whole.ndim
            index[axis] = self.indices(length, t, T)
            whole[tuple(index)] = part
        if shape is not None:
            whole = whole.reshape(tuple(shape))
        if all(isinstance(part, np.ndarray) for part in parts):
            return whole
        return mx.nd.array(whole, ctx=mx.cpu(), dtype=whole.dtype)
