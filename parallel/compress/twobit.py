"""The ``2bit`` codec: MXNet's threshold scheme, +t, -t or 0 an element, twelve two-bit codes to a float32.

``2bit`` (the default) scales the threshold to the gradient: each tensor's ``t`` is the mean magnitude of what it
encodes (the gradient plus its residual), computed at every step on every context and worker, and what passes
it is sent as the mean magnitude of what passes, as 1-bit SGD scales by the mean magnitude; ``2bit:T`` keeps
MXNet's fixed threshold ``T``, sent as ``+-T`` (MXNet's default is 0.5).
"""
import math
import warnings

import mxnet as mx
import numpy as np

from .codec import Codec, matmul_t

__all__ = ["TwoBit", "CODES", "FAR"]

#: Two-bit codes per float32 of a 2bit payload: 4**12 = 2**24, float32's exact integers (MXNet's own packs 16).
CODES = 12


class TwoBit(Codec):
    """MXNet's two-bit scheme: an element of ``e`` at least ``t`` is sent as ``+t``, one at most ``-t`` as ``-t``,
    the rest as 0; the residual keeps the difference. Twelve codes travel in one float32 (1/12 of the bytes), a
    value below 2**24 that a kvstore server can add to zero exactly.

    ``threshold=None`` (``"2bit"``): each tensor of the buffer (``shapes``; None: the whole buffer) has its own
    threshold ``t = mean(|e|)`` over its elements (``e`` the gradient plus its residual), and what passes it is
    sent as ``+-v``, ``v`` the mean magnitude of the elements that pass (1-bit SGD sends each group as its mean);
    ``v`` follows the codes, one float32 a tensor, so whoever decodes a payload uses its sender's values and the
    sum of the decoded payloads is the sum of what each sender sent. A tensor's scale does not depend on the bucket
    it is in. A float (``"2bit:0.5"``): that fixed ``t`` on both sides, sent as ``+-t``, nothing more sent, as
    MXNet's ``kv.set_gradient_compression``; a first ``e`` whose mean magnitude is more than ``FAR`` times away
    from it is warned about, once.
    """

    name = "2bit"

    def __init__(self, threshold=None):
        super().__init__()
        self.threshold = None if threshold is None else float(threshold)
        self._cache = {}
        self._checked = False

    @property
    def spec(self):
        return "2bit" if self.threshold is None else f"2bit:{self.threshold:g}"

    def _powers(self, ctx):
        if ctx not in self._cache:
            self._cache[ctx] = mx.nd.array(4.0 ** np.arange(CODES), ctx=ctx)
        return self._cache[ctx]

    def _spread(self, scales, sizes, ctx):
        """Each tensor's scale repeated over its elements: a (size,) array (``scales`` itself for one tensor)."""
        if len(sizes) == 1:
            return scales
        key = (ctx, sizes)
        if key not in self._cache:   # which tensor each element belongs to
            self._cache[key] = mx.nd.array(np.repeat(np.arange(len(sizes)), sizes), ctx=ctx, dtype="int32")
        return mx.nd.take(scales, self._cache[key])

    def scales(self, e, shapes=None):
        """``(values, thresholds)`` for encoding ``e``: the fixed threshold twice (floats); scaled, each tensor's
        threshold ``mean(|e|)`` over its elements, spread over them (an array to compare ``e`` with), and each
        tensor's value (a (n,) array): the mean magnitude of its elements at or past the threshold, what they are
        sent as (0 for a tensor of zeros), as 1-bit SGD sends each group as its mean."""
        if self.threshold is not None:
            if not self._checked:
                self._checked = True
                warn_if_far(self.threshold, e)
            return self.threshold, self.threshold
        sizes = tensor_sizes(e.size, shapes)
        magnitudes = mx.nd.abs(e)
        means = self._per_tensor(magnitudes, sizes, mx.nd.mean)
        thresholds = self._spread(means, sizes, e.context)
        passed = mx.nd.broadcast_greater_equal(magnitudes, thresholds)
        counts = self._per_tensor(passed, sizes, mx.nd.sum)
        totals = self._per_tensor(magnitudes * passed, sizes, mx.nd.sum)
        return totals / mx.nd.maximum(counts, 1), thresholds

    @staticmethod
    def _per_tensor(x, sizes, reduce):
        """``reduce`` of each tensor's part of the flat ``x``, as a (n,) array."""
        parts, offset = [], 0
        for n in sizes:
            parts.append(reduce(x[offset:offset + n]).reshape((1,)))
            offset += n
        return parts[0] if len(parts) == 1 else mx.nd.concat(*parts, dim=0)

    def encode(self, x, shapes=None):
        values, t = self.scales(x, shapes)
        up, down = signs(x, t)
        codes = up + 2 * down                                         # 0, 1 (+t) or 2 (-t)
        pad = -x.size % CODES
        if pad:
            codes = mx.nd.concat(codes, mx.nd.zeros((pad,), ctx=x.context, dtype=x.dtype), dim=0)
        packed = pack(codes.reshape((-1, CODES)), self._powers(x.context))   # exact: integers < 2**24
        return [packed if self.threshold is not None else mx.nd.concat(packed, values, dim=0)]

    def decode(self, payload, out, shapes=None):
        packed = payload[0]
        if self.threshold is None:                                    # the sender's values follow its codes
            sizes = tensor_sizes(out.size, shapes)
            n = packed.shape[0] - len(sizes)
            packed, values = packed[:n], self._spread(packed[n:], sizes, out.context)
        powers = self._powers(out.context).reshape((1, CODES))
        shifted = mx.nd.floor(mx.nd.broadcast_div(packed.reshape((-1, 1)), powers))
        codes = (shifted - 4 * mx.nd.floor(shifted / 4)).reshape((-1,))[:out.size]
        if self.threshold is None:
            mx.nd.broadcast_mul((codes == 1) - (codes == 2), values, out=out)
        else:
            mx.nd.elemwise_sub(codes == 1, codes == 2, out=out)
            out *= self.threshold

    def _scale_nbytes(self, size, shapes):
        return 0 if self.threshold is not None else 4 * len(tensor_sizes(size, shapes))

    def payload_nbytes(self, size, shapes=None):
        return 4 * math.ceil(size / CODES) + self._scale_nbytes(size, shapes)

    def _across(self, comm, e, residual, shapes):
        """The servers add the workers' codes themselves: each sends ``q + 1`` (``q`` in -1, 0, 1) as digits of
        base ``B = 2W + 1`` packed into float32 integers below 2**24, so the servers' sum of the packed values is
        the packed sum of the digits, with no carry (each digit sum is at most 2W). Every worker unpacks
        ``sum(q) = digits - W`` and sends ``t * sum(q)``.

        With a fixed threshold every worker's ``t`` is it. Scaled, each worker picks its ``q`` with its own
        thresholds and writes its values (``v_w``, one a tensor) into its slot of ``W`` after the digits (the
        other slots zero, so the servers' sum is exact in any order); every worker then sends each tensor's summed
        ``q`` at ``v``, the mean of the workers' ``v_w``, and keeps ``e_w - q v`` as its residual: the sum of the
        residuals and of what is sent is still the sum of the ``e_w``."""
        values, t = self.scales(e, shapes)
        w = comm.num_workers
        up, down = signs(e, t)
        q = up - down
        if self.threshold is not None:
            mx.nd.elemwise_sub(e, q * t, out=residual)
        base, per = digits(w)
        powers = mx.nd.array(float(base) ** np.arange(per), ctx=e.context)
        codes = q + 1
        pad = -e.size % per
        if pad:
            codes = mx.nd.concat(codes, mx.nd.zeros((pad,), ctx=e.context, dtype=e.dtype), dim=0)
        packed = pack(codes.reshape((-1, per)), powers)
        n = packed.shape[0]
        if self.threshold is None:
            sizes = tensor_sizes(e.size, shapes)
            slots = mx.nd.zeros((w * len(sizes),), ctx=e.context, dtype=e.dtype)
            slots[comm.rank * len(sizes):(comm.rank + 1) * len(sizes)] = values
            packed = mx.nd.concat(packed, slots, dim=0)
        comm.allsum(packed, part=1)
        if self.threshold is None:
            t = self._spread(mx.nd.mean(packed[n:].reshape((w, -1)), axis=0), sizes, e.context)
            mx.nd.elemwise_sub(e, mx.nd.broadcast_mul(q, t), out=residual)
        shifted = mx.nd.floor(mx.nd.broadcast_div(packed[:n].reshape((-1, 1)), powers.reshape((1, per))))
        sums = (shifted - base * mx.nd.floor(shifted / base)).reshape((-1,))[:e.size]
        if self.threshold is None:
            mx.nd.broadcast_mul(sums - w, t, out=e)
        else:
            mx.nd.elemwise_mul(sums - w, mx.nd.full(sums.shape, t, ctx=e.context, dtype=e.dtype), out=e)

    def across_nbytes(self, size, num_workers, shapes=None):
        """Bytes each worker pushes (and pulls) in ``across``."""
        return 4 * math.ceil(size / digits(num_workers)[1]) + num_workers * self._scale_nbytes(size, shapes)


def tensor_sizes(size, shapes):
    """The element counts of the tensors ``shapes`` lays out in a buffer of ``size`` (``(size,)`` for None)."""
    if shapes is None:
        return (size,)
    sizes = tuple(int(np.prod(shape)) for shape in shapes)
    if sum(sizes) != size:
        raise ValueError(f"2bit: shapes {shapes} hold {sum(sizes)} elements, the buffer {size}")
    return sizes


#: How many times the gradient's mean magnitude a fixed threshold may be from it before ``TwoBit`` warns: at 10x
#: above, a normal gradient has no element past it (it is sent only once the residual has grown to it); at 10x
#: below, nearly every element is sent as +-t, a step of t whatever the gradient.
FAR = 10.0


def warn_if_far(threshold, e):
    """Warn (once a codec) when the fixed ``threshold`` is more than ``FAR`` times from ``mean(|e|)``. Waits for
    ``e``."""
    mean = float(mx.nd.mean(mx.nd.abs(e)).asscalar())
    if mean > 0 and not 1 / FAR <= threshold / mean <= FAR:
        what = ("almost nothing is sent until the residual grows to it" if threshold > mean
                else "nearly every element is sent as +-threshold")
        warnings.warn(f"2bit:{threshold:g}: the threshold is {threshold / mean:.3g}x the gradient's mean magnitude "
                      f"({mean:.3g}), so {what}; plain 2bit scales the threshold to the gradient", stacklevel=2)


def signs(e, t):
    """``(e >= t, e <= -t)`` as 0/1 arrays, ``t`` a float or a (1,) array."""
    if isinstance(t, mx.nd.NDArray):
        return mx.nd.broadcast_greater_equal(e, t), mx.nd.broadcast_lesser_equal(e, -t)
    return e >= t, e <= -t


def digits(num_workers):
    """The base ``2W + 1`` of the summable two-bit digits and how many fit in a float32's 24-bit integers."""
    base = 2 * num_workers + 1
    return base, max(1, int(math.floor(24 * math.log(2) / math.log(base) + 1e-9)))


def pack(codes, powers):
    """Each row of ``codes`` (N x c) dotted with ``powers`` (c,): exact, the values being integers below 2**24."""
    return matmul_t(codes, powers.reshape((1, -1))).reshape((-1,))
