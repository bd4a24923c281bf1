"""Megatron's conjugate operators f and g (Shoeybi et al. 2019), written from scratch for the T ranks of a
tensor-parallel group (one array a rank, each on its own context, in rank order), and the tapes that run a
group's backward pass through them.

- ``f``: forward, the identity (every rank already holds the same input); backward, the allreduce of the ranks'
  gradients. A column-parallel layer after it sends back only its own rows' part of the input's gradient, and the
  sum over the ranks is the whole.
- ``g``: forward, the allreduce of the ranks' partial outputs (a row-parallel layer's); backward, the identity:
  each rank's partial output gets the gradient of the sum.

A Transformer block costs one f and one g in its attention and one of each in its MLP: two allreduces of its
activations forward, two backward (Megatron's four a layer a step). The sums are the package's allreduce
(``algorithms.allreduce``, ``fused`` by default), which leaves the same bits on every rank, so what the ranks
compute from them (layer norms, the residual stream) stays identical on every rank.

Why a tape and not ``autograd.Function``s. A ``Function`` is one node of MXNet's graph on one context: MXNet 1.9.1
hands its backward the output gradients on the default context (``cpu(0)``, measured: even for a ``Function``
whose arrays are all on ``cpu(1)``), and a collective's backward needs every rank's gradient at once, which one
rank's node never sees (waiting for the others inside it would block that context's engine thread). So f and g
are steps of their own, and a tape records the group's forward around them; its ``backward()`` runs the recorded
pieces' backward passes last first, applying f's and g's backward between them. Each piece runs the same
operators on the same values as the unsegmented graph. ``SegmentTape`` records a *segment* at a time: everything
the ranks compute between two collectives, recorded by autograd directly (``parallel.models.layers.run_ranks`` runs
any block of the parallel layers on it). An array a segment made is read by a later segment (or a collective)
through a *leaf*: detached, its gradient attached and added to; its segment's backward is one ``autograd.backward``
of the arrays read later.

>>> import mxnet as mx
>>> from mxnet import autograd
>>> tape = SegmentTape()
>>> xs = [mx.nd.array([1.0, 2.0], ctx=mx.cpu(0)), mx.nd.array([3.0, 4.0], ctx=mx.cpu(1))]
>>> for x in xs:
...     x.attach_grad()
>>> with autograd.record():
...     doubled = [2 * tape.read(x) for x in xs]
...     tape.keep(doubled)
...     summed = tape.g(doubled)                       # g's forward: the sum, on every rank
...     losses = [(tape.read(s) ** 2).sum() for s in summed]
>>> summed[1].asnumpy().tolist()
[8.0, 12.0]
>>> tape.backward(losses[1:])   # d loss_1 / d x_1 = 2 * 2 * (x_0 + x_1): g passes the gradient of the sum on
>>> xs[1].grad.asnumpy().tolist()
[32.0, 48.0]
"""
import mxnet as mx
from mxnet import autograd

from ..trace import issued
from ..validate import BadValue
from . import algorithms

__all__ = ["SegmentTape", "KeptBytes"]


class KeptBytes(dict):
    """``{context: {"replicated": bytes, "total": bytes}}``: what forwards of tensor ranks kept for backward, added
    up by the tapes given it (``SegmentTape(kept=)``) while ``counting``, and not otherwise: a step whose
    activations nothing reads counts none (three calls into MXNet an array it keeps).

    >>> kept = KeptBytes(counting=False)
    >>> kept, kept.counting
    ({}, False)
    """

    def __init__(self, counting=True):
        super().__init__()
        self.counting = bool(counting)

    def add(self, array, part):
        """Count ``array``'s bytes on its context under ``part`` (``"replicated"`` or ``"total"``)."""
        entry = self.setdefault(array.context, {"replicated": 0, "total": 0})
        entry[part] += array.size * array.dtype(0).itemsize


def _all_gather(xs, axis):
    """Every rank's ``xs`` side by side along ``axis``, on every rank (new arrays; ``copy_to`` counts the bytes)."""
    return [mx.nd.concat(*[x if x.context == own.context else algorithms.copy_to(x, own.context) for x in xs],
                         dim=axis) if len(xs) > 1 else own.copy() for own in xs]


def _reduce_scatter(xs, axis):
    """Rank ``t`` gets slice ``t`` (``chunk_bounds`` along ``axis``) of the sum of every rank's ``xs``."""
    bounds = algorithms.chunk_bounds(xs[0].shape[axis], len(xs))
    out = []
    for t, own in enumerate(xs):
        parts = [mx.nd.slice_axis(x, axis=axis, begin=bounds[t], end=bounds[t + 1]) for x in xs]
        parts = [p if p.context == own.context else algorithms.copy_to(p, own.context) for p in parts]
        out.append(mx.nd.add_n(*parts) if len(parts) > 1 else parts[0].copy())
    return out


def _split(xs, axis):
    """Rank ``t`` keeps slice ``t`` (``chunk_bounds`` along ``axis``) of its ``xs``."""
    bounds = algorithms.chunk_bounds(xs[0].shape[axis], len(xs))
    return [mx.nd.slice_axis(x, axis=axis, begin=bounds[t], end=bounds[t + 1]) for t, x in enumerate(xs)]


def _arrays(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _in_graph(array):
    """Whether autograd recorded ``array`` (a leaf with a gradient attached, or an output of recorded operators):
    whether a gradient can flow back to it."""
    if array.grad is not None:
        return True
    try:
        autograd.get_symbol(array)
    except mx.base.MXNetError:   # "NDArray is not part of a computation graph"
        return False
    return True


class _Segment:
    """What a segment made, in order (the arrays its ``autograd.backward`` may start from)."""

    def __init__(self):
        self.arrays = []


class _Collective:
    """An f or a g: its sources (the leaves of what it read, None where no gradient flows) and its outputs."""

    def __init__(self, kind, sources, outputs, axis=None):
        self.kind, self.sources, self.outputs, self.axis = kind, sources, outputs, axis


class SegmentTape:
    """A tensor-parallel group's forward pass, recorded a segment at a time (everything the ranks compute between
    two collectives, by autograd itself), and its backward pass through f and g (see the module's docstring).

    While ``autograd.record()`` is on, whoever runs operators on the ranks' arrays (``parallel.models.layers``'s
    ``RanksF``) reads every input through ``read`` and hands the outputs to ``keep``; ``f`` and ``g`` end a
    segment. How ``read`` gives an array to the segment that reads it:

    - made by the same segment: as it is (autograd links them);
    - made by an earlier segment, or an output of f or g: through its leaf (detached, gradient attached with
      ``grad_req="add"``), which sums the gradients of every later reader; if no gradient flows to it, through
      a new handle (``detach()``): MXNet's backward clears the variables without gradient of the graph it ran
      through, and another segment's graph must not share one;
    - a parameter (``parameters``): as it is, by one segment only: its gradient is written (``grad_req="write"``)
      by the one ``autograd.backward`` of that segment, so a parameter read by two segments raises ``BadValue``
      rather than keep only the last segment's part of its gradient;
    - any other array (an input from outside): if a gradient can flow to it (a leaf the caller attached a gradient
      to, or an output of the caller's recorded operators), it is read once through a recorded identity and every
      segment reads the identity through its leaf, so its gradient is the total over the segments that read it
      (the residual stream's input); else (the images) through a new handle (``detach()``) at each read.

    ``backward(heads, head_grads)`` runs ``autograd.backward(heads, head_grads)`` first, then, last first, each
    collective's backward (f: allreduce of the ranks' gradients; g: identity; from its outputs' leaves into its
    sources' leaves) and each segment's (one ``autograd.backward`` of its arrays read later, from their leaves'
    gradients). One tape may record several groups (replicas) one after the other. Outside
    ``autograd.record()`` it keeps nothing: ``f`` is the identity, ``g`` the sum.

    Parameters
    ----------
    algorithm : str
        The allreduce of f's backward and g's forward (``parallel.comm.ALGORITHMS``).
    sequence : bool
        Sequence parallelism (Korthikanti et al. 2022): the layers that read tokens use ``all_gather`` and
        ``reduce_scatter`` along the sequence instead of f and g (``RanksF`` asks), so that what lies between
        them (layer norms, the residual stream) is split over the ranks, not replicated.
    kept : KeptBytes, optional
        Where to add, per context, the bytes a forward keeps for backward: ``{"replicated": the arrays ``note``
        was given, "total": every array the tape's steps made}`` (a strategy's memory table reads it), while it is
        counting; a counting one of its own by default.
    group : int, optional
        The ranks of a tensor-parallel group when one tape records several groups at once, their arrays group after
        group (data replicas in lockstep, ``parallel.models.lockstep``): each collective sums, gathers or splits
        over each group's consecutive ``group`` arrays; None: all the arrays a collective is given form one group.

    Attributes
    ----------
    allreduced : int
        Elements f and g have summed so far (forward and backward, each rank's array counted once): what a step's
        collectives move, for ``bytes_moved``.
    calls : dict
        ``{"f": n, "g": n}``: the forward calls of each, recording or not.
    sequence_calls : dict
        ``{"all_gather": n, "reduce_scatter": n, "split": n}``: sequence parallelism's, likewise.

    Not thread-safe: one thread records a tape at a time.

    >>> import mxnet as mx
    >>> from mxnet import autograd
    >>> tape = SegmentTape()
    >>> X = mx.nd.array([1.0, 2.0])
    >>> X.attach_grad()   # an input from outside, read before and after the sum
    >>> w = [mx.nd.array([3.0, 3.0], ctx=mx.cpu(t)) for t in range(2)]
    >>> with autograd.record():
    ...     x = tape.read(X)                                 # through a recorded identity
    ...     xs = [x.copyto(mx.cpu(t)) for t in range(2)]
    ...     tape.keep(xs, [x])
    ...     parts = [x * v for x, v in zip(xs, w)]           # each rank's partial sum: 3 X
    ...     tape.keep(parts, xs)
    ...     summed = tape.g(parts)                           # a segment ends: 6 X on every rank
    ...     out = tape.read(summed[0]) + tape.read(X)        # 7 X, from rank 0's sum and X read again
    >>> tape.backward(out)   # d out / d X: 3 through rank 0's part (g passes the sum's gradient), 1 directly
    >>> X.grad.asnumpy().tolist(), tape.allreduced, tape.calls["f"], tape.calls["g"]
    ([4.0, 4.0], 4, 0, 1)
    """

    def __init__(self, algorithm="fused", sequence=False, kept=None, group=None):
        self.algorithm, self.sequence, self.group = algorithm, bool(sequence), group
        self.allreduced = 0
        self.calls = {"f": 0, "g": 0}
        self.sequence_calls = {"all_gather": 0, "reduce_scatter": 0, "split": 0}
        if kept is not None and not isinstance(kept, KeptBytes):
            raise TypeError(f"kept must be a KeptBytes, got {type(kept).__name__}")
        self.kept = KeptBytes() if kept is None else kept
        self._clear()

    def _clear(self):
        self._steps = []       # what backward undoes, last first: _Segment and _Collective
        self._segment = None   # the open segment; None before the first operator and right after a collective
        self._made = {}        # id(array a step made) -> (array, the step, whether a gradient flows to it)
        self._leaves = {}      # id(array) -> its leaf
        self._leaf_ids = set()
        self._params = {}      # id(parameter) -> [array, name, the segment that read it]
        self._inputs = {}      # id(input from outside) -> (input, its recorded identity)
        self._plain = {}       # id(input no gradient flows to) -> the input (kept: its id stays its own)

    # ---- what a segment reads and makes ---------------------------------------------------------------------

    def parameters(self, arrays, names=None):
        """Declare ``arrays`` parameters: read as they are, by one segment of the tape each (so several
        micro-batches through the same arrays take a tape each); ``names`` name them in the error. Recording or
        not; nothing is computed."""
        names = [None] * len(arrays) if names is None else list(names)
        for array, name in zip(arrays, names):
            self._params.setdefault(id(array), [array, name, None])

    def _open(self):
        if self._segment is None:
            self._segment = _Segment()
            self._steps.append(self._segment)
        return self._segment

    def _leaf(self, array):
        leaf = self._leaves.get(id(array))
        if leaf is None:
            leaf = self._leaves[id(array)] = array.detach()
            leaf.attach_grad(grad_req="add")
            self._leaf_ids.add(id(leaf))
        return leaf

    def read(self, array):
        """``array`` as the open segment reads it (see the class's docstring); ``array`` itself outside
        ``autograd.record()``.

        Raises
        ------
        parallel.validate.BadValue
            ``array`` is a parameter an earlier segment read.
        """
        return self._read(array) if autograd.is_recording() else array

    def read_each(self, arrays):
        """``[read(a) for a in arrays]``, asking autograd once whether it records."""
        return [self._read(a) for a in arrays] if autograd.is_recording() else list(arrays)

    def _read(self, array):
        key = id(array)
        if key in self._leaf_ids:
            return array
        if key in self._plain:
            return self._handle(array)
        if key in self._made:
            _, step, flows = self._made[key]
            if step is self._segment:
                return array
            return self._leaf(array) if flows else self._handle(array)
        if key in self._params:
            return self._read_parameter(self._params[key])
        if key not in self._inputs:
            if not _in_graph(array):
                self._plain[key] = array
                return self._handle(array)
            identity = mx.nd.identity(array)   # recorded: the one read of the input, first in backward's order
            segment = _Segment()
            segment.arrays.append(identity)
            self._steps.insert(0, segment)
            self._made[id(identity)] = (identity, segment, True)
            self._inputs[key] = (array, identity)
        return self._leaf(self._inputs[key][1])

    def _handle(self, array):
        """A new handle of ``array`` (no gradient flows to it) for one read: each segment's graph records its own
        variable, since a backward without ``retain_graph`` clears the variables of the graph it ran through."""
        handle = array.detach()
        self._plain[id(handle)] = handle
        return handle

    def _read_parameter(self, entry):
        segment = self._open()
        if entry[2] is None:
            entry[2] = segment
        elif entry[2] is not segment:
            what = entry[1] or f"an array of shape {entry[0].shape}"
            raise BadValue("parameters", f"parameter {what} is read by two segments of the tensor-parallel forward "
                                         "(on both sides of a collective f or g, or in two runs on one tape): each "
                                         "segment's backward writes its gradient, so the last would overwrite the "
                                         "other's part; read it between the same two collectives, give each use a "
                                         "parameter of its own, or each run a tape of its own")
        return entry[0]

    def flows(self, array):
        """Whether a gradient flows back from ``array`` (as ``read`` gave it, as an operator made it, or any array
        autograd recorded)."""
        key = id(array)
        if key in self._leaf_ids:
            return True
        if key in self._made:
            return self._made[key][2]
        return key not in self._plain and _in_graph(array)

    def keep(self, arrays, inputs=None):
        """Record ``arrays`` as made by the open segment from ``inputs`` (what ``read`` gave the operators that
        made them; None: a gradient flows back from them). Nothing outside ``autograd.record()``."""
        if not autograd.is_recording():
            return
        flows = True if inputs is None else any(self.flows(x) for x in inputs)
        segment = self._open()
        for array in arrays:
            key = id(array)
            if key in self._made or key in self._leaf_ids or key in self._params or key in self._plain:
                continue   # an operator that gave back what it read
            segment.arrays.append(array)
            self._made[key] = (array, segment, flows)

    # ---- the collectives -------------------------------------------------------------------------------------

    def _source(self, array):
        """The leaf through which a collective reads ``array`` (None: no gradient flows back to it)."""
        key = id(array)
        if key in self._made:
            return self._leaf(array) if self._made[key][2] else None
        if key in self._params:
            raise BadValue("parameters", "a collective reads a parameter; give f and g activations")
        read = self.read(array)
        return read if id(read) in self._leaf_ids else None

    def _groups(self, xs):
        """``xs`` cut into its tensor-parallel groups (``group`` consecutive arrays each)."""
        n = self.group or len(xs)
        return [list(xs[i:i + n]) for i in range(0, len(xs), n)]

    def _each_group(self, fn, xs, *args):
        """``fn`` applied to each group of ``xs`` (one list of arrays a group), the results in order."""
        return [out for group in self._groups(xs) for out in fn(group, *args)]

    def _allreduce(self, xs):
        for group in self._groups(xs):
            algorithms.allreduce(group, self.algorithm, check=False)   # one layer's outputs, one a rank

    def _collective(self, kind, xs, outputs, axis=None):
        sources = [self._source(x) for x in xs]
        step = _Collective(kind, sources, outputs, axis)
        self._steps.append(step)
        self._segment = None
        flows = any(source is not None for source in sources)
        self._made.update((id(a), (a, step, flows)) for a in outputs)

    def f(self, xs):
        """Megatron's f on ``xs`` (one array a rank): the same arrays forward (a new segment reads them), their
        gradients allreduced backward. Does not block."""
        self.calls["f"] += 1
        if not autograd.is_recording():
            return list(xs)
        outputs = [x.detach() for x in xs]
        self._collective("f", xs, outputs)
        return outputs

    def g(self, xs):
        """Megatron's g on ``xs`` (one partial sum a rank): their sum on every rank forward (new arrays), the
        gradient passed through backward. Queued on the engine; does not block."""
        self.calls["g"] += 1
        with issued("tensor", lambda: list(xs), "tensor g", collective="g") as made:   # named so in a trace
            outputs = [x.detach().copy() for x in xs]
            made += outputs
            self._allreduce(outputs)
        self.allreduced += sum(x.size for x in xs)
        if autograd.is_recording():
            self._collective("g", xs, outputs)
        return outputs

    # ---- sequence parallelism's collectives (Korthikanti et al. 2022) ---------------------------------------------

    def all_gather(self, xs, axis=1):
        """Sequence parallelism's f: each rank's slice of the sequence (``axis``) gathered whole on every rank
        forward (a new segment reads it); backward, the reduce-scatter of the ranks' gradients, each rank's slice
        of their sum. Queued; does not block."""
        return self._along_sequence("all_gather", _all_gather, xs, axis)

    def reduce_scatter(self, xs, axis=1):
        """Sequence parallelism's g: the ranks' partial sums, each rank getting its slice (``axis``) of their sum
        forward; backward, the all-gather of the slices' gradients. Queued; does not block."""
        return self._along_sequence("reduce_scatter", _reduce_scatter, xs, axis)

    def _along_sequence(self, kind, collective, xs, axis):
        """``collective`` of ``xs`` along ``axis`` (named so in a trace), recorded as a step of kind ``kind``."""
        self.sequence_calls[kind] += 1
        with issued("tensor", lambda: list(xs), lambda: f"tensor {kind.replace('_', '-')}", collective=kind) as made:
            outputs = self._each_group(collective, [x.detach() for x in xs], axis)
            made += outputs
        if autograd.is_recording():
            self._collective(kind, xs, outputs, axis)
        return outputs

    def split(self, xs, axis=1):
        """Each rank's slice (``axis``) of a value every rank holds whole: where sequence parallelism's region
        starts. Nothing moves forward; backward, the all-gather of the slices' gradients (the whole value's
        gradient on every rank, as the replicated region before it expects)."""
        self.sequence_calls["split"] += 1
        outputs = self._each_group(_split, [x.detach() for x in xs], axis)
        if autograd.is_recording():
            self._collective("split", xs, outputs, axis)
        return outputs

    def note(self, arrays):
        """Count ``arrays`` (one a rank: a layer norm's input, the residual stream) as the replicated regions'
        activations of this forward (``kept``)."""
        if self.kept.counting and autograd.is_recording():
            for a in arrays:
                self.kept.add(a, "replicated")

    # ---- backward --------------------------------------------------------------------------------------------

    def _heads(self, heads, head_grads):
        """Split the heads: ``(outside, their gradients, {id: gradient} of arrays a segment made)``; a head that is
        a leaf or a collective's output gets its gradient added to its leaf at once."""
        heads = [] if heads is None else _arrays(heads)
        grads = [None] * len(heads) if head_grads is None else _arrays(head_grads)
        if len(grads) != len(heads):
            raise BadValue("head_grads", f"{{head_grads}} has {len(grads)} arrays for {len(heads)} heads; give one "
                                         "a head")
        outside, outside_grads, extra = [], [], {}
        for head, grad in zip(heads, grads):
            key = id(head)
            grad = mx.nd.ones_like(head) if grad is None else grad
            made = self._made.get(key)
            if key in self._leaf_ids or (made is not None and isinstance(made[1], _Collective)):
                leaf = head if key in self._leaf_ids else self._leaf(head)
                into = leaf.grad
                into += grad   # in place: one operator, where ``into[:] += grad`` takes MXNet's indexing path twice
            elif made is not None:
                extra[key] = grad if key not in extra else extra[key] + grad
            else:
                outside.append(head)
                outside_grads.append(grad)
        return outside, outside_grads, extra

    def backward(self, heads=None, head_grads=None, retain_graph=False):
        """The backward pass of what the tape recorded, then the tape emptied.

        Parameters
        ----------
        heads : NDArray or list of NDArray, optional
            What came after the tape's steps (the loss), backward first; or arrays the tape made (a segment's, a
            collective's output, a leaf), whose gradients join their step's. Heads computed outside the tape may
            read the arrays of a group's last segment directly, an earlier segment's only through ``read``.
        head_grads : NDArray or list of NDArray, optional
            The heads' gradients (default ones).

        retain_graph : bool
            Keep what autograd holds of the graph (``autograd.backward``'s): a running statistic that other,
            still pending forwards recorded (a pipeline's micro-batches through BatchNorm) keeps its place in them.

        The parameters' gradients are written, the leaves' and the inputs' added to. Nothing waits.
        """
        self._count_kept()
        outside, outside_grads, extra = self._heads(heads, head_grads)
        if outside:
            autograd.backward(outside, outside_grads, retain_graph=retain_graph)
        for step in reversed(self._steps):
            if isinstance(step, _Segment):
                self._segment_backward(step, extra, retain_graph)
            else:
                self._collective_backward(step)
        self._clear()

    def _count_kept(self):
        """Add what this forward kept for backward (every array its segments and collectives made) to ``kept``, if it
        is counting."""
        if not self.kept.counting:
            return
        for array, _, _ in self._made.values():
            self.kept.add(array, "total")

    def _segment_backward(self, segment, extra, retain_graph=False):
        arrays, grads = [], []
        for array in segment.arrays:
            leaf, more = self._leaves.get(id(array)), extra.get(id(array))
            if leaf is None and more is None:
                continue
            arrays.append(array)
            grads.append(leaf.grad if more is None else more if leaf is None else leaf.grad + more)
        if arrays:
            autograd.backward(arrays, grads, retain_graph=retain_graph)

    def _collective_backward(self, step):
        leaves = [self._leaves.get(id(a)) for a in step.outputs]
        if all(leaf is None for leaf in leaves):
            return

        def touched():   # what a trace's bracket names (built only while one records)
            return [leaf.grad for leaf in leaves if leaf is not None] + [s.grad for s in step.sources if s is not None]

        with issued("tensor", touched, lambda: f"tensor {step.kind} backward", collective=step.kind) as made:
            grads = [mx.nd.zeros_like(a) if leaf is None else leaf.grad for a, leaf in zip(step.outputs, leaves)]
            if step.kind == "f":   # the allreduce of the ranks' gradients
                grads = [grad.copy() for grad in grads]
                made += grads
                self._allreduce(grads)
                self.allreduced += sum(grad.size for grad in grads)
            elif step.kind == "all_gather":   # its conjugate: the reduce-scatter of the gradients
                grads = self._each_group(_reduce_scatter, grads, step.axis)
                made += grads
            elif step.kind in ("reduce_scatter", "split"):   # the all-gather of the slices' gradients
                grads = self._each_group(_all_gather, grads, step.axis)
                made += grads
            for source, grad in zip(step.sources, grads):   # g: the identity
                if source is not None:
                    into = source.grad
                    into += grad   # in place (see _heads)
