"""A block as the net of a step's data replicas run in lockstep: what a chunk of a ``parallel.strategies.Hybrid``
runs when its layers exchange values between replicas in the midst of a forward (a mixture of experts' all-to-all,
``parallel.models.moe``; ring attention over a context-parallel group, ``parallel.models.ring``).

``LockstepNet(block, expert_parallel, context, meter)`` is to replicas what ``RankedNet`` is to tensor ranks: its
``forward_all(X_shards, parts)`` runs ``block`` on every replica at once (``run_replicas``: each operator replica by
replica, recorded by autograd, no tape). A recorded run leaves the auxiliary losses of its MoE layers, one a
replica, for the backward pass of the same run (``take_heads``, which ``parallel.models.recompute.Blocks`` calls
after each recorded run of a block: its backward takes them as heads besides the block's outputs), each with the
gradient ``n``, the examples of the run, as a step gives them: the step divides every
gradient by the batch, so a batch run whole learns its auxiliary losses, and one run in micro-batches the mean of
theirs weighted by their examples (as ``accumulate`` does). Each recorded run counts its layers' routing on the
``meter`` (``parallel.models.moe.RoutingMeter``): a recomputed block is counted once, in the run its backward
follows.

Over tensor ranks (``tensor`` T) each replica is a tensor-parallel group: one ``SegmentTape`` records every
replica's ranks (its collectives over each group's T arrays), a replica's input and output are a ``Ranks`` of its
group, and the MoE layers and ring attention keep what they make on the tape.

Evaluation (outside ``autograd.record()``) runs in training mode: in inference MXNet's oneDNN operators reorder a
weight in place into a blocked layout, which a view into a replica's flat buffer cannot take. The models it runs
have no layer that the mode changes (no dropout; BatchNorm is refused by the strategies).

>>> import mxnet as mx
>>> from mxnet import autograd
>>> from parallel.comm.replica import block_state
>>> from parallel.models.layers import replicate_ranks
>>> from parallel.models.moe import MoEFeedForward
>>> layer = MoEFeedForward(dim=4, hidden=8, experts=2)
>>> layer.initialize(mx.init.Normal(0.5))
>>> parts = replicate_ranks(layer, [mx.cpu(0), mx.cpu(1)])   # two replicas, each holding both experts
>>> net = LockstepNet(layer)
>>> X = [mx.nd.ones((3, 5, 4), ctx=mx.cpu(t)) for t in range(2)]
>>> with autograd.record():
...     out = net.forward_all(X, parts)
>>> heads, grads = net.take_heads()
>>> len(heads), grads[0].asscalar()   # each replica's auxiliary loss, its gradient the run's 6 examples
(2, 6.0)
"""
import mxnet as mx
from mxnet import autograd

from ..comm.tensor import SegmentTape
from ..mesh import Mesh
from .base import Net
from .layers import Ranks, RanksF, block_plan, run_replicas
from .moe import moe_layers

__all__ = ["LockstepNet", "fan_out"]


def fan_out(X_shards, contexts, groups):
    """Each context-parallel group's shard given to its members: ``groups[g]`` the replicas (positions in
    ``contexts``, one a replica) of the group whose shard is ``X_shards[g]`` (``Mesh.replica_groups("context")``),
    the first member taking the shard itself and the others a copy on their context (not recorded: no gradient
    flows to the images). One input a replica, in the replicas' order."""
    inputs = [None] * len(contexts)
    for X, members in zip(X_shards, groups):
        for i, r in enumerate(members):
            inputs[r] = X if i == 0 else X.copyto(contexts[r])
    return inputs


class LockstepNet(Net):
    """``block`` as a net of replicas run in lockstep (see the module's docstring).

    Parameters
    ----------
    block : mxnet.gluon.HybridBlock
        The block (a stage, or one block of it); its ``hybrid_forward`` code runs with a ``ReplicasF``.
    expert_parallel, context : int
        The replicas' groups (``ReplicasF``'s): consecutive replicas that share their experts, or each example's
        tokens.
    meter : parallel.models.moe.RoutingMeter, optional
        Where the recorded runs count their routing.
    tensor : int
        Each replica a tensor-parallel group of this many ranks: its parallel layers split over them, every
        replica's ranks recorded on one tape (``SegmentTape(group=tensor)``), each rank's auxiliary losses its own
        heads (Megatron's way: a rank's copy of a replicated array gets the whole gradient from its own loss).
    in_region : bool
        Its input is each rank's slice of the tokens under sequence parallelism (``run_replicas``'s; where a
        model's plan puts it, ``parallel.models.plan``).
    """

    def __init__(self, block, expert_parallel=1, context=1, meter=None, tensor=1, in_region=False):
        self.block, self.expert_parallel, self.context, self.meter = block, expert_parallel, context, meter
        self.tensor, self.in_region = tensor, in_region
        #: Whether its replicas are tensor-parallel groups, recording on a tape (``Blocks`` gives it one)
        self.ranked = tensor > 1
        self.layers = moe_layers(block)
        self._plan = block_plan(block)
        self._heads = ((), ())

    def __repr__(self):
        return f"LockstepNet({type(self.block).__name__})"

    def forward_all(self, X_shards, parts, tape=None):
        """Each replica's output (an array a replica; a ``Ranks`` of its tensor group's ranks with ``tensor``);
        nothing waits but the routing's reads. With ``tensor`` > 1 each replica's input is its images (copied to
        its ranks) or a ``Ranks``, its ``parts`` one sequence of arrays a rank, and the run records on ``tape``
        (a ``SegmentTape`` of ``group`` = ``tensor``); without, autograd records it alone."""
        if not autograd.is_recording():
            with autograd.train_mode():
                return self._run(X_shards, parts, tape)
        out = self._run(X_shards, parts, tape)
        # each layer's own, one a replica (a rank), not summed over the layers: on a tape each is its segment's head
        aux = [a for layer in self.layers for a in layer.last.aux]
        mesh = self._mesh(len(X_shards))
        first = [X if isinstance(X, mx.nd.NDArray) else X.arrays[0]
                 for X in (X_shards[g[0]] for g in mesh.replica_groups("context"))]
        examples = sum(X.shape[0] for X in first)   # a context group's members share theirs, a tensor group's ranks
        self._heads = (aux, [mx.nd.full((1,), examples, ctx=a.context, dtype=a.dtype) for a in aux])
        if self.meter is not None:
            self.meter.add(self.layers)
        return out

    def _run(self, X_shards, parts, tape):
        if self.tensor == 1:
            return run_replicas(self.block, X_shards, parts, self.expert_parallel, self.context,
                                plan=self._plan, in_region=self.in_region).arrays
        T, tape = self.tensor, SegmentTape(group=self.tensor) if tape is None else tape
        arrays, flat = [], []
        for X, ranks in zip(X_shards, parts):
            flat += list(ranks)
            contexts = [rank[0].context for rank in ranks]
            arrays += (RanksF(T, tape).broadcast(X, contexts) if isinstance(X, mx.nd.NDArray) else X).arrays
        for rank in flat:
            tape.parameters(list(rank), rank.names)
        out = run_replicas(self.block, arrays, flat, self.expert_parallel, self.context, T, tape, self._plan,
                           self.in_region)
        arrays = tape.read_each(out.arrays)
        return [Ranks([arrays[r] for r in group.ranks], out.F) for group in out.F.mesh.groups("tensor")]

    def _mesh(self, replicas):
        """The replicas' mesh (data, expert and context axes) of a run of ``replicas``."""
        return Mesh(replicas // (self.expert_parallel * self.context), self.expert_parallel, self.context)

    def take_heads(self):
        """The auxiliary losses of the last recorded run and their gradients, ``(heads, gradients)``, once."""
        heads, self._heads = self._heads, ((), ())
        return heads
