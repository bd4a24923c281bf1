"""The ``2bit`` codec: MXNet's threshold scheme, +t, -t or 0 an element, twelve two-bit codes to a float32."""
import math

import mxnet as mx
import numpy as np

from .codec import Codec, matmul_t

__all__ = ["TwoBit", "CODES"]

#: Two-bit codes per float32 of a 2bit payload: 4**12 = 2**24, float32's exact integers (MXNet's own packs 16).
CODES = 12


class TwoBit(Codec):
    """MXNet's two-bit scheme: an element of ``e`` at least ``threshold`` is sent as ``+threshold``, one at most
    ``-threshold`` as ``-threshold``, the rest as 0; the residual keeps the difference. Twelve codes travel in one
    float32 (1/12 of the bytes), a value below 2**24 that a kvstore server can add to zero exactly."""

    name = "2bit"

    def __init__(self, threshold):
        super().__init__()
        self.threshold = float(threshold)
        self._weights = {}

    @property
    def spec(self):
        return f"2bit:{self.threshold:g}"

    def _powers(self, ctx):
        if ctx not in self._weights:
            self._weights[ctx] = mx.nd.array(4.0 ** np.arange(CODES), ctx=ctx)
        return self._weights[ctx]

    def encode(self, x):
        codes = (x >= self.threshold) + 2 * (x <= -self.threshold)   # 0, 1 (+t) or 2 (-t)
        pad = -x.size % CODES
        if pad:
            codes = mx.nd.concat(codes, mx.nd.zeros((pad,), ctx=x.context, dtype=x.dtype), dim=0)
        return [pack(codes.reshape((-1, CODES)), self._powers(x.context))]   # exact: integers < 2**24

    def decode(self, payload, out):
        powers = self._powers(out.context).reshape((1, CODES))
        shifted = mx.nd.floor(mx.nd.broadcast_div(payload[0].reshape((-1, 1)), powers))
        codes = (shifted - 4 * mx.nd.floor(shifted / 4)).reshape((-1,))[:out.size]
        mx.nd.elemwise_sub(codes == 1, codes == 2, out=out)
        out *= self.threshold

    def payload_nbytes(self, size, shapes=None):
        return 4 * math.ceil(size / CODES)

    def _across(self, comm, e, residual, shapes):
        """The servers add the workers' codes themselves: each sends ``q + 1`` (``q`` in -1, 0, 1) as digits of
        base ``B = 2W + 1`` packed into float32 integers below 2**24, so the servers' sum of the packed values is
        the packed sum of the digits, with no carry (each digit sum is at most 2W). Every worker unpacks
        ``sum(q) = digits - W`` and sends ``threshold * sum(q)``."""
        t, w = self.threshold, comm.num_workers
        q = (e >= t) - (e <= -t)
        mx.nd.elemwise_sub(e, q * t, out=residual)
        base, per = digits(w)
        powers = mx.nd.array(float(base) ** np.arange(per), ctx=e.context)
        codes = q + 1
        pad = -e.size % per
        if pad:
            codes = mx.nd.concat(codes, mx.nd.zeros((pad,), ctx=e.context, dtype=e.dtype), dim=0)
        packed = pack(codes.reshape((-1, per)), powers)
        comm.allsum(packed, part=1)
        shifted = mx.nd.floor(mx.nd.broadcast_div(packed.reshape((-1, 1)), powers.reshape((1, per))))
        sums = (shifted - base * mx.nd.floor(shifted / base)).reshape((-1,))[:e.size]
        mx.nd.elemwise_mul(sums - w, mx.nd.full(sums.shape, t, ctx=e.context, dtype=e.dtype), out=e)

    def across_nbytes(self, size, num_workers, shapes=None):
        """Bytes each worker pushes (and pulls) in ``across``."""
        return 4 * math.ceil(size / digits(num_workers)[1])


def digits(num_workers):
    """The base ``2W + 1`` of the summable two-bit digits and how many fit in a float32's 24-bit integers."""
    base = 2 * num_workers + 1
    return base, max(1, int(math.floor(24 * math.log(2) / math.log(base) + 1e-9)))


def pack(codes, powers):
    """Each row of ``codes`` (N x c) dotted with ``powers`` (c,): exact, the values being integers below 2**24."""
    return matmul_t(codes, powers.reshape((1, -1))).reshape((-1,))
