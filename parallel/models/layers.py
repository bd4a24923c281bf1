"""Layers that say how they are split over a tensor-parallel group, and ``run_ranks``, which runs any block made of
them on the group's T ranks, Megatron-LM's way (Shoeybi et al. 2019), with no tensor-parallel copy of the model.

Each layer is its gluon base class: built, initialized, hybridized, exported and run by gluon exactly as the base
class is (ordinary mode: ``F`` is ``mx.nd`` or ``mx.sym``, the base class's own arithmetic). What it adds is what
the layer does on T ranks (ranks mode: ``F`` is a ``RanksF``) and the shard spec of each parameter
(``parallel.shard``: ``shard_specs()``):

- ``ColumnParallelDense`` (``nn.Dense``): each rank holds some of its output units (the rows of its weight and
  bias): Megatron's f on its input (the identity forward, the allreduce of the input's gradient backward), the
  rank's units, and the ranks' outputs gathered side by side with ``gather_output``. ``parts`` and ``unit`` say how
  the units are dealt: a fused query, key and value layer is 3 parts of heads of ``unit`` units each;
- ``RowParallelDense`` (``nn.Dense``): each rank holds the columns of its input's part (a column-parallel layer's
  output): the rank's partial product, Megatron's g (the allreduce of the partial sums), then the bias, which every
  rank holds;
- ``ParallelPatchEmbedding`` (``nn.Conv2D`` of kernel = stride = ``patch``): each rank holds some pixels of a
  patch (its weight seen as (channels, pixels)): f on its input, each patch's pixels unfolded, the rank's
  through a dense layer, g, the bias; returned in the convolution's layout.

Any other gluon layer (a LayerNorm, an activation, pooling) runs on every rank on the same values: replicated.
``run_ranks(block, X, parts, tape)`` runs a block's own ``hybrid_forward`` code on the ranks, each rank's
arrays in ``parts``, f and g recorded by a ``parallel.comm.SegmentTape``; ``shard_specs(block)`` gives every
trainable array's spec and ``replicate_ranks(block, ctx_list)`` each rank's arrays.

A new parallel layer touches this file alone: subclass the gluon layer, let its ``hybrid_forward`` call the base
class's unless ``F`` is a ``RanksF`` (then compute with ``F``'s operators on the rank's arrays, ``F.f``, ``F.g``
and ``F.gather`` between), and give ``shard_specs()`` (``{parameter attribute: spec}``). Training on the ranks,
every rank computes the loss from its own output (Megatron's way: see ``run_ranks``).

>>> import mxnet as mx
>>> from mxnet.gluon import nn
>>> from parallel.comm.tensor import SegmentTape
>>> net = nn.HybridSequential()
>>> net.add(ColumnParallelDense(8, activation="relu", in_units=4), RowParallelDense(3, in_units=8))
>>> net.initialize(mx.init.Uniform(), ctx=mx.cpu())
>>> list(shard_specs(net).values())
[Split(axis=0, parts=1, unit=1, flatten=False), Split(axis=0, parts=1, unit=1, flatten=False), Split(axis=1, parts=1, unit=1, flatten=False), Replicated()]
>>> X = mx.nd.random.uniform(shape=(5, 4))
>>> parts = replicate_ranks(net, [mx.cpu(0), mx.cpu(1)])   # rank t's 4 of the 8 hidden units, on cpu(t)
>>> out = run_ranks(net, X, parts, SegmentTape())
>>> len(out), out[1].context, (out[0] - net(X)).abs().max().asscalar() < 1e-6
(2, cpu(1), True)
"""
import functools
import operator
import types

import mxnet as mx
from mxnet import gluon
from mxnet.gluon import nn

from ..comm import algorithms
from ..comm.replica import FlatReplica, aux_names_of, aux_of, block_state, get_params, names_of
from ..comm.tensor import SegmentTape
from ..mesh import REPLICA_AXES, Mesh
from ..shard import Replicated, Split
from .base import Net, ParallelF, ParallelLayer
from .ring import ring_attention
from ..validate import BadType, BadValue, check_bool, check_contexts, check_int

__all__ = ["Ranks", "RanksF", "ColumnParallelDense", "RowParallelDense", "ParallelPatchEmbedding", "shard_specs",
           "local_arrays", "joined_arrays", "replicate_ranks", "most_ranks", "run_ranks", "RankedNet", "ReplicasF",
           "run_replicas", "block_plan"]


# ---- a value on every rank, and the F that computes with it ---------------------------------------------------

class Ranks:
    """A value held by each of T ranks: one NDArray a rank, on its rank's context, in rank order.

    Not a list or a tuple (gluon's ``HybridSequential`` would take a tuple for several outputs): ``ranks[t]``,
    ``len(ranks)`` and ``ranks.arrays`` give the arrays. ``+ - * /`` with another ``Ranks`` or a number compute on
    each rank (recorded by the ``RanksF`` that made the value, if any).

    >>> x = Ranks([mx.nd.ones((2,), ctx=mx.cpu(0)), mx.nd.ones((2,), ctx=mx.cpu(1))])
    >>> y = 2 * x + 1
    >>> len(y), y[1].asnumpy().tolist(), y[1].context
    (2, [3.0, 3.0], cpu(1))
    """

    def __init__(self, arrays, F=None):
        self.arrays = list(arrays)
        self.F = F

    def __len__(self):
        return len(self.arrays)

    def __getitem__(self, t):
        return self.arrays[t]

    def __repr__(self):
        shapes = sorted({a.shape for a in self.arrays})
        return f"Ranks({len(self)} ranks of {shapes[0] if len(shapes) == 1 else shapes})"

    def detach(self):
        """The ranks' arrays detached from autograd's graph (``NDArray.detach``), unrecorded."""
        return Ranks([a.detach() for a in self.arrays], self.F)

    def _apply(self, fn, *args):
        F = next((a.F for a in args if isinstance(a, Ranks) and a.F is not None), None)
        return (F or RanksF(len(self))).apply(fn, *args)

    def __add__(self, other):
        return self._apply(operator.add, self, other)

    def __radd__(self, other):
        return self._apply(operator.add, other, self)

    def __sub__(self, other):
        return self._apply(operator.sub, self, other)

    def __rsub__(self, other):
        return self._apply(operator.sub, other, self)

    def __mul__(self, other):
        return self._apply(operator.mul, self, other)

    def __rmul__(self, other):
        return self._apply(operator.mul, other, self)

    def __truediv__(self, other):
        return self._apply(operator.truediv, self, other)

    def __rtruediv__(self, other):
        return self._apply(operator.truediv, other, self)

    def __neg__(self):
        return self._apply(operator.neg, self)


class _PerRank:
    """``F.per_rank``'s values: rank ``t`` reads ``values[t]``."""

    def __init__(self, values):
        self.values = list(values)


class _Namespace:
    """``F.contrib``, ``F.linalg``, ...: ``mx.nd``'s submodule run on the ranks."""

    def __init__(self, F, module):
        self._F, self._module = F, module

    def __getattr__(self, name):
        return functools.partial(self._F.apply, getattr(self._module, name))


class RanksF(ParallelF):
    """The ``F`` a block's ``hybrid_forward`` gets when it runs on ``ranks`` ranks over ``tape`` (``run_ranks``).

    ``F.op(*args, **kwargs)`` runs ``mx.nd.op`` on each rank ``t``: a ``Ranks`` argument (positional, keyword, or
    in a list) is the rank's array, read through the tape; ``F.per_rank(values)`` is ``values[t]``; anything else
    is passed as it is. An operator of one output gives a ``Ranks``, one of several a tuple of ``Ranks``. Besides
    ``mx.nd``'s operators: ``f``, ``g`` (Megatron's, on the tape), ``gather`` (the ranks' parts side by side on
    every rank), ``apply`` (any function of arrays on each rank), ``ranks`` (T); and the model's seams
    (``parallel.models.base.ParallelF``): under sequence parallelism ``split_tokens`` is ``split_sequence`` and
    opens the *sequence region* (``in_region``), ``gather_tokens`` is ``gather`` and closes it; ``mark_kept`` counts on
    the tape (``SegmentTape.note``); ``mixture`` refuses a mixture of experts (it does not split over the ranks).
    Inside the region the parallel layers' f and g are the all-gather and the reduce-scatter of the sequence: the
    proxy knows where the region is, no layer or model declares it.

    Parameters
    ----------
    ranks : int
        T, the ranks.
    tape : parallel.comm.SegmentTape, optional
        Where the ranks' work is recorded; None: nothing recorded (``f`` and ``g`` refused).
    in_region : bool
        The run starts inside the sequence region: its input is each rank's slice of the tokens (a pipeline stage
        or a recomputed block among a model's Transformer blocks; the model's plan says which,
        ``parallel.models.plan``). Only under sequence parallelism (the tape's ``sequence``).
    """

    #: Whether the parallel layers split over the ranks (a tensor-parallel group); False: every rank holds its
    #: layers whole and computes on its own values (``ReplicasF``: data replicas in lockstep).
    splits = True

    def __init__(self, ranks, tape=None, in_region=False):
        self.ranks = check_int(ranks, "ranks", low=1)
        self.tape = tape
        #: Whether the tokens are split along the sequence over the ranks here: inside the sequence region, between
        #: ``split_tokens`` and ``gather_tokens`` (or from the start: ``in_region``), under sequence parallelism.
        self.in_region = check_bool(in_region, "in_region") and self.sequence
        #: The ranks of a tensor-parallel group: all of them here; fewer when one ``F`` runs several groups at once
        #: (``ReplicasF`` of data replicas that are tensor groups), array ``r`` being the mesh's rank ``r``.
        self.tensor = self.ranks
        #: Which group and rank each array is (``parallel.mesh.Mesh``): here one tensor-parallel group.
        self.mesh = Mesh(tensor=self.ranks)

    def __repr__(self):
        return f"{type(self).__name__}({self.ranks} ranks)"

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        target = getattr(mx.nd, name)
        if isinstance(target, types.ModuleType):
            return _Namespace(self, target)
        return functools.partial(self.apply, target)

    def per_rank(self, values):
        """``values`` (one a rank) as an argument of ``F.op``: rank ``t`` gets ``values[t]``."""
        values = list(values)
        if len(values) != self.ranks:
            raise BadValue("values", f"{{values}} has {len(values)} values for {self.ranks} ranks; give one a rank")
        return _PerRank(values)

    def _each(self, value, read):
        """``value`` for every rank: a list of T values (rank ``t``'s at ``t``), or None when every rank gets
        ``value`` itself. A ``Ranks``'s arrays are read through the tape, once, and appended to ``read``."""
        if isinstance(value, Ranks):
            arrays = self.arrays_of(value)
            read.extend(arrays)
            return arrays
        if isinstance(value, _PerRank):
            return value.values
        if isinstance(value, (list, tuple)) and any(isinstance(v, (Ranks, _PerRank)) for v in value):
            items = [self._each(v, read) for v in value]
            return [type(value)(v if each is None else each[t] for v, each in zip(value, items))
                    for t in range(self.ranks)]
        return None

    def apply(self, fn, *args, **kwargs):
        """``fn(*args_t, **kwargs_t)`` on each rank ``t`` (the arguments unwrapped as ``F.op``'s), recorded on the
        tape: a ``Ranks``, or a tuple of them for a function of several outputs. Queued; does not block."""
        read = []
        each_arg = [self._each(v, read) for v in args]
        each_kwarg = {k: self._each(v, read) for k, v in kwargs.items()}
        outputs = []
        for t in range(self.ranks):
            outputs.append(fn(*[v if each is None else each[t] for v, each in zip(args, each_arg)],
                              **{k: v if each_kwarg[k] is None else each_kwarg[k][t] for k, v in kwargs.items()}))
        if isinstance(outputs[0], (list, tuple)):
            result = tuple(Ranks([out[i] for out in outputs], self) for i in range(len(outputs[0])))
            made = [a for r in result for a in r.arrays]
        else:
            result = Ranks(outputs, self)
            made = result.arrays
        self.keep(made, read)
        return result

    def arrays_of(self, x):
        """The arrays of ``x`` (a ``Ranks``) as the tape's open segment reads them (``SegmentTape.read_each``), or
        themselves without a tape."""
        return list(x.arrays) if self.tape is None else self.tape.read_each(x.arrays)

    def keep(self, arrays, read):
        """Hand the NDArrays among ``arrays`` (what a rank's computation made from ``read``) to the tape's open
        segment, if there is a tape: what a layer that runs outside ``apply`` (the MoE layer) calls for its outputs.
        Without a tape, nothing."""
        if self.tape is not None:
            self.tape.keep([a for a in arrays if isinstance(a, mx.nd.NDArray)], read)

    def _tape(self, what):
        if self.tape is None:
            raise BadValue("tape", f"{what} needs a tape (parallel.comm.SegmentTape); give {{tape}}")
        return self.tape

    @property
    def sequence(self):
        """Whether the tokens between the collectives are split along the sequence (sequence parallelism: the tape's
        ``sequence``)."""
        return self.tape is not None and self.tape.sequence

    def f(self, x):
        """Megatron's f on ``x`` (a ``Ranks``): the same values, a new segment; the gradients allreduced backward."""
        return Ranks(self._tape("f").f(x.arrays), self)

    def all_gather(self, x, axis=1):
        """Sequence parallelism's f: each rank's slice of the sequence gathered whole on every rank; backward the
        reduce-scatter of the gradients (``SegmentTape.all_gather``)."""
        return Ranks(self._tape("all_gather").all_gather(x.arrays, axis), self)

    def reduce_scatter(self, x, axis=1):
        """Sequence parallelism's g: each rank's slice of the ranks' sum; backward the all-gather of the gradients."""
        return Ranks(self._tape("reduce_scatter").reduce_scatter(x.arrays, axis), self)

    def split_sequence(self, x, axis=1):
        """Each rank's slice of a value every rank holds (where the sequence-parallel region starts); backward the
        all-gather of the slices' gradients. (Not ``split``: that is ``mx.nd.split``.)"""
        return Ranks(self._tape("split").split(x.arrays, axis), self)

    def split_tokens(self, x, axis=1):
        """The seam where the tokens enter the blocks: under sequence parallelism each rank's slice of them
        (``split_sequence``), the sequence region opened (``in_region``); else ``x``."""
        if not self.sequence:
            return x
        self.in_region = True
        return self.split_sequence(x, axis)

    def gather_tokens(self, x, axis=1):
        """The seam where the model needs every token again: inside the sequence region the ranks' slices side by
        side on every rank (``gather``), the region closed; else ``x``."""
        if not self.in_region:
            return x
        self.in_region = False
        return self.gather(x, axis=axis)

    def mark_kept(self, *values):
        """Count ``values`` (``Ranks``) as the activations of the regions every rank would hold whole without
        sequence parallelism (layer norms' inputs, the residual stream): ``SegmentTape.note``."""
        if self.tape is not None:
            for value in values:
                self.tape.note(value.arrays)

    def mixture(self, layer, x, *weights):
        """The seam of a mixture of experts: refused, an MoE layer does not split over a tensor-parallel group
        (``BadValue`` naming ``tensor``); on replicas that are tensor groups it runs on ``ReplicasF``."""
        raise BadValue("tensor", "an MoE layer does not split over a tensor-parallel group; use {tensor} 1 "
                                 "with experts (expert parallelism spreads them: expert_parallel)")

    def g(self, x):
        """Megatron's g on ``x`` (each rank's partial sum): the sum on every rank; the gradient passed through."""
        return Ranks(self._tape("g").g(x.arrays), self)

    def gather(self, x, axis=-1):
        """Every rank's copy of the ranks' parts of ``x`` side by side along ``axis``: Megatron's all-gather of a
        column-parallel layer's output, not a segment boundary. Rank ``t``'s copy reads its own part through
        autograd and the others' parts as unrecorded copies, so backward hands rank ``t``'s part the gradient of
        its slice of rank ``t``'s copy (Megatron's split): every rank's output carries the whole gradient, as after
        g. Queued; does not block."""
        arrays = self.arrays_of(x)
        axis = axis % arrays[0].ndim
        gathered = []
        for r, own in enumerate(arrays):
            group = [arrays[i] for i in self.mesh.group_of(r, "tensor").ranks]   # own's tensor-parallel group
            pieces = [own if a is own else algorithms.copy_to(a.detach(), own.context) for a in group]
            gathered.append(mx.nd.concat(*pieces, dim=axis))
        self.keep(gathered, arrays)
        return Ranks(gathered, self)

    def broadcast(self, X, ctx_list):
        """``X`` (one NDArray) on each rank's context of ``ctx_list``, a value every rank holds: rank 0's copy
        recorded (when a gradient flows to ``X``), the others' unrecorded copies, so ``X`` gets the gradient of one
        rank's copy (every rank's carries the whole, as ``gather``'s do). Queued; does not block."""
        x = X if self.tape is None else self.tape.read(X)
        copies = [(x if t == 0 else x.detach()) if ctx == x.context else
                  algorithms.copy_to(x if t == 0 else x.detach(), ctx) for t, ctx in enumerate(ctx_list)]
        self.keep(copies[:1], [x])
        self.keep(copies[1:], [])   # no gradient flows back from them
        return Ranks(copies, self)


class ReplicasF(RanksF):
    """The ``F`` of data-parallel replicas run in lockstep (``run_replicas``): ``F.op`` runs ``mx.nd.op`` on each
    replica's own arrays, recorded by autograd as any operator is (no tape); the parallel layers run as their gluon
    base classes on each replica (``splits`` is False). What a layer that exchanges values between replicas in
    the midst of a forward runs on: a mixture of experts' all-to-all (``parallel.models.moe``) at its seam
    ``mixture``, which hands the layer every replica's arrays at once, routed as one queue (``queues``,
    ``expert_groups``, ``sequence_groups``). ``expert_parallel``: how many consecutive replicas share their
    experts (an expert-parallel group). ``context``: how many consecutive replicas share each example's sequence
    (a context-parallel group): member ``t`` keeps slice ``t`` of the tokens (``context_part``: its seam
    ``split_tokens``), attention runs round the group (``ring_attention``: its seam ``attention``) and the members'
    slices are put side by side again where the model needs every token (``context_gather``: its seam
    ``gather_tokens``). ``in_region``: ``RanksF``'s. ``tensor``
    T: each replica is a tensor-parallel group, its T ranks'
    arrays one after the other; the parallel layers split over each group (``splits``) and record on ``tape`` (a
    ``SegmentTape`` of ``group`` T). Which array is which replica's rank: ``mesh`` (a ``parallel.mesh.Mesh`` of
    the data, expert, context and tensor axes, array ``r`` its rank ``r``)."""

    splits = False

    def __init__(self, ranks, expert_parallel=1, context=1, tensor=1, tape=None, in_region=False):
        super().__init__(ranks, tape, in_region)
        check_int(tensor, "tensor", low=1, high=self.ranks)
        if self.ranks % tensor:
            raise BadValue("tensor", f"{{tensor={tensor}}} cannot group {ranks} arrays; give a divisor of them")
        self.tensor, self.replicas = tensor, self.ranks // tensor
        # replicas that are tensor groups: the parallel layers split over each group's ranks, on the tape
        self.splits = tensor > 1
        for value, name in ((expert_parallel, "expert_parallel"), (context, "context")):
            check_int(value, name, low=1, high=self.replicas)
            if self.replicas % value:
                raise BadValue(name, f"{{{name}={value}}} cannot group {self.replicas} replicas; give a divisor of "
                                     "them")
        if self.replicas % (expert_parallel * context):
            raise BadValue("context", f"{{expert_parallel={expert_parallel}}} x {{context={context}}} cannot group "
                                      f"{self.replicas} replicas; give a divisor of them")
        self.expert_parallel, self.context = expert_parallel, context
        self.mesh = Mesh(self.replicas // (expert_parallel * context), expert_parallel, context, tensor=tensor)

    def ranks_of(self, t):
        """The positions of tensor rank ``t``'s arrays, one a replica, in order."""
        return self.mesh.group(*REPLICA_AXES, tensor=t).ranks

    def queues(self):
        """The arrays a mixture of experts routes as one queue (``parallel.models.moe``), one list of positions a
        queue: inside the sequence region all of them, each rank holding its slice of its replica's tokens; else
        each tensor rank's, one a replica (a replica's ranks hold the same tokens and route them alone, alike)."""
        if self.in_region:
            return [list(range(self.ranks))]
        return [list(self.ranks_of(t)) for t in range(self.tensor)]

    def expert_groups(self, where):
        """The expert-parallel groups among the arrays ``where`` (a queue of ``queues``): the mesh's groups along
        the expert axis that ``where`` holds, each a tuple of positions in ``where``."""
        return self._groups_among(where, "expert")

    def sequence_groups(self, where):
        """The arrays among ``where`` that hold slices of the same examples' tokens, slice after slice (a tuple of
        positions in ``where`` a group, in the batch's order): the context groups' members, and inside the sequence
        region the tensor groups' ranks. Groups of one when no array shares its examples."""
        return self._groups_among(where, *(("context", "tensor") if self.in_region else ("context",)))

    def _groups_among(self, where, *axes):
        at = {r: i for i, r in enumerate(where)}
        return [tuple(at[r] for r in group.ranks) for group in self.mesh.groups(*axes) if group.ranks[0] in at]

    def mixture(self, layer, x, *weights):
        """The seam of a mixture of experts (``parallel.models.moe.MoEFeedForward``): ``layer.forward_all`` on each
        queue of arrays (``queues``), with its expert groups and the arrays holding slices of the same examples
        (``expert_groups``, ``sequence_groups``); so the replicas' tokens are routed as one context's, and sent to
        the replicas holding their experts and back. When every tensor rank routed its copy of the same tokens,
        ``layer.last`` holds one routing and every rank's auxiliary losses (``copies``). The outputs and auxiliary
        losses are kept on the tape, if any. Returns a ``Ranks``; waits for the router (``moe.route``)."""
        arrays = [self.arrays_of(x)] + [w.arrays for w in weights]
        outputs, aux = [None] * self.ranks, [None] * self.ranks
        queues = self.queues()   # one a tensor rank (each rank's copy of the tokens routed alone), or one of all
        for where in queues:
            outs = layer.forward_all([arrays[0][r] for r in where], [[a[r] for r in where] for a in arrays[1:]],
                                     self.expert_groups(where), self.sequence_groups(where))
            for i, r in enumerate(where):
                outputs[r] = outs[i]
                aux[r] = layer.last.aux[i] if layer.last.aux else None
        if len(queues) > 1:   # every rank routed the same tokens: one routing, every rank's auxiliary losses
            layer.last = layer.last._replace(aux=[a for a in aux if a is not None], copies=len(queues))
        self.keep(outputs + layer.last.aux, arrays[0])   # on the tape, if any: a segment's arrays and heads
        return Ranks(outputs, self)

    def context_part(self, x, axis=1):
        """Each member's slice of ``x`` (whole on every member of a context-parallel group) along ``axis``: member
        ``t`` of C the ``t``-th of C slices as even as can be (``chunk_bounds``). Recorded: the gradient of the
        whole is each member's slice's."""
        length = x.arrays[0].shape[axis]
        bounds = algorithms.chunk_bounds(length, self.context)
        member = [self.mesh.coords(r).context for r in range(self.ranks)]   # its replica's place in the group
        return self.slice_axis(x, axis=axis, begin=self.per_rank([bounds[m] for m in member]),
                               end=self.per_rank([bounds[m + 1] for m in member]))

    def context_gather(self, x, axis=1):
        """Each member's copy of its context group's slices of ``x`` side by side along ``axis`` (``context_part``
        undone): its own slice read through autograd, the others' as recorded copies, so the gradient of every
        token reaches its member from the member whose loss reads it (a group's first: ``Hybrid``'s fan-in).
        Queued; does not block."""
        arrays, out = self.arrays_of(x), [None] * self.ranks
        for group in self.mesh.groups("context"):   # the slices of each tensor rank's copy, member after member
            for r in group.ranks:
                out[r] = mx.nd.concat(*[arrays[m] if m == r else algorithms.copy_to(arrays[m], arrays[r].context)
                                        for m in group.ranks], dim=axis)
        self.keep(out, arrays)
        return Ranks(out, self)

    def split_tokens(self, x, axis=1):
        """The seam where the tokens enter the blocks: with a context-parallel group each member's slice
        (``context_part``); then ``RanksF``'s (under sequence parallelism each rank its slice of its member's: the
        parallel layers gather the member's slice on every rank, ring attention runs on it round the context group,
        and the reduce-scatter after gives each rank its slice back)."""
        return super().split_tokens(self.context_part(x, axis=axis) if self.context > 1 else x, axis)

    def gather_tokens(self, x, axis=1):
        """The seam where the model needs every token again: ``RanksF``'s (each member's slice whole on its ranks),
        then with a context-parallel group every member's slices side by side (``context_gather``)."""
        x = super().gather_tokens(x, axis)
        return self.context_gather(x, axis=axis) if self.context > 1 else x

    def attention(self, q, k, v, scale):
        """The seam of attention: with a context-parallel group round its ring (``ring_attention``), else
        dot-product attention on each replica."""
        return self.ring_attention(q, k, v, scale) if self.context > 1 else super().attention(q, k, v, scale)

    def ring_attention(self, q, k, v, scale):
        """Attention of each member's queries over its whole group's keys and values, by ring attention
        (``parallel.models.ring``): ``q``, ``k``, ``v`` are ``Ranks`` of ``(B, S_t, d)``."""
        out = [None] * self.ranks
        q, k, v = (self.arrays_of(x) for x in (q, k, v))
        for group in self.mesh.groups("context"):   # each tensor rank's heads round the ring of its rank
            members = group.ranks
            for r, o in zip(members, ring_attention([q[r] for r in members], [k[r] for r in members],
                                                    [v[r] for r in members], scale)):
                out[r] = o
        self.keep(out, q + k + v)
        return Ranks(out, self)


def _ranks_mode(F):
    """Whether ``F`` runs the parallel layers split over a tensor-parallel group's ranks."""
    return isinstance(F, RanksF) and F.splits


def _parameters(block):
    """``{attribute: Parameter}`` of the block itself (what gluon passes its ``hybrid_forward``), in order."""
    return {name: value for name, value in vars(block).items() if isinstance(value, gluon.Parameter)}


# ---- the layers -------------------------------------------------------------------------------------------------

class ColumnParallelDense(nn.Dense, ParallelLayer):
    """``nn.Dense`` whose output units are split over the ranks (the rows of its weight and its bias).

    Parameters
    ----------
    units, flatten, **kwargs
        ``nn.Dense``'s (``activation``, ``use_bias``, ``in_units``, initializers, ``prefix``, ...).
    parts : int
        The units are ``parts`` equal consecutive parts (3: a fused query, key and value layer), each split alike.
    unit : int
        Units dealt to a rank together (a head's width); ``units`` must be ``parts`` parts of whole units.
    gather_output : bool
        Ranks mode: give every rank all the units (the ranks' outputs side by side, ``RanksF.gather``) rather than
        its own (what a row-parallel layer after it reads).

    Inside sequence parallelism's region (``RanksF.in_region``: its input is each rank's slice of the tokens), f
    is the all-gather of the sequence.
    """

    def __init__(self, units, parts=1, unit=1, gather_output=False, flatten=True, **kwargs):
        super().__init__(units, flatten=flatten, **kwargs)
        self._split = Split(0, parts, unit)
        if units % (parts * unit):
            raise BadValue("units", f"{{units={units}}} are not {parts} part(s) of whole blocks of {unit}; give units "
                                    f"a multiple of {parts * unit}")
        self._gather_output = check_bool(gather_output, "gather_output")
        self._flatten_input = flatten

    def shard_specs(self):
        """``{attribute: spec}``: the weight's and the bias's rows split alike."""
        return {name: self._split for name in _parameters(self)}

    def hybrid_forward(self, F, x, weight, bias=None):
        """Ordinary mode: ``nn.Dense``'s. Ranks mode: f, then the rank's units (of the activation), gathered with
        ``gather_output``."""
        if not _ranks_mode(F):
            return super().hybrid_forward(F, x, weight, bias)
        x = F.all_gather(x) if F.in_region else F.f(x)
        out = F.FullyConnected(x, weight, bias, no_bias=bias is None, flatten=self._flatten_input,
                               num_hidden=F.per_rank([w.shape[0] for w in weight.arrays]))
        if self.act is not None:
            out = self.act(out)
        return F.gather(out, axis=-1) if self._gather_output else out


class RowParallelDense(nn.Dense, ParallelLayer):
    """``nn.Dense`` whose inputs are split over the ranks (the columns of its weight); its bias replicated.

    Parameters
    ----------
    units, flatten, **kwargs
        ``nn.Dense``'s.
    parts, unit : int
        How the input's features are dealt to the ranks: as the column-parallel layer before it deals its units.

    Inside sequence parallelism's region (``RanksF.in_region``), g is the reduce-scatter of the sequence (each rank
    its slice of the sum), and the bias is added to the slice.
    """

    def __init__(self, units, parts=1, unit=1, flatten=True, **kwargs):
        super().__init__(units, flatten=flatten, **kwargs)
        self._split = Split(1, parts, unit)
        self._units_out, self._flatten_input = units, flatten

    def shard_specs(self):
        """``{"weight": its columns split}``; the bias is replicated."""
        return {"weight": self._split}

    def hybrid_forward(self, F, x, weight, bias=None):
        """Ordinary mode: ``nn.Dense``'s. Ranks mode: ``x`` is each rank's part of the input: the rank's partial
        product, g, then the bias (and the activation)."""
        if not _ranks_mode(F):
            return super().hybrid_forward(F, x, weight, bias)
        out = F.FullyConnected(x, weight, no_bias=True, num_hidden=self._units_out, flatten=self._flatten_input)
        out = F.reduce_scatter(out) if F.in_region else F.g(out)
        if bias is not None:
            out = F.broadcast_add(out, bias)
        return out if self.act is None else self.act(out)


class ParallelPatchEmbedding(nn.Conv2D, ParallelLayer):
    """``nn.Conv2D`` of kernel and stride ``patch`` (no padding): each patch of ``patch`` pixels projected to
    ``channels``; the pixels of a patch split over the ranks (its weight seen as (channels, pixels)), its bias
    replicated.

    Parameters
    ----------
    channels : int
        The output channels.
    patch : int or (int, int)
        A patch's height and width: the convolution's kernel and stride.
    **kwargs
        ``nn.Conv2D``'s but for the kernel, strides, padding, dilation, groups and layout (``in_channels``,
        ``activation``, ``use_bias``, initializers, ``prefix``, ...).
    """

    def __init__(self, channels, patch, **kwargs):
        for name in ("kernel_size", "strides", "padding", "dilation", "groups", "layout"):
            if name in kwargs:
                raise BadValue(name, f"a patch embedding's kernel and stride are its patch, without padding, "
                                     f"dilation or groups, in layout NCHW; drop {{{name}}}")
        patch = (patch, patch) if isinstance(patch, int) else tuple(patch)
        for i, side in enumerate(patch):
            check_int(side, f"patch[{i}]" if len(patch) > 1 else "patch", low=1)
        super().__init__(channels, kernel_size=patch, strides=patch, **kwargs)
        self._patch, self._channels_out = patch, channels
        self._split = Split(1, flatten=True)

    def shard_specs(self):
        """``{"weight": its pixels split}`` (a flattened split: rank ``t`` holds a (channels, pixels) part)."""
        return {"weight": self._split}

    def hybrid_forward(self, F, x, weight, bias=None):
        """Ordinary mode: ``nn.Conv2D``'s. Ranks mode: f, the rank's pixels of each patch through its part of the
        weight, g, the bias: ``(N, channels, H / patch, W / patch)`` as the convolution gives it."""
        if not _ranks_mode(F):
            return super().hybrid_forward(F, x, weight, bias)
        x = F.f(x)   # each rank reads its pixels: the input's gradient is the sum of the ranks' (none for images)
        (ph, pw), (height, width) = self._patch, x[0].shape[2:]
        rows, cols = height // ph, width // pw
        if (rows * ph, cols * pw) != (height, width):   # the convolution drops what no patch covers
            x = F.slice_axis(F.slice_axis(x, axis=2, begin=0, end=rows * ph), axis=3, begin=0, end=cols * pw)
        patches = F.transpose(F.reshape(x, (0, 0, -4, -1, ph, -4, -1, pw)), (0, 2, 4, 1, 3, 5))
        patches = F.reshape(patches, (0, -3, -1))                                # (N, patches, pixels)
        T = F.tensor
        pixels = sum(w.shape[1] for w in weight.arrays[:T])
        mine = [self._split.indices(pixels, F.mesh.coords(r).tensor, T) for r in range(F.ranks)]
        patches = F.slice_axis(patches, axis=2, begin=F.per_rank([int(i[0]) if len(i) else 0 for i in mine]),
                               end=F.per_rank([int(i[-1]) + 1 if len(i) else 0 for i in mine]))
        out = F.g(F.FullyConnected(patches, weight, no_bias=True, num_hidden=self._channels_out, flatten=False))
        if bias is not None:
            out = F.broadcast_add(out, bias)
        if self.act is not None:
            out = self.act(out)
        return F.reshape(F.transpose(out, (0, 2, 1)), (0, 0, rows, cols))   # (N, channels, rows, cols)


# ---- a block's arrays over the ranks ----------------------------------------------------------------------------

def _blocks(block):
    if not isinstance(block, gluon.Block):
        raise BadType("block", f"{{block}} must be a gluon Block, got {type(block).__name__}")
    found = []
    block.apply(found.append)   # children first, the block last
    return found


def shard_specs(block):
    """The shard spec of every trainable parameter of ``block``: ``{param.name: spec}`` in ``block_state`` order,
    ``Replicated()`` unless a layer of it says otherwise (a ``ParallelLayer``'s ``shard_specs()``). The block need
    not be initialized."""
    declared = {}
    for child in _blocks(block):
        if isinstance(child, ParallelLayer):
            params = _parameters(child)
            declared.update((params[name].name, spec) for name, spec in child.shard_specs().items())
    return {param.name: declared.get(param.name, Replicated())
            for param in block.collect_params().values() if param.grad_req != "null"}


def most_ranks(block):
    """The most ranks ``block`` splits over with every rank holding a part of every split array (its heads,
    its units, ...): an int, or None when nothing of it is split. The block must be initialized."""
    names, arrays, _, _ = block_state(block)
    most = None
    for spec, array in zip(shard_specs(block).values(), arrays):
        if isinstance(spec, Split):
            shape = (array.shape[0], array.size // array.shape[0]) if spec.flatten else array.shape
            blocks = spec.blocks(shape[spec.axis])
            most = blocks if most is None else min(most, blocks)
    return most


def local_arrays(block, arrays, t, T):
    """Rank ``t``'s (of ``T``) parts of ``arrays``, the block's trainable arrays in ``block_state`` order: new
    arrays on each array's context (``spec.local``). Queued; does not block.

    Raises
    ------
    parallel.validate.BadValue
        For a count of arrays that is not the block's, or ``T`` beyond ``most_ranks``.
    """
    specs = list(shard_specs(block).values())
    if len(arrays) != len(specs):
        raise BadValue("arrays", f"{{arrays}} has {len(arrays)} arrays but the block trains {len(specs)}; give "
                                 "block_state(block)'s")
    most = most_ranks(block)
    if most is not None and T > most:
        raise BadValue("T", f"T={T} ranks cannot all hold a part of the block: it splits over at most {most}")
    return [spec.local(array, t, T) for spec, array in zip(specs, arrays)]


def joined_arrays(block, parts):
    """The block's whole arrays from the ranks' ``parts`` (``parts[t]`` rank ``t``'s, in ``block_state`` order,
    NDArrays or numpy arrays: its arrays or their gradients), each in the block's shape (``spec.join``). Reads
    the parts: blocks until they are computed."""
    names, arrays, _, _ = block_state(block)
    specs = list(shard_specs(block).values())
    return [spec.join([rank[i] for rank in parts], shape=arrays[i].shape) for i, spec in enumerate(specs)]


def replicate_ranks(block, ctx_list):
    """Each rank's arrays of ``block`` (rank ``t`` on ``ctx_list[t]``, T = ``len(ctx_list)``), as ``run_ranks``
    takes them: ``FlatReplica``s of ``local_arrays`` with gradients attached, their ``names`` the block's, their
    ``aux`` (running statistics) whole copies. Queued; does not block."""
    ctx_list = check_contexts(ctx_list)
    names, arrays, aux_names, aux = block_state(block)
    replicas = []
    for t, ctx in enumerate(ctx_list):
        local = get_params(local_arrays(block, arrays, t, len(ctx_list)), ctx)
        replicas.append(FlatReplica(local, local.data, local.grads, local.buckets, names,
                                    [a.copyto(ctx) for a in aux], aux_names))
    return replicas


# ---- running a block on the ranks -------------------------------------------------------------------------------

def _rank_tables(parts):
    tables = []
    for t, arrays in enumerate(parts):
        names = names_of(arrays)
        if names is None or len(names) != len(arrays):
            raise BadType("parts", f"{{parts}}[{t}] must be a sequence of arrays with their param.names as .names "
                                   "(replicate_ranks gives them)")
        table = dict(zip(names, arrays))
        table.update(zip(aux_names_of(arrays), aux_of(arrays)))
        tables.append(table)
    return tables


def block_plan(block):
    """``[(child, {attribute: param.name})]``: every block of ``block`` (children first) and what its
    ``hybrid_forward`` takes as parameters, worked out once per ``RankedNet``."""
    plan = []
    for child in _blocks(block):
        if not isinstance(child, gluon.HybridBlock):
            raise BadType("block", f"{{block}} runs on ranks through its blocks' hybrid_forward; "
                                   f"{type(child).__name__} is not a HybridBlock")
        plan.append((child, {attr: param.name for attr, param in _parameters(child).items()}))
    return plan


def _rank_params(names, F, tables):
    params = {}
    for attr, name in names.items():
        missing = [t for t, table in enumerate(tables) if name not in table]
        if missing:
            raise BadValue("parts", f"{{parts}}[{missing[0]}] has no array named {name}; give every rank the "
                                    "block's arrays")
        params[attr] = Ranks([table[name] for table in tables], F)
    return params


def _contexts(X, parts):
    if isinstance(X, Ranks):
        return [x.context for x in X.arrays]
    if not isinstance(X, mx.nd.NDArray):
        raise BadType("X", f"{{X}} must be an NDArray (copied to every rank) or a Ranks, got {type(X).__name__}")
    if any(len(arrays) == 0 for arrays in parts):
        raise BadValue("parts", "a rank without arrays has no context; give X as a Ranks on the ranks' contexts")
    return [arrays[0].context for arrays in parts]


def run_ranks(block, X, parts, tape=None, in_region=False):
    """Run ``block`` on the T = ``len(parts)`` ranks of a tensor-parallel group: its own ``hybrid_forward`` code,
    each parallel layer's ranks mode, every other layer replicated; Megatron's f and g recorded on ``tape``.

    Parameters
    ----------
    block : mxnet.gluon.HybridBlock
        Any hybrid block made of the layers here and ordinary gluon layers (whose parameters are replicated).
    X : NDArray or Ranks
        The input: one array (the images), copied to every rank's context; or each rank's input.
    parts : sequence of sequences of NDArray
        ``parts[t]``: rank ``t``'s arrays on its context, with ``.names`` (their ``param.name``) and optionally
        ``.aux`` and ``.aux_names`` (``replicate_ranks`` gives them; a parameter missing from them is an error).
    tape : parallel.comm.SegmentTape, optional
        Records the forward under ``autograd.record()`` (default: a new one: evaluation).
    in_region : bool
        ``X`` is each rank's slice of the tokens: the block starts inside sequence parallelism's region
        (``RanksF``'s ``in_region``; only with a tape of ``sequence``).

    Returns
    -------
    Ranks
        The block's output on every rank (a column-parallel layer's, without ``gather_output``, is each rank's
        part), as ``tape.read`` gives it.

    Training, Megatron's way: every rank computes the loss from its own output and ``tape.backward(losses)``
    takes all T (the same value on every rank: report one). A value every rank holds (g's sum, a gathered
    output, what replicated layers make of them) carries its whole gradient on every rank; a loss on one rank
    only would leave the others' parts without theirs.

    For the duration of the call each block of ``block`` gets an instance attribute ``forward`` (gluon's
    ``Block.__call__`` calls ``self.forward``) that calls its ``hybrid_forward`` with a ``RanksF`` and the ranks'
    arrays of its parameters; they are removed when it returns or raises. Not thread-safe: the block cannot run
    elsewhere meanwhile. Nothing waits; the work is queued on each rank's context.
    """
    return _run_ranks(block, block_plan(block), X, parts, tape, in_region)


def _run_ranks(block, plan, X, parts, tape, in_region=False):
    """``run_ranks`` with ``block``'s ``block_plan`` given."""
    tape = SegmentTape() if tape is None else tape
    contexts = _contexts(X, parts)
    F = RanksF(len(contexts), tape, in_region)
    if len(parts) != F.ranks:
        raise BadValue("parts", f"{{parts}} has {len(parts)} ranks' arrays for an input on {F.ranks} ranks")
    _rank_tables(parts)   # every rank's arrays named, before the tape takes them
    for arrays in parts:
        tape.parameters(list(arrays), arrays.names)
    X = F.broadcast(X, contexts) if isinstance(X, mx.nd.NDArray) else X
    out = _run_with(block, plan, X, parts, F)
    if isinstance(out, tuple):
        return tuple(Ranks(tape.read_each(r.arrays), F) for r in out)
    return Ranks(tape.read_each(out.arrays), F)


def run_replicas(block, X_shards, parts, expert_parallel=1, context=1, tensor=1, tape=None, plan=None,
                 in_region=False):
    """Run ``block`` on data-parallel replicas in lockstep: replica ``r``'s input ``X_shards[r]`` with its arrays
    ``parts[r]`` (with ``.names``, as ``run_ranks`` takes them), every operator run replica by replica through a
    ``ReplicasF`` and recorded by autograd as usual (no tape: one ``autograd.backward`` of the replicas' losses
    runs the whole backward pass, the copies between replicas' contexts included). What a layer that exchanges
    values between replicas (``parallel.models.moe``) needs: every replica's values at once. Returns a ``Ranks``
    of the outputs; nothing waits (but what such a layer reads on the host). ``expert_parallel``, ``context``:
    ``ReplicasF``'s groups. With ``tensor`` T, each replica is a tensor-parallel group: ``X_shards`` and ``parts``
    hold every replica's T ranks' inputs and arrays, replica after replica, and the parallel layers split over each
    group, recording on ``tape`` (``run_ranks``'s). ``plan``: ``block_plan(block)``, when the caller keeps it.
    ``in_region``: the block starts inside sequence parallelism's region (``RanksF``'s)."""
    return _run_with(block, block_plan(block) if plan is None else plan, Ranks(list(X_shards)), parts,
                     ReplicasF(len(X_shards), expert_parallel, context, tensor, tape, in_region))


def _run_with(block, plan, X, parts, F):
    """``block``'s own code run with ``F`` on the ranks' (or replicas') arrays ``parts``, input the ``Ranks``
    ``X``; the blocks' ``forward`` restored afterwards."""
    tables = _rank_tables(parts)
    saved = []
    try:
        for child, names in plan:
            saved.append((child, vars(child).get("forward")))
            child.forward = functools.partial(_forward_on_ranks, child, F, _rank_params(names, F, tables))
        return block(Ranks(X.arrays, F))
    finally:
        for child, forward in reversed(saved):
            vars(child).pop("forward", None)
            if forward is not None:
                vars(child)["forward"] = forward


def _forward_on_ranks(block, F, params, x, *args):
    """What a block's ``forward`` is during ``run_ranks``: its ``hybrid_forward`` on the ranks."""
    return block.hybrid_forward(F, x, *args, **params)


class RankedNet(Net):
    """A block as a net of the replicas of a step whose every replica is a tensor-parallel group:
    ``forward_all(X_shards, parts, tape)`` runs ``block`` (``run_ranks``) on each replica's input (a ``Ranks``, or
    the images) with its ranks' arrays ``parts[r]`` (one sequence a rank), recording on ``tape``. What a chunk of a
    ``parallel.strategies.Hybrid`` with tensor ranks runs. ``in_region``: its input is each rank's slice of the
    tokens under sequence parallelism (``run_ranks``'s; where a model's plan puts it, ``parallel.models.plan``)."""

    ranked = True   # its forward records on the step's tape

    def __init__(self, block, in_region=False):
        self.block, self.in_region = block, in_region
        self._plan = block_plan(block)   # the block's layers and their parameters: fixed once it is built

    def __repr__(self):
        return f"RankedNet({type(self.block).__name__})"

    def forward_all(self, X_shards, parts, tape=None):
        """Each replica's output, a ``Ranks``; nothing waits."""
        return [_run_ranks(self.block, self._plan, X, ranks, tape, self.in_region)
                for X, ranks in zip(X_shards, parts)]
