"""The ``powersgd`` codec: rank-r approximations of the matrix-shaped gradients by one power iteration a step.

Each matrix-shaped gradient ``M_i`` (a weight of shape ``(n, ...)`` as ``n`` rows) is approximated as ``P Q^T`` of
rank r (Vogels et al., 2019): the transport sums the small ``P_i = M_i Q`` and ``Q_i = M_i^T P`` (after ``P`` is
orthonormalized); each participant keeps ``M_i - P Q_i^T`` as error feedback; vectors (biases, BatchNorm's
parameters) and matrices too small to gain are summed whole. Every tensor's factors travel together: two sums a
step, whatever the number of tensors, as PyTorch's PowerSGD hook does per bucket.
"""
import mxnet as mx
import numpy as np

from .codec import Codec, matmul, matmul_t

__all__ = ["PowerSGD", "orthonormal_columns"]


class PowerSGD(Codec):
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

    def move(self, old, new):
        """The residuals and every tensor's ``Q`` of the buffer ``old`` follow it to ``new`` (``Codec.move``)."""
        super().move(old, new)
        for key in [key for key, found in self.queries.items() if found[0] is old]:
            self.queries[(key[0], id(new), key[2])] = (new, self.queries.pop(key)[1])

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

    def reduce(self, arrays, comm, shapes=None):
        """Sum the flat ``arrays`` (one a context) in place as rank-r approximations: the power iteration's two
        sums are ``comm.allreduce_contexts`` of every tensor's factors together."""
        for array in arrays:                                  # e = grad + residual; the iteration refills it
            residual = self.residual(array)
            mx.nd.add_n(array, residual, out=array)
            residual[:] = 0
        self._iterate(arrays, shapes or [arrays[0].shape], lambda flats, _: comm.allreduce_contexts(flats),
                      "contexts")

    def _across(self, comm, e, residual, shapes):
        """Over the workers: the same power iteration as between contexts, the servers' sums (``comm.allsum``,
        parts 1 and 2) in place of the allreduce."""
        residual[:] = 0
        self._iterate([e], shapes or [e.shape], lambda flats, i: comm.allsum(flats[0], part=1 + i), "across")

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
            P.append([matmul(M[-1][t], self._query(b, t, matrix[1], min(self.rank, *matrix), level))
                      for t, _, _, matrix in matrices])
        flats = [_flat([p.reshape((-1,)) for p in ps] + [b[offset:offset + size] for offset, size in whole])
                 for b, ps in zip(buffers, P)]
        total(flats, 0)
        for b, flat, ps in zip(buffers, flats, P):
            at = 0
            for i, (_, _, _, matrix) in enumerate(matrices):
                r = min(self.rank, *matrix)
                ps[i] = orthonormal_columns(flat[at:at + matrix[0] * r].reshape((matrix[0], r)))
                at += matrix[0] * r
            for offset, size in whole:                        # sent whole: exact, nothing left over
                b[offset:offset + size] = flat[at:at + size]
                at += size
        if not matrices:
            return
        Q = [[matmul(mx.nd.transpose(m[t]), p) for (t, _, _, _), p in zip(matrices, ps)] for m, ps in zip(M, P)]
        for b, m, ps, qs in zip(buffers, M, P, Q):           # what this participant's rank-r part leaves out
            residual = self.residual(b) if level == "contexts" else self.residual(("across", b))
            for (t, offset, size, _), p, q in zip(matrices, ps, qs):
                residual[offset:offset + size] = (m[t] - matmul_t(p, q)).reshape((-1,))
        flats = [_flat([q.reshape((-1,)) for q in qs]) for qs in Q]
        total(flats, 1)
        for b, flat, m, ps in zip(buffers, flats, M, P):
            at = 0
            for (t, _, _, matrix), p in zip(matrices, ps):
                r = min(self.rank, *matrix)
                q = flat[at:at + matrix[1] * r].reshape((matrix[1], r))
                at += matrix[1] * r
                m[t][:] = matmul_t(p, q)
                self._remember(b, t, q, level)                # the next step starts from the summed Q


def _flat(pieces):
    """The 1-D ``pieces`` one after another in a new buffer."""
    return mx.nd.concat(*pieces, dim=0) if len(pieces) > 1 else pieces[0].copy()


def orthonormal_columns(p):
    """``p`` (n x r, r <= n) with orthonormal columns spanning the same space: Gram-Schmidt, a column at a time
    (``slice_axis``), with MXNet's own elementwise operators (no LAPACK, see ``matmul_t`` in ``codec``)."""
    columns = []
    for j in range(p.shape[1]):
        column = mx.nd.slice_axis(p, axis=1, begin=j, end=j + 1)
        for previous in columns:
            column = column - mx.nd.sum(column * previous) * previous
        columns.append(column / (mx.nd.norm(column) + 1e-30))
    return mx.nd.concat(*columns, dim=1) if len(columns) > 1 else columns[0]
