"""The ``topk`` codec: the largest elements by magnitude with their indices; the rest kept as error feedback."""
import math

import mxnet as mx

from .codec import Codec

__all__ = ["TopK"]


class TopK(Codec):
    """The ``ratio`` of the elements largest in magnitude (at least one), as int32 indices and float32 values.
    Over the workers the payloads are all-gathered (indices as float32, exact below 2**24) and added in rank
    order."""

    name = "topk"

    def __init__(self, ratio):
        super().__init__()
        self.ratio = float(ratio)

    @property
    def spec(self):
        return f"topk:{self.ratio:g}"

    def k(self, size):
        """How many elements of a buffer of ``size`` are sent: ``ceil(ratio * size)``, at least one."""
        return max(1, min(size, math.ceil(self.ratio * size)))

    def encode(self, x, shapes=None):
        indices = mx.nd.topk(mx.nd.abs(x), k=self.k(x.size), ret_typ="indices", dtype="int32")
        return [indices, mx.nd.take(x, indices)]

    def decode(self, payload, out, shapes=None):
        indices, values = payload
        out[:] = mx.nd.scatter_nd(values, indices.reshape((1, -1)), shape=out.shape)

    def payload_nbytes(self, size, shapes=None):
        return 8 * self.k(size)

    def _across(self, comm, e, residual, shapes):
        """An all-gather through the servers (``comm.allgather``): every worker's indices and values, added in
        rank order by every worker."""
        if e.size > 2 ** 24:
            raise ValueError(f"topk across workers sends indices as float32, exact up to 2**24 elements; this "
                             f"buffer has {e.size}: use a smaller bucket_mb")
        k = self.k(e.size)
        indices, values = self.encode(e)
        self.decode([indices, values], residual)
        mx.nd.elemwise_sub(e, residual, out=residual)
        pieces = comm.allgather(mx.nd.concat(indices.astype(e.dtype), values, dim=0), part=1)
        dense = []
        for piece in pieces:
            out = mx.nd.empty(e.shape, ctx=e.context, dtype=e.dtype)
            self.decode([piece[:k].astype("int32"), piece[k:]], out)
            dense.append(out)
        mx.nd.add_n(*dense, out=e)

    def across_nbytes(self, size, num_workers, shapes=None):
        return 8 * self.k(size) * num_workers
