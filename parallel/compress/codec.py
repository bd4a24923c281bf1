"""The codec interface: encode a gradient buffer into a smaller payload, decode it, and keep error feedback.

Error feedback: a codec keeps a *residual* per gradient buffer (per context, as every context has its own buffer,
and per bucket of it). At every step it encodes ``e = grad + residual`` and keeps ``residual = e -
decode(encode(e))``: what it did not send this step is added to the next step's gradient, so nothing is lost,
only delayed.

A codec moves nothing itself: the reduction protocols below (``reduce`` between the contexts of a process,
``across`` between the workers of a job) take a *transport*, the object a communication hook is given
(``parallel.comm.reducer.BucketComm``), and call only its public methods: ``receive(piece, ctx, slot)`` and
``scratch(ctx, shape, dtype, slot)`` (persistent buffers between contexts), ``allreduce_contexts(arrays)``,
``allsum(array, part)`` and ``allgather(array, part)`` (over the workers), ``num_workers``.

- *Gather, then broadcast* (``Codec.reduce``, for ``FP16``, ``TwoBit``, ``TopK``): every context encodes its
  ``e`` (keeping its residual); the first context receives the K-1 payloads, decodes them and adds them to its own
  decoded payload (in context order) into ``S``; it encodes ``S`` once more, keeping what that drops in its own
  residual, and sends the one payload back; every context decodes the same payload bits into its buffer. So every
  context ends with the very same bits, and at every step *applied + the sum of the residuals afterwards = the
  sum of the gradients + the sum of the residuals before*, to float32 rounding: nothing is lost.
- *Over the workers* (``Codec.across``): this worker's sum plus its worker-level residual, sent as a payload the
  servers can add (``FP16``: half precision; ``TwoBit``: digits packed so that their sum is the packed sum), or
  all-gathered (``TopK``); ``PowerSGD`` runs its power iteration with the servers' sums.
"""
import mxnet as mx

__all__ = ["Codec", "matmul_t", "matmul"]

#: The scratch slots of the gather protocol, apart from its receive slots (0 .. K-2): decoded payloads from
#: ``DECODED``, the broadcast payload's receives from ``BROADCAST``.
DECODED, BROADCAST = 1 << 20, 1 << 21


class Codec:
    """A codec with error feedback: ``residuals`` holds, per gradient buffer, what was not sent yet.

    Subclasses define ``encode(x, shapes)`` (a list of NDArrays on ``x``'s context), ``decode(payload, out,
    shapes)`` (the dense values into ``out``, a flat array of ``x``'s size), ``payload_nbytes(size, shapes)``
    (bytes a context sends between contexts) and ``across_nbytes(size, num_workers, shapes)`` (bytes a worker
    pushes); ``shapes``, the tensors laid out one after another in the buffer (None: one tensor), matters to a
    codec that treats each tensor on its own (``TwoBit``'s scales, ``PowerSGD``'s matrices).
    """

    name = None

    def __init__(self):
        self.residuals = {}   # (level, id(gradient buffer)) -> (the buffer, its residual on its context)

    def __repr__(self):
        return f"{type(self).__name__}({self.spec!r})"

    @property
    def spec(self):
        """The codec as ``parallel.compress.parse_compression`` reads it (``"topk:0.01"``)."""
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

    def move(self, old, new):
        """The gradient buffer ``old`` is now ``new``: a new array for the same tensors on the same context (a
        reducer's flat view, made anew of a gradient that came back as another NDArray object). Its residuals, at
        both levels, follow it, and so does whatever else the codec keeps for it (``PowerSGD``'s ``Q``s)."""
        for level in ("contexts", "across"):
            found = self.residuals.get((level, id(old)))
            if found is not None and found[0] is old:
                del self.residuals[(level, id(old))]
                self.residuals[(level, id(new))] = (new, found[1])

    def state(self, buffers, across=None):
        """What error feedback carries from one step to the next, for the flat gradient buffers ``buffers`` (one
        a context, as ``reduce`` gets them) and, in a job, the buffer ``across`` the workers' level encodes:
        ``{"residual/c<k>": residual of buffers[k], "residual/across": ...}`` for those that have one (none before
        the first step), as copies on ``mx.cpu()``; ``PowerSGD`` adds its ``Q`` matrices (``"query/c<k>/<t>"``,
        ``"query/across/<t>"``, ``t`` the tensor's index in the buffer). ``load_state`` gives them back. Waits
        for the device."""
        state = {}
        for name, (key, buffer) in self._state_keys(buffers, across).items():
            found = self.residuals.get(key)
            if found is not None and found[0] is buffer:
                state[f"residual/{name}"] = found[1].copyto(mx.cpu())
        return state

    def load_state(self, state, buffers, across=None):
        """Continue from ``state`` (``state``'s form) for these buffers: each residual given becomes the one of
        its buffer; the others are left as they are. Raises ``ValueError`` (naming ``compression_state``) for a
        name this layout does not have or an array of another size."""
        known = self._state_keys(buffers, across)
        for name, value in state.items():
            kind, _, where = name.partition("/")
            if kind == "residual" and where in known:
                key, buffer = known[where]
                if tuple(value.shape) != tuple(buffer.shape):
                    raise ValueError(f"compression_state: {name} has shape {tuple(value.shape)}, the gradient "
                                     f"buffer {tuple(buffer.shape)}; it belongs to another model")
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
        """Load a state entry other than a residual (PowerSGD's ``Q``); False: not one of this codec's."""
        return False

    def feed(self, x, residual, keep=False, shapes=None):
        """Encode ``x + residual``; afterwards ``residual`` holds what the payload does not carry. ``keep``: add
        that to ``residual`` instead (``x`` is a sum the residual is not part of). Returns the payload."""
        if not keep:
            mx.nd.add_n(x, residual, out=x)                   # e = grad + residual, in the gradient buffer
        payload = self.encode(x, shapes)
        sent = mx.nd.empty(x.shape, ctx=x.context, dtype=x.dtype)
        self.decode(payload, sent, shapes)
        if keep:
            mx.nd.add_n(residual, x, -sent, out=residual)
        else:
            mx.nd.elemwise_sub(x, sent, out=residual)
        return payload

    def reduce(self, arrays, comm, shapes=None):
        """Sum the flat ``arrays`` (one a context) in place, moving payloads through ``comm``: gather to the first
        context, sum, encode the sum once more, broadcast (see the module's docstring)."""
        root, ctx = arrays[0], arrays[0].context
        payloads = [self.feed(array, self.residual(array), shapes=shapes) for array in arrays]
        self.decode(payloads[0], root, shapes)                # the first context's own payload, as sent
        dense = []
        for j, payload in enumerate(payloads[1:]):
            received = [comm.receive(piece, ctx, slot=j) for piece in payload]
            out = comm.scratch(ctx, root.shape, root.dtype, DECODED + j)
            self.decode(received, out, shapes)
            dense.append(out)
        mx.nd.add_n(root, *dense, out=root)                   # S, in context order
        sent = self.feed(root, self.residual(root), keep=True, shapes=shapes)   # what S's payload drops stays here
        for array in arrays[1:]:
            self.decode([comm.receive(piece, array.context, slot=BROADCAST + s) for s, piece in enumerate(sent)],
                        array, shapes)
        self.decode(sent, root, shapes)

    def across(self, x, comm, shapes=None):
        """Sum the flat ``x`` over the workers, in place, through ``comm``'s sums: this worker encodes ``x`` plus
        its worker-level residual (kept apart from its contexts' residuals) and keeps what the payload does not
        carry. Every worker must call it at every step, in the same order."""
        residual = self.residual(("across", x))
        mx.nd.add_n(x, residual, out=x)
        self._across(comm, x, residual, shapes)

    def _across(self, comm, e, residual, shapes):
        """Default: the servers add the payloads (``FP16``: in half precision), every worker decodes the sum."""
        (piece,) = self.encode(e, shapes)
        self.decode([piece], residual, shapes)
        mx.nd.elemwise_sub(e, residual, out=residual)
        comm.allsum(piece, part=1)
        self.decode([piece], e, shapes)

    def encode(self, x, shapes=None):
        raise NotImplementedError

    def decode(self, payload, out, shapes=None):
        raise NotImplementedError

    def payload_nbytes(self, size, shapes=None):
        raise NotImplementedError

    def across_nbytes(self, size, num_workers, shapes=None):
        raise NotImplementedError

    def rounds(self, shapes):
        """For a codec whose reduction is its own sums of flat buffers (``PowerSGD``'s two), the floats each sum
        of a step carries; None (the default) for one whose payloads are gathered and broadcast
        (``payload_nbytes``)."""
        return None


def matmul_t(a, b):
    """``a b^T`` (a: n x k, b: m x k) with ``FullyConnected``, which runs on oneDNN. Not ``mx.nd.dot``: its
    OpenBLAS ``sgemm`` called from two CPU contexts' engine threads at once, with ``OMP_NUM_THREADS=2``, spun in
    ``exec_blas`` for minutes here (the hang the hybrid strategy once had)."""
    return mx.nd.FullyConnected(a, b, num_hidden=b.shape[0], no_bias=True)


def matmul(a, b):
    """``a b`` (a: n x k, b: k x m), see ``matmul_t``."""
    return matmul_t(a, mx.nd.transpose(b))
