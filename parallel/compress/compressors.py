"""The compressors, their error feedback, and the allreduce that moves compressed payloads between contexts.

Error feedback: each compressor keeps a *residual* per gradient buffer (per context, as every context has its own
buffer). At every step it compresses ``e = grad + residual`` and keeps ``residual = e - decompress(compress(e))``:
what it did not send this step is added to the next step's gradient, so nothing is lost, only delayed.

``compressed_allreduce(arrays, compressor)`` sums K flat gradient buffers so that only compressed payloads cross
between contexts:

- ``FP16``, ``TwoBit``, ``TopK`` (*gather, then broadcast*): every context compresses its ``e`` (keeping its
  residual); the first context receives the K-1 payloads, decompresses them and adds them to its own decompressed
  payload (in context order) into ``S``; it compresses ``S`` once more, keeping what that drops in its own
  residual, and sends the one payload back; every context decompresses the same payload bits into its buffer. So
  every context ends with the very same bits, and at every step *applied + the sum of the residuals afterwards =
  the sum of the gradients + the sum of the residuals before*, to float32 rounding: nothing is lost.
- ``PowerSGD`` (*linear*): each matrix-shaped gradient ``M_i`` (a weight of shape ``(n, ...)`` as ``n`` rows) is
  approximated as ``P Q^T`` of rank r by one step of power iteration, with the package's allreduce summing the
  small ``P_i = M_i Q`` and ``Q_i = M_i^T P`` (after ``P`` is orthonormalized); each context keeps
  ``M_i - P Q_i^T``; vectors (biases, BatchNorm's parameters) and matrices too small to gain are all-reduced
  whole. Every tensor's factors travel together: two sums a step (every ``P`` and the whole tensors, then every
  ``Q``), whatever the number of tensors, as PyTorch's PowerSGD hook does per bucket. The same invariant holds.

The bytes these copies move are what ``payload_nbytes`` says: fp16 2 per element, 2bit 1/12 of a float32 per
element (12 two-bit codes packed into one float32 whose value, an integer below 2**24, a kvstore server can add
to zero exactly; MXNet's own packs 16), top-k 8 per element sent (an int32 index and a float32 value).
"""
import math

import mxnet as mx
import numpy as np

from ..comm import algorithms
from ..comm.algorithms import allreduce, check_same_arrays
from ..validate import check_choice
from . import COMPRESSIONS, parse_compression

__all__ = ["Compressor", "FP16", "TwoBit", "TopK", "PowerSGD", "make_compressor", "as_compressor",
           "compressed_allreduce"]

_CODES = 12   # two-bit codes per float32 of a 2bit payload: 4**12 = 2**24, float32's exact integers


class Compressor:
    """A compressor with error feedback: ``residuals`` holds, per gradient buffer, what was not sent yet.

    Subclasses define ``compress(x)`` (a list of NDArrays on ``x``'s context), ``decompress(payload, out)`` (the
    dense values into ``out``, a flat array of ``x``'s size) and ``payload_nbytes(size)``.
    """

    name = None

    def __init__(self):
        self.residuals = {}   # id(gradient buffer) -> its residual, on its context

    def __repr__(self):
        return f"{type(self).__name__}({self.spec!r})"

    @property
    def spec(self):
        return self.name

    def residual(self, grad):
        """The residual of the buffer ``grad`` (zeros at first), an array of its shape on its context; for
        ``("across", grad)``, the worker-level residual of the sum over the workers (``across``)."""
        level, array = grad if isinstance(grad, tuple) else ("contexts", grad)
        key = (level, id(array))
        found = self.residuals.get(key)
        if found is None or found[0] is not array:
            found = self.residuals[key] = (array, mx.nd.zeros(array.shape, ctx=array.context, dtype=array.dtype))
        return found[1]

    def reset(self):
        """Forget every residual (a new run)."""
        self.residuals.clear()

    def state(self, buffers, across=None):
        """What error feedback carries from one step to the next, for the flat gradient buffers ``buffers`` (one
        a context, as ``compressed_allreduce`` gets them) and, in a job, the buffer ``across`` the workers'
        level compresses: ``{"residual/c<k>": residual of buffers[k], "residual/across": ...}`` for those that
        have one (none before the first step), as copies on ``mx.cpu()``; PowerSGD adds its ``Q`` matrices
        (``"query/c<k>/<t>"``, ``"query/across/<t>"``). ``load_state`` gives them back. Waits for the device."""
        state = {}
        for name, (key, buffer) in self._state_keys(buffers, across).items():
            found = self.residuals.get(key)
            if found is not None and found[0] is buffer:
                state[f"residual/{name}"] = found[1].copyto(mx.cpu())
        return state

    def load_state(self, state, buffers, across=None):
        """Continue from ``state`` (``state``'s form): each residual given becomes the one of its buffer; the
        others start at zero. Raises ``ValueError`` (naming ``compression_state``) for a name this layout does
        not have or an array of another size."""
        self.reset()
        known = self._state_keys(buffers, across)
        for name, value in state.items():
            kind, _, where = name.partition("/")
            if kind == "residual" and where in known:
                key, buffer = known[where]
                if value.shape != buffer.shape:
                    raise ValueError(f"compression_state: {name} has shape {value.shape}, the gradient buffer "
                                     f"{buffer.shape}; it belongs to another model")
                self.residuals[key] = (buffer, mx.nd.array(value, ctx=buffer.context, dtype=buffer.dtype))
            elif not self._load_extra(kind, where, value, known):
                raise ValueError(f"compression_state: {name!r} is not part of {self.spec}'s state on "
                                 f"{len(buffers)} context(s){' in a job' if across is not None else ''}")

    @staticmethod
    def _state_keys(buffers, across):
        """``{name: (residuals key, buffer)}`` of every buffer error feedback may keep state for."""
        keys = {f"c{k}": (("contexts", id(b)), b) for k, b in enumerate(buffers)}
        if across is not None:
            keys["across"] = (("across", id(across)), across)
        return keys

    def _load_extra(self, kind, where, value, known):
        """Load a state entry other than a residual (PowerSGD's ``Q``); False: not one of this compressor's."""
        return False

    def bytes_moved(self, algorithm, size, k, shapes=None):
        """``BytesMoved`` of ``compressed_allreduce`` over K contexts of ``size`` float32 elements: K-1 payloads
        gathered to the first context and one broadcast back to K-1 contexts."""
        payload = self.payload_nbytes(size)
        return algorithms.BytesMoved(2 * (k - 1) * payload, (k - 1) * payload)

    def reduce(self, arrays, algorithm="fused", shapes=None):
        """``compressed_allreduce(arrays, self, algorithm, shapes)``."""
        return compressed_allreduce(arrays, self, algorithm, shapes)

    def allreduce(self, arrays, algorithm, shapes=None):
        """Sum the flat ``arrays`` in place, moving compressed payloads: gather to the first context, sum,
        compress the sum once more, broadcast (see the module's docstring)."""
        root, ctx = arrays[0], arrays[0].context
        payloads = [self._feed(array, self.residual(array)) for array in arrays]
        self.decompress(payloads[0], root)                    # the first context's own payload, as sent
        dense = []
        for j, payload in enumerate(payloads[1:]):
            received = [algorithms._receive(piece, ctx, slot=j) for piece in payload]
            out = algorithms._buffers.get(ctx, root.shape, root.dtype, _CODES + j)
            self.decompress(received, out)
            dense.append(out)
        mx.nd.add_n(root, *dense, out=root)                   # S, in context order
        self._feed(root, self.residual(root), keep=True)      # the first context keeps what S's payload drops
        for array in arrays[1:]:
            self.decompress([algorithms._receive(piece, array.context, slot=len(arrays) + s)
                             for s, piece in enumerate(self._sent)], array)
        self.decompress(self._sent, root)

    def across(self, job, x, key, shapes=None):
        """Sum the flat ``x`` over the workers of ``job``, in place, pushing and pulling compressed payloads: this
        worker compresses ``x`` plus its worker-level residual (kept apart from its contexts' residuals) and
        keeps what the payload does not carry. Every worker must call it at every step, in the same order."""
        residual = self.residual(("across", x))
        mx.nd.add_n(x, residual, out=x)
        self._across(job, x, residual, shapes, key)

    def _across(self, job, e, residual, shapes, key):
        """Default: the servers add the payloads (``FP16``: in half precision), every worker decompresses the sum."""
        payload = self.compress(e)
        self.decompress(payload, residual)
        mx.nd.elemwise_sub(e, residual, out=residual)
        (piece,) = payload
        job.allsum(key, piece)
        self.decompress([piece], e)

    def _feed(self, x, residual, keep=False):
        """Compress ``x + residual``; afterwards ``residual`` holds what the payload does not carry. ``keep``:
        add that to ``residual`` instead (``x`` is a sum the residual is not part of). Returns the payload."""
        if not keep:
            mx.nd.add_n(x, residual, out=x)                   # e = grad + residual, in the gradient buffer
        payload = self.compress(x)
        sent = mx.nd.empty(x.shape, ctx=x.context, dtype=x.dtype)
        self.decompress(payload, sent)
        if keep:
            mx.nd.add_n(residual, x, -sent, out=residual)
        else:
            mx.nd.elemwise_sub(x, sent, out=residual)
        self._sent = payload
        return payload

    def compress(self, x):
        raise NotImplementedError

    def decompress(self, payload, out):
        raise NotImplementedError

    def payload_nbytes(self, size):
        raise NotImplementedError


class FP16(Compressor):
    """Half precision: 2 bytes an element; the residual keeps each element's rounding error."""

    name = "fp16"

    def compress(self, x):
        return [x.astype("float16")]

    def decompress(self, payload, out):
        mx.nd.Cast(payload[0], dtype=out.dtype, out=out)

    def payload_nbytes(self, size):
        return 2 * size

    def across_nbytes(self, size, num_workers, shapes=None):
        return 2 * size


class TwoBit(Compressor):
    """MXNet's two-bit scheme: an element of ``e`` at least ``threshold`` is sent as ``+threshold``, one at most
    ``-threshold`` as ``-threshold``, the rest as 0; the residual keeps the difference. Twelve codes travel in one
    float32 (1/12 of the bytes)."""

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
            self._weights[ctx] = mx.nd.array(4.0 ** np.arange(_CODES), ctx=ctx)
        return self._weights[ctx]

    def compress(self, x):
        codes = (x >= self.threshold) + 2 * (x <= -self.threshold)   # 0, 1 (+t) or 2 (-t)
        pad = -x.size % _CODES
        if pad:
            codes = mx.nd.concat(codes, mx.nd.zeros((pad,), ctx=x.context, dtype=x.dtype), dim=0)
        return [_pack(codes.reshape((-1, _CODES)), self._powers(x.context))]   # exact: integers < 2**24

    def decompress(self, payload, out):
        powers = self._powers(out.context).reshape((1, _CODES))
        shifted = mx.nd.floor(mx.nd.broadcast_div(payload[0].reshape((-1, 1)), powers))
        codes = (shifted - 4 * mx.nd.floor(shifted / 4)).reshape((-1,))[:out.size]
        mx.nd.elemwise_sub(codes == 1, codes == 2, out=out)
        out *= self.threshold

    def payload_nbytes(self, size):
        return 4 * math.ceil(size / _CODES)

    def _across(self, job, e, residual, shapes, key):
        """The servers add the workers' codes themselves: each sends ``q + 1`` (``q`` in -1, 0, 1) as digits of
        base ``B = 2W + 1`` packed into float32 integers below 2**24, so the servers' sum of the packed values is
        the packed sum of the digits, with no carry (each digit sum is at most 2W). Every worker unpacks
        ``sum(q) = digits - W`` and sends ``threshold * sum(q)``."""
        t, w = self.threshold, job.num_workers
        q = (e >= t) - (e <= -t)
        mx.nd.elemwise_sub(e, q * t, out=residual)
        base, per = _digits(w)
        powers = mx.nd.array(float(base) ** np.arange(per), ctx=e.context)
        digits = q + 1
        pad = -e.size % per
        if pad:
            digits = mx.nd.concat(digits, mx.nd.zeros((pad,), ctx=e.context, dtype=e.dtype), dim=0)
        packed = _pack(digits.reshape((-1, per)), powers)
        job.allsum(key, packed)
        shifted = mx.nd.floor(mx.nd.broadcast_div(packed.reshape((-1, 1)), powers.reshape((1, per))))
        sums = (shifted - base * mx.nd.floor(shifted / base)).reshape((-1,))[:e.size]
        mx.nd.elemwise_mul(sums - w, mx.nd.full(sums.shape, t, ctx=e.context, dtype=e.dtype), out=e)

    def across_nbytes(self, size, num_workers, shapes=None):
        """Bytes each worker pushes (and pulls) in ``across``."""
        return 4 * math.ceil(size / _digits(num_workers)[1])


def _digits(num_workers):
    """The base ``2W + 1`` of the summable two-bit digits and how many fit in a float32's 24-bit integers."""
    base = 2 * num_workers + 1
    return base, max(1, int(math.floor(24 * math.log(2) / math.log(base) + 1e-9)))


class TopK(Compressor):
    """The ``ratio`` of the elements largest in magnitude (at least one), as int32 indices and float32 values."""

    name = "topk"

    def __init__(self, ratio):
        super().__init__()
        self.ratio = float(ratio)

    @property
    def spec(self):
        return f"topk:{self.ratio:g}"

    def k(self, size):
        return max(1, min(size, math.ceil(self.ratio * size)))

    def compress(self, x):
        indices = mx.nd.topk(mx.nd.abs(x), k=self.k(x.size), ret_typ="indices", dtype="int32")
        return [indices, mx.nd.take(x, indices)]

    def decompress(self, payload, out):
        indices, values = payload
        out[:] = mx.nd.scatter_nd(values, indices.reshape((1, -1)), shape=out.shape)

    def payload_nbytes(self, size):
        return 8 * self.k(size)

    def _across(self, job, e, residual, shapes, key):
        """An all-gather through the servers: worker ``r`` fills slot ``r`` of a float32 array of ``W`` slots
        (its indices, exact as float32 below 2**24, then its values) and zeros elsewhere; the servers' sum is
        every slot (adding zeros changes nothing); every worker adds the ``W`` payloads in rank order."""
        if e.size > 2 ** 24:
            raise ValueError(f"topk across workers sends indices as float32, exact up to 2**24 elements; this "
                             f"buffer has {e.size}")
        k = self.k(e.size)
        indices, values = self.compress(e)
        self.decompress([indices, values], residual)
        mx.nd.elemwise_sub(e, residual, out=residual)
        slots = mx.nd.zeros((job.num_workers * 2 * k,), ctx=e.context, dtype=e.dtype)
        start = job.rank * 2 * k
        slots[start:start + k] = indices.astype(e.dtype)
        slots[start + k:start + 2 * k] = values
        job.allsum(key, slots)
        dense = []
        for r in range(job.num_workers):
            out = mx.nd.empty(e.shape, ctx=e.context, dtype=e.dtype)
            self.decompress([slots[r * 2 * k:r * 2 * k + k].astype("int32"), slots[r * 2 * k + k:(r + 1) * 2 * k]],
                            out)
            dense.append(out)
        mx.nd.add_n(*dense, out=e)

    def across_nbytes(self, size, num_workers, shapes=None):
        return 8 * self.k(size) * num_workers


class PowerSGD(Compressor):
    """Rank-``rank`` approximations of the matrix-shaped gradients by one power iteration a step, warm-started
    from the previous step's ``Q`` (Vogels et al., 2019), with error feedback."""

    name = "powersgd"

    def __init__(self, rank, seed=0):
        super().__init__()
        self.rank, self.seed = int(rank), seed
        self.queries = {}   # (id(buffer), tensor index) -> Q on the buffer's context

    @property
    def spec(self):
        return f"powersgd:{self.rank}"

    def reset(self):
        super().reset()
        self.queries.clear()

    def state(self, buffers, across=None):
        """The residuals and every tensor's ``Q`` (``"query/c<k>/<t>"``, ``"query/across/<t>"``)."""
        state = super().state(buffers, across)
        names = {key: (name, buffer) for name, (key, buffer) in self._state_keys(buffers, across).items()}
        for (level, array_id, t), (array, q) in self.queries.items():
            name, buffer = names.get((level, array_id), (None, None))
            if array is buffer:
                state[f"query/{name}/{t}"] = q.copyto(mx.cpu())
        return state

    def _load_extra(self, kind, where, value, known):
        name, _, t = where.rpartition("/")
        if kind != "query" or name not in known or not t.isdigit():
            return False
        (level, array_id), buffer = known[name]
        self.queries[(level, array_id, int(t))] = (buffer, mx.nd.array(value, ctx=buffer.context,
                                                                       dtype=buffer.dtype))
        return True

    def plan(self, shapes):
        """``(offset, size, (n, m) or None)`` per tensor: a matrix of n rows to compress, or None (sent whole)."""
        plan, offset = [], 0
        for shape in shapes:
            size = int(np.prod(shape))
            n = shape[0] if len(shape) > 1 else size
            m = size // n if n else 0
            r = min(self.rank, n, m)
            plan.append((offset, size, (n, m) if len(shape) > 1 and (n + m) * r < size else None))
            offset += size
        return plan

    def across_nbytes(self, size, num_workers, shapes=None):
        return self.payload_nbytes(size, shapes)

    def rounds(self, shapes):
        """The floats each of the two sums of a step carries: every ``P`` and every tensor sent whole, then every
        ``Q``."""
        first = sum(matrix[0] * min(self.rank, *matrix) if matrix else size for _, size, matrix in self.plan(shapes))
        second = sum(matrix[1] * min(self.rank, *matrix) for _, _, matrix in self.plan(shapes) if matrix)
        return first, second

    def bytes_moved(self, algorithm, size, k, shapes=None):
        """The two sums of a step (``rounds``), each all-reduced with ``algorithm`` as one flat buffer."""
        moved = [algorithms.bytes_moved(algorithm, 4 * floats, k)
                 for floats in self.rounds([(size,)] if shapes is None else shapes) if floats]
        return algorithms.BytesMoved(sum(m.total for m in moved), sum(m.per_context_max for m in moved))

    def payload_nbytes(self, size, shapes=None):
        shapes = [(size,)] if shapes is None else shapes
        return sum(4 * ((matrix[0] + matrix[1]) * min(self.rank, *matrix) if matrix else size)
                   for _, size, matrix in self.plan(shapes))

    def _query(self, array, t, m, r, level="contexts"):
        """The starting ``Q`` (m x r) of tensor ``t`` of the buffer ``array``: the same seeded random values on
        every context and worker at first, then the previous step's summed ``Q`` (``_remember``)."""
        found = self.queries.get((level, id(array), t))
        if found is None or found[0] is not array:
            values = np.random.RandomState(self.seed + t).standard_normal((m, r))
            found = self.queries[(level, id(array), t)] = (array, mx.nd.array(values, ctx=array.context,
                                                                              dtype=array.dtype))
        if found[1].shape != (m, r):   # only a loaded state can disagree
            raise ValueError(f"compression_state: the Q of tensor {t} has shape {found[1].shape}, {self.spec} "
                             f"needs {(m, r)}; it was saved with another rank or model")
        return found[1]

    def _remember(self, array, t, q, level="contexts"):
        """Keep the summed ``Q`` for the next step, its columns scaled to unit length: only the space they span
        matters (``P`` is orthonormalized), and unscaled, ``Q`` would shrink with the gradient step after step
        until ``P = M Q`` fell into float32's subnormal range (measured: a 20-epoch LeNet run slowed to minutes a
        epoch once its loss neared zero)."""
        norms = mx.nd.norm(q, axis=0, keepdims=True) + 1e-30
        self.queries[(level, id(array), t)] = (array, mx.nd.broadcast_div(q, norms))

    def allreduce(self, arrays, algorithm, shapes=None):
        for array in arrays:                                  # e = grad + residual; the iteration refills it
            residual = self.residual(array)
            mx.nd.add_n(array, residual, out=array)
            residual[:] = 0
        self._iterate(arrays, shapes or [arrays[0].shape], lambda flats, _: allreduce(flats, algorithm), "contexts")

    def _iterate(self, buffers, shapes, total, level):
        """One power iteration on every matrix of each of ``buffers`` (one flat ``e = grad + residual`` a
        participant: a context's, or this worker's), in two sums for all the tensors at once: ``total(flats, i)``
        sums round ``i``'s flat buffers (one a participant) in place over the participants. Round 1 carries every
        ``P = M Q`` and the tensors sent whole (exact), round 2 every ``Q = M^T P`` after ``P`` is
        orthonormalized. Leaves ``M`` = the rank-r sum and each residual = what its own rank-r part left out."""
        plan = self.plan(shapes)
        matrices = [(t, offset, size, matrix) for t, (offset, size, matrix) in enumerate(plan) if matrix]
        whole = [(offset, size) for offset, size, matrix in plan if matrix is None]
        M, P = [], []
        for b in buffers:
            M.append({t: b[offset:offset + size].reshape(matrix) for t, offset, size, matrix in matrices})
            P.append([_matmul(M[-1][t], self._query(b, t, matrix[1], min(self.rank, *matrix), level))
                      for t, _, _, matrix in matrices])
        flats = [_flat([p.reshape((-1,)) for p in ps] + [b[offset:offset + size] for offset, size in whole])
                 for b, ps in zip(buffers, P)]
        total(flats, 0)
        for b, flat, ps in zip(buffers, flats, P):
            at = 0
            for i, (_, _, _, matrix) in enumerate(matrices):
                r = min(self.rank, *matrix)
                ps[i] = _orthonormal_columns(flat[at:at + matrix[0] * r].reshape((matrix[0], r)))
                at += matrix[0] * r
            for offset, size in whole:                        # sent whole: exact, nothing left over
                b[offset:offset + size] = flat[at:at + size]
                at += size
        if not matrices:
            return
        Q = [[_matmul(mx.nd.transpose(m[t]), p) for (t, _, _, _), p in zip(matrices, ps)] for m, ps in zip(M, P)]
        for b, m, ps, qs in zip(buffers, M, P, Q):           # what this participant's rank-r part leaves out
            residual = self.residual(b) if level == "contexts" else self.residual(("across", b))
            for (t, offset, size, _), p, q in zip(matrices, ps, qs):
                residual[offset:offset + size] = (m[t] - _matmul_t(p, q)).reshape((-1,))
        flats = [_flat([q.reshape((-1,)) for q in qs]) for qs in Q]
        total(flats, 1)
        for b, flat, m, ps in zip(buffers, flats, M, P):
            at = 0
            for (t, _, _, matrix), p in zip(matrices, ps):
                r = min(self.rank, *matrix)
                q = flat[at:at + matrix[1] * r].reshape((matrix[1], r))
                at += matrix[1] * r
                m[t][:] = _matmul_t(p, q)
                self._remember(b, t, q, level)                # the next step starts from the summed Q


def _flat(pieces):
    """The 1-D ``pieces`` one after another in a new buffer."""
    return mx.nd.concat(*pieces, dim=0) if len(pieces) > 1 else pieces[0].copy()


def _powersgd_across(self, job, e, residual, shapes, key):
    """PowerSGD over the workers: the same power iteration as between contexts, the job's sums in place of the
    allreduce (its two rounds under keys ``key + 1`` and ``key + 2``)."""
    residual[:] = 0
    self._iterate([e], shapes or [e.shape], lambda flats, i: job.allsum(key + 1 + i, flats[0]), "across")


PowerSGD._across = _powersgd_across


def _matmul_t(a, b):
    """``a b^T`` (a: n x k, b: m x k) with ``FullyConnected``, which runs on oneDNN. Not ``mx.nd.dot``: its
    OpenBLAS ``sgemm`` called from two CPU contexts' engine threads at once, with ``OMP_NUM_THREADS=2``, spun in
    ``exec_blas`` for minutes here (the hang the hybrid strategy once had)."""
    return mx.nd.FullyConnected(a, b, num_hidden=b.shape[0], no_bias=True)


def _matmul(a, b):
    """``a b`` (a: n x k, b: k x m), see ``_matmul_t``."""
    return _matmul_t(a, mx.nd.transpose(b))


def _pack(codes, powers):
    """Each row of ``codes`` (N x c) dotted with ``powers`` (c,): exact, the values being integers below 2**24."""
    return _matmul_t(codes, powers.reshape((1, -1))).reshape((-1,))


def _orthonormal_columns(p):
    """``p`` (n x r, r <= n) with orthonormal columns spanning the same space: Gram-Schmidt, a column at a time
    (``slice_axis``), with MXNet's own elementwise operators (no LAPACK, see ``_matmul_t``)."""
    columns = []
    for j in range(p.shape[1]):
        column = mx.nd.slice_axis(p, axis=1, begin=j, end=j + 1)
        for previous in columns:
            column = column - mx.nd.sum(column * previous) * previous
        columns.append(column / (mx.nd.norm(column) + 1e-30))
    return mx.nd.concat(*columns, dim=1) if len(columns) > 1 else columns[0]


_CLASSES = {"fp16": FP16, "2bit": TwoBit, "topk": TopK, "powersgd": PowerSGD}


def make_compressor(spec, name="compression"):
    """The compressor a spec names (``parse_compression``): a new object with empty residuals, or None for
    ``"none"``. Keep the object for the whole run: its residuals carry over from step to step."""
    kind, value = parse_compression(spec, name)
    if kind == "none":
        return None
    return _CLASSES[kind]() if value is None else _CLASSES[kind](value)


def as_compressor(value, name="compression"):
    """``value`` as a compressor: None or ``"none"`` -> None, a spec string -> ``make_compressor``, a
    ``Compressor`` as is."""
    if value is None or isinstance(value, Compressor):
        return value
    return make_compressor(value, name)


def compressed_allreduce(arrays, compressor, algorithm="fused", shapes=None):
    """Sum the flat ``arrays`` (one per context) in place, moving compressed payloads between the contexts.

    Parameters
    ----------
    arrays : list of NDArray
        One flat (1-D) gradient buffer per context, of one size and dtype (float32). Modified in place: each
        then holds the same decompressed sum.
    compressor : Compressor or str or None
        ``None``/``"none"``: ``allreduce(arrays, algorithm)``, bitwise. Otherwise its residuals (one per array)
        are read and updated: pass the same object at every step.
    algorithm : str
        The allreduce ``PowerSGD`` sums its small factors with (the others gather and broadcast payloads).
    shapes : list of tuple, optional
        The shapes of the tensors laid out one after another in each buffer (``PowerSGD`` compresses the
        matrices among them); default: one vector.

    Returns
    -------
    list of NDArray
        ``arrays``. The work is queued; nothing waits for the devices.
    """
    check_same_arrays(arrays)
    check_choice(algorithm, "algorithm", algorithms.ALGORITHMS)
    compressor = as_compressor(compressor)
    if compressor is None:
        return allreduce(arrays, algorithm)
    if len(arrays[0].shape) != 1:
        raise ValueError(f"compressed_allreduce takes flat (1-D) buffers, got shape {arrays[0].shape}")
    if shapes is not None and sum(int(np.prod(s)) for s in shapes) != arrays[0].size:
        raise ValueError(f"shapes hold {sum(int(np.prod(s)) for s in shapes)} elements, the buffers "
                         f"{arrays[0].size}")
    if len(arrays) > 1:
        if isinstance(compressor, PowerSGD):
            compressor.allreduce(arrays, algorithm, shapes)
        else:
            with algorithms._buffers.lock:
                compressor.allreduce(arrays, algorithm, shapes)
    return arrays


assert set(_CLASSES) == set(COMPRESSIONS) - {"none"}
