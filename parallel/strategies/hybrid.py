"""The composed strategy: data x pipeline stages x tensor ranks, with ZeRO and recomputation, in one class.

``Hybrid(params, ctx_list, layout)`` lays a model out as its ``parallel.layout.Layout`` says. With D replicas,
S stages (``virtual`` V chunks a stage) and T tensor ranks, context ``(d S + s) T + t`` of ``ctx_list`` holds
replica ``d``'s stage ``s``'s rank ``t``: four contexts and two stages give replica 0 = (cpu(0), cpu(1)) and
replica 1 = (cpu(2), cpu(3)). One step (``parallel.step.step_replicas``, the step of every strategy):

- the batch is split over the replicas (and, in a job, over the workers first), each replica's shard into
  ``micro_batches``;
- each micro-batch runs through the model's chunks in the schedule's order (``parallel.strategies.pipeline``),
  every replica at once: a chunk is a ``parallel.models.recompute.Blocks`` of its blocks, recomputed with
  ``recompute``, with ZeRO-3's hooks (``parallel.strategies.sharded``), each block run on its tensor group's ranks
  (``parallel.models.layers.run_ranks``: Megatron's f and g on the chunk's tape) when T > 1;
- every chunk's rank's gradients are summed over the replicas (a *group*: ``groups()``) by the Reducer, with its
  buckets, hook and job (ZeRO-2 reduce-scatters; ZeRO-3 reduce-scattered each block already), clipped over every
  group, and every replica takes the same optimizer step (``parallel.optim.optimizer_step``).

A model whose layers talk between replicas in the midst of a forward (a mixture of experts' all-to-all; each
example's tokens split over ``layout.context`` replicas, attention round their ring) runs each chunk's replicas in
lockstep (``parallel.models.lockstep.LockstepNet`` in place of each block's cached graph): each replica holds its
dense arrays and its expert-parallel member's experts (``expert_replicas``, summed over the replicas holding the
same experts), a block's auxiliary losses are heads of its own backward, and a context group's members are replicas
of their own (the first chunk gives each its group's shard, the last reports the group's first member's output).
With ZeRO-3 each member's experts are sharded over the replicas holding them; over tensor ranks each replica is a
tensor group, every replica's ranks recorded on one tape (``SegmentTape(group=T)``); with sequence parallelism
the router's and experts' gradients, each rank's its slice's part, are summed over the ranks with the layer norms'.

So every axis is a plug-in of the same step: the model and pipeline strategies are one replica of stages (their
presets ``ModelParallel`` and ``Pipeline``), the data strategy's ZeRO-3 (``FullyShardedDataParallel``) is one
stage of sharded blocks, tensor parallelism one stage of ranks.

>>> import mxnet as mx
>>> from parallel import init_lenet_params
>>> model = Hybrid(init_lenet_params(seed=0), [mx.cpu(i) for i in range(4)], Layout("hybrid", stages=2))
>>> model.describe()
'2 replicas x 2 stages: conv1,conv2 @ cpu(0),cpu(2) | dense1,dense2 @ cpu(1),cpu(3); gradients summed with the fused allreduce in buckets of 25 MiB'
>>> X, y = mx.nd.ones((8, 1, 28, 28)), mx.nd.array([0, 1, 2, 3, 4, 5, 6, 7])
>>> loss_sum, correct = model.train_step(X, y, lr=0.2)   # the same step as train_batch on one context

The same model as one context, but for BatchNorm fed micro-batches (each normalised alone, as GPipe does): every
layout of ``tests/test_layouts.py`` trains one context's model (bitwise where the sums are the same additions).
"""
import bisect
import functools

import mxnet as mx

from ..comm.reducer import as_reducer
from ..comm.replica import FlatReplica, block_state, get_params
from ..comm import algorithms
from ..comm.tensor import KeptBytes
from ..evaluate import accuracy
from ..job import KEYS, broadcast_arrays
from ..layout import Layout
from ..models.layers import Ranks, RankedNet, most_ranks
from ..models.lockstep import LockstepNet, fan_out
from ..models.moe import RoutingMeter, check_shared, expert_specs, moe_layers
from ..models.lenet import softmax_cross_entropy
from ..models.recompute import Blocks, Part, Segment, flat_arrays, parts_of
from ..models.registry import behaviour_of
from ..optim.zero import CopiedStore, ReplicatedStore, as_optimizer
from ..shard import Replicated
from ..step import Replicas, worker_step
from ..trace import issued
from ..validate import BadType, BadValue, check_bool, check_contexts
from .base import ArrayPlace, Strategy
from .data import batchnorm_across, describe_replicas
from .model import stage_ranges
from .pipeline import issue, micro_batches
from .schedules import pipeline_schedule
from .sharded import Keys, ShardedGroup, ShardedHooks

__all__ = ["Hybrid", "Chunk", "ModelParallel", "Pipeline", "FullyShardedDataParallel"]


class Chunk:
    """One chunk of the model (a pipeline stage, or one of a stage's virtual chunks) over the data-parallel
    replicas: its ``Blocks``, each block's arrays on every replica (``parts``; ``scratch`` with copies of the
    running statistics) and where each replica's ranks compute (``contexts[d][t]``)."""

    def __init__(self, blocks, parts, scratch, contexts, fan_out=None, fan_in=None):
        self.blocks, self.parts, self.scratch, self.contexts = blocks, parts, scratch, contexts
        # context parallelism: the first chunk gives each context group's shard to its members (fan_out: the
        # groups' replicas, Mesh.replica_groups("context")), the last gives each group's output as its first
        # member's (fan_in: the same groups); every chunk between runs every member
        self.fan_out, self.fan_in = fan_out, fan_in

    def _members(self, X_shards):
        """Each group's input on each of its members' first rank's context (``fan_out``)."""
        if self.fan_out is None:
            return list(X_shards)
        return fan_out(X_shards, [ranks[0] for ranks in self.contexts], self.fan_out)

    def _firsts(self, outputs):
        """Each group's output: its first member's (``fan_in``)."""
        return list(outputs) if self.fan_in is None else [outputs[group[0]] for group in self.fan_in]

    @property
    def ranks(self):
        return len(self.contexts[0])

    def forward(self, X_shards):
        """The recorded forward of each replica's input (call it inside ``autograd.record()``)."""
        outputs, pending = self.blocks.forward(self._members(X_shards), self.parts, self.scratch)
        return self._firsts(outputs), pending

    def backward(self, pending, heads, head_grads=None):
        self.blocks.backward(pending, heads, head_grads, self.parts)

    def predict(self, X_shards):
        return self._firsts(self.blocks.predict(self._members(X_shards), self.parts))

    def logits(self, out):
        """A replica's output as the step reports it: the first rank's."""
        return out if self.ranks == 1 else out[0]

    def losses(self, out, y, loss):
        """A replica's losses, one a rank: every rank computes the loss of its own output (Megatron's way: each
        rank's part of a gathered output gets its gradient from its own rank's loss); the first rank's is
        reported."""
        if self.ranks == 1:
            return [loss(out, y)]
        return [loss(part, y if part.context == y.context else y.as_in_context(part.context)) for part in out.arrays]

    def receive(self, outputs, grad=True):
        """The chunk before's ``outputs`` (one a replica), copied rank by rank to this chunk's contexts: its inputs,
        off the tape, gradients attached (``grad``)."""
        copies = []
        with issued("send", lambda: flat_arrays(outputs), "send forward"):   # named so in a trace (parallel.trace)
            for d, out in enumerate(outputs):
                if self.ranks == 1:
                    copies.append(algorithms.copy_to(out.detach(), self.contexts[d][0]))
                else:
                    copies.append(Ranks([algorithms.copy_to(a.detach(), ctx) for a, ctx in zip(out.arrays,
                                                                                                self.contexts[d])]))
        if grad:
            for array in flat_arrays(copies):
                array.attach_grad()
        return copies

    def send_back(self, inputs, before):
        """The gradients this chunk's ``inputs`` got, copied to the contexts of the chunk ``before`` it."""
        grads = []
        with issued("send", lambda: [a.grad for a in flat_arrays(inputs)], "send backward"):   # named so in a trace
            for d, X in enumerate(inputs):
                arrays = flat_arrays([X])
                grads += [algorithms.copy_to(a.grad, ctx) for a, ctx in zip(arrays, before.contexts[d])]
        return grads


def _check_chunks(layout, chunks, layers):
    """Interleaving cuts ``stages x virtual_stages`` chunks: more than the model's layers is refused naming the two
    flags the user gave (``stage_ranges`` would name a number of stages nobody typed)."""
    if chunks is None or layout.virtual == 1 or chunks <= layers.count:
        return
    stages, virtual = layout.stages_given, layout.virtual
    fits = [v for v in range(virtual - 1, 1, -1) if stages * v <= layers.count]
    advice = f"{{virtual_stages}} {fits[0]}" if fits else f"{{virtual_stages}} 1 or fewer {{stages}}"
    raise BadValue("virtual_stages", f"{stages} stages x {{virtual_stages={virtual}}} make {chunks} chunks, which "
                                     f"cannot split {layers.what}; use {advice}")


class Hybrid(Strategy, Replicas):
    """Data parallelism over replicas of pipeline stages of tensor groups, with ZeRO and recomputation (see the
    module's docstring).

    Parameters
    ----------
    params : list of NDArray, or mxnet.gluon.nn.HybridSequential
        The initial model (``parallel.models.init_model``): LeNet's arrays or an initialized gluon block with known
        shapes, cut at its children; copied, not modified.
    ctx_list : list of mxnet.Context
        Distinct contexts: replica ``d``'s stage ``s``'s rank ``t`` on ``ctx_list[(d S + s) T + t]``; the model and
        pipeline presets use ``S x T`` of them and leave the rest idle.
    layout : parallel.layout.Layout, optional
        The axes (default ``Layout("hybrid", stages, boundaries)``: replicas of two stages).
    reducer : parallel.Reducer or str, optional
        How every group's gradients are summed over the replicas (an allreduce's name, buckets, a hook or codec,
        a job); its algorithm is the tensor groups' f and g too. With a ``job``, every worker's replicas are
        data-parallel replicas of the job's (a collective constructor: every worker makes it, rank 0's initial
        model wins), each worker training its slice of each global batch; the stages and ranks of a replica stay
        in one process.
    prefetch : bool
        With ZeRO-3, gather the next block while the current one runs (two gather buffers a context).
    stages, boundaries : optional
        Without ``layout``: where the hybrid layout cuts the model (``stage_ranges``).

    Attributes
    ----------
    layout : Layout
    mesh : parallel.mesh.Mesh
        Where each replica's chunks and ranks compute: the data, expert, context, stage and tensor axes over
        ``ctx_list`` (and the job's workers).
    ranges : list of (int, int)
        The children (layers) of each chunk.
    chunks : list of Chunk
    replicas : list of list of list
        ``replicas[d][c][t]``: replica ``d``'s chunk ``c``'s rank ``t`` (a ``FlatReplica``); without ZeRO-3.
    sharded : list of list of ShardedGroup
        ``sharded[c][t]``: chunk ``c``'s rank ``t``'s arrays sharded over the replicas; with ZeRO-3.
    """

    def __init__(self, params, ctx_list, layout=None, reducer=None, prefetch=False, stages=None, boundaries=None):
        if layout is None:
            layout = Layout("hybrid", stages=stages, boundaries=boundaries)
        elif stages is not None or boundaries is not None:
            raise BadValue("stages", "{stages} and {boundaries} are the layout's: give them in the Layout")
        if not isinstance(layout, Layout):
            raise BadType("layout", f"{{layout}} must be a parallel.Layout, got {type(layout).__name__}")
        self.layout = layout
        self.layout.check()
        # a backward more than once a step (micro-batches), or shards that reductions add into (ZeRO-3): the step
        # zeroes the gradients first and adds into them; else each backward writes them, as one context's step
        self.adds_gradients = layout.micro > 1 or layout.zero == 3
        self.name, self.reducer = self.layout.strategy, as_reducer(reducer)
        if self.reducer.cross_barrier and layout.zero:
            raise BadValue("zero", f"{{zero={layout.zero}}} shards the flat buffers, and a cross barrier "
                                   "(Reducer(cross_barrier=True)) splits them into one buffer a bucket; use {zero=0} "
                                   "with a cross barrier")
        self.prefetch = check_bool(prefetch, "prefetch")
        ctx_list = check_contexts(ctx_list)
        behaviour = behaviour_of(params)
        layers = behaviour.layers(params)
        chunks = None if self.layout.boundaries is not None else self.layout.chunks
        _check_chunks(self.layout, chunks, layers)
        self.ranges = stage_ranges(chunks, self.layout.boundaries, *layers)
        job = self.job
        self.mesh = self.layout.place(ctx_list, *((1, 0) if job is None else (job.num_workers, job.rank)))
        self.ctx_list = list(self.mesh.contexts)
        self._check_lockstep(params)
        if len(self.ranges) % self.layout.virtual:
            raise ValueError(f"{len(self.ranges)} chunks cannot be dealt {self.layout.virtual} a device")
        self._cut = behaviour.cut(params, self.ranges)
        self._host = _host_model(params, self.job)
        self._specs = _tensor_specs(behaviour, params, self._host, self.mesh.shape.tensor)
        self._indices = [_chunk_indices(self._host, self._cut, c) for c in range(len(self.ranges))]
        self.kept = KeptBytes()   # what the tensor ranks' forwards of the last step kept for backward, per context
        self._summed, self._inside = _sequence_region(self.layout, behaviour, params, self._host, self._indices)
        self._lay_out(behaviour)
        self._places = self._array_places()
        if self.layout.virtual > 1:   # checked up front: the micro-batches come in groups of the stages
            pipeline_schedule(self.layout.schedule, self.mesh.shape.stage, self.layout.micro, self.layout.virtual)
        self.last_stash = []

    def __repr__(self):
        return f"{type(self).__name__}({self.describe()})"

    def _check_lockstep(self, params):
        """Whether the replicas run each chunk in lockstep (``parallel.models.lockstep``): a model with
        mixture-of-experts layers (each routes over the whole batch; its experts spread over groups of
        ``expert_parallel`` replicas), or each example's tokens split over groups of ``context`` replicas. Refuses
        what a lockstep chunk does not run in."""
        layers = moe_layers(params) if isinstance(params, mx.gluon.Block) else []
        self.lockstep = bool(layers) or self.layout.context > 1
        self.meter = RoutingMeter(layers)   # the training forwards' routing, until epoch_metrics reads it
        self._experts = expert_specs(params) if layers else {}
        #: a member that no token reaches leaves its experts' gradients unwritten, a context group's members but the
        #: first their heads' (no loss reads them): the step zeroes them first
        self.skips_parameters = self.lockstep
        #: the replicas compute together (a batch that leaves one idle is refused): the sums count them all
        self.computes_together = self.lockstep
        if not self.lockstep:
            if self.layout.expert_parallel > 1:
                raise BadValue("expert_parallel", "{expert_parallel} spreads the experts of a mixture-of-experts "
                                                  "model; the model has none: give it experts (vit(experts=E), "
                                                  "--experts)")
            return
        if layers:   # its experts shared equally by each expert-parallel group
            check_shared(layers, self.layout.expert_parallel)
        if block_state(params)[3]:
            what = "a mixture of experts" if layers else "{context}"
            raise BadValue("params", f"{what} trains models whose every array is trained (no BatchNorm)")

    # ---- the layout ------------------------------------------------------------------------------------------

    def context(self, d, c, t=0):
        """The context of replica ``d``'s chunk ``c``'s rank ``t``."""
        return self.mesh.context(replica=d, stage=c % self.mesh.shape.stage, tensor=t)

    def _lay_out(self, behaviour):
        """Each chunk's arrays on every replica and rank (or their shards), its blocks and their parts."""
        p, zero = self.mesh, self.layout.zero
        self.replicas = [[[None] * p.shape.tensor for _ in self.ranges] for _ in range(p.replicas)]
        self.expert_replicas = [[[None] * p.shape.tensor for _ in self.ranges] for _ in range(p.replicas)]
        self.views = [[[None] * p.shape.tensor for _ in self.ranges] for _ in range(p.replicas)]
        names = self._host[0]
        # the positions in each chunk's arrays of its experts' (expert parallelism gives each replica its own)
        self._expert_at = [[k for k, j in enumerate(index) if names and names[j] in self._experts]
                           for index, _ in self._indices]
        self._dense_at = [[k for k in range(len(index)) if k not in set(at)]
                          for (index, _), at in zip(self._indices, self._expert_at)]
        self.sharded = [[] for _ in self.ranges]
        self.expert_sharded = [[] for _ in self.ranges]
        self.chunks = []
        keys = [0, 0, len(self._host[1])]   # each group's first gather and bucket, and the model's arrays
        for c in range(len(self.ranges)):
            segments = (behaviour.stage_blocks(self._cut, c, fine=zero == 3) if self.layout.recompute or zero == 3
                        else [_whole_stage(self._cut, c, len(self._indices[c][0]), len(self._indices[c][1]))])
            inside = [self._starts_inside(c, s) for s in segments]   # the plan's: its input is the tokens' slices
            if self.lockstep:   # every replica at once (each a tensor group with ranks)
                segments = [Segment(LockstepNet(s.block, self.layout.expert_parallel, self.layout.context,
                                                self.meter, p.shape.tensor, i), s.first, s.stop, s.aux_first,
                                    s.aux_stop, s.label, s.block) for s, i in zip(segments, inside)]
            else:
                segments = _on_ranks(segments, p.shape.tensor, inside)
            contexts = [[self.context(d, c, t) for t in range(p.shape.tensor)] for d in range(p.replicas)]
            if zero == 3:
                self.chunks.append(self._sharded_chunk(c, segments, contexts, keys))
            else:
                self.chunks.append(self._replicated_chunk(c, segments, contexts))
        if self.mesh.shape.context > 1:   # (else a micro-batch may feed fewer replicas than there are)
            groups = self.mesh.replica_groups("context")
            self.chunks[0].fan_out, self.chunks[-1].fan_in = groups, groups

    def _starts_inside(self, c, segment):
        """Whether ``segment`` of chunk ``c`` starts inside sequence parallelism's region (the model's plan: its
        first array is one of ``plan.inside``'s)."""
        index = self._indices[c][0]
        return bool(self._inside) and segment.first < len(index) and self._host[0][index[segment.first]] in \
            self._inside

    def _local(self, c, t):
        """Chunk ``c``'s arrays as rank ``t`` holds them (its part of each), with their names, and its other
        arrays."""
        names, arrays, aux_names, aux = self._host
        index, aux_index = self._indices[c]
        local = [self._specs[i].local(arrays[i], t, self.mesh.shape.tensor) for i in index]
        return local, [names[i] for i in index] if names else None, [aux[i] for i in aux_index], \
            [aux_names[i] for i in aux_index]

    def _replicated_chunk(self, c, segments, contexts):
        p = self.mesh
        for t in range(p.shape.tensor):
            local, names, aux, aux_names = self._local(c, t)
            for d in range(p.replicas):
                specs = [self._specs[i] for i in self._indices[c][0]]
                if self._expert_at[c]:
                    dense, experts, self.views[d][c][t] = self._expert_replica(c, d, local, names, aux, aux_names,
                                                                               contexts[d][t])
                    self.replicas[d][c][t], self.expert_replicas[d][c][t] = dense, experts
                    if t:   # every rank of a tensor group holds its member's experts whole
                        _mark_copies(dense, [specs[k] for k in self._dense_at[c]])
                        _mark_copies(experts, [Replicated()] * len(experts))
                    continue
                self.replicas[d][c][t] = self.views[d][c][t] = _replica(local, names, aux, aux_names, contexts[d][t],
                                                                         self.reducer.bucket_mb)
                if self.reducer.cross_barrier:   # before the blocks keep its members
                    self.replicas[d][c][t].split_parameters()
                if t:   # a global norm (clipping) counts the arrays every rank holds once
                    _mark_copies(self.replicas[d][c][t], specs)
        own = [[parts_of(segments, self.views[d][c][t]) for t in range(p.shape.tensor)] for d in range(p.replicas)]
        spare = [[parts_of(segments, self.views[d][c][t], scratch=True) for t in range(p.shape.tensor)]
                 for d in range(p.replicas)]
        parts = [[[own[d][t][s] for t in range(p.shape.tensor)] for d in range(p.replicas)] for s in range(len(segments))]
        scratch = [[[spare[d][t][s] for t in range(p.shape.tensor)] for d in range(p.replicas)] for s in range(len(segments))]
        blocks = Blocks(segments, recompute=self.layout.recompute, algorithm=self.reducer.algorithm,
                        retain_graph=self.layout.micro > 1, sequence=self.layout.sequence, kept=self.kept)
        return Chunk(blocks, _per_rank(parts, p.shape.tensor), _per_rank(scratch, p.shape.tensor), contexts)

    def _expert_replica(self, c, d, local, names, aux, aux_names, ctx):
        """Replica ``d``'s arrays of chunk ``c`` with experts: its dense arrays (a ``FlatReplica``, with the other
        arrays), its experts' (those of its coordinate on the mesh's expert axis: another), and both as the chunk's
        blocks read them (a list in the chunk's order, with its ``names`` and ``aux``)."""
        P, at, dense_at = self.layout.expert_parallel, self._expert_at[c], self._dense_at[c]
        bucket_mb = self.reducer.bucket_mb
        dense = _replica([local[k] for k in dense_at], [names[k] for k in dense_at], aux, aux_names, ctx, bucket_mb)
        member = self.mesh.replica_coords(d).expert
        experts = _replica([self._experts[names[k]].local(local[k], member, P) for k in at], [names[k] for k in at],
                           [], [], ctx, bucket_mb)
        by_position = dict(zip(dense_at, dense))
        by_position.update(zip(at, experts))
        view = Part([by_position[k] for k in range(len(local))], list(names), dense.aux)
        return dense, experts, view

    def _sharded_chunk(self, c, segments, contexts, keys):
        if self._expert_at[c]:
            return self._sharded_expert_chunk(c, segments, contexts, keys)
        p = self.mesh
        # a checkpoint's gathers in a job: a key per array and group holding part of it (tensor ranks; with experts,
        # the dense group and the members: every group of the model numbered alike, see _sharded_expert_chunk)
        per_rank = self.layout.expert_parallel + 1 if self._experts else 1   # groups a tensor rank holds
        groups = []
        for t in range(p.shape.tensor):
            local, names, aux, _ = self._local(c, t)
            group = ShardedGroup(local, names, aux, segments, [contexts[d][t] for d in range(p.replicas)], self.reducer,
                                 Keys(keys[0], keys[1], t * per_rank, per_rank * p.shape.tensor, keys[2]),
                                 self.prefetch)
            if t:
                _mark_shard_copies(group, [self._specs[i] for i in self._indices[c][0]])
            keys[0] += len(segments) * p.replicas
            keys[1] += len(segments)
            groups.append(group)
        self.sharded[c] = groups
        parts = [[[group.parts[s][d] for group in groups] for d in range(p.replicas)] for s in range(len(segments))]
        scratch = [[[group.scratch[s][d] for group in groups] for d in range(p.replicas)] for s in range(len(segments))]
        summed = functools.partial(self._sum_sequence, c, groups) if self._summed[c] else None
        blocks = self._sharded_blocks(segments, groups, summed)
        return Chunk(blocks, _per_rank(parts, p.shape.tensor), _per_rank(scratch, p.shape.tensor), contexts)

    def _sharded_expert_chunk(self, c, segments, contexts, keys):
        """Chunk ``c`` with experts, ZeRO-3: on each tensor rank, its dense arrays (that rank's parts) sharded over
        every replica (a ``ShardedGroup``) and each member's experts (whole on every rank) over the replicas holding
        them (one group a member); a block's parameters on replica ``d``'s rank ``t``, the views of both groups'
        gather buffers (``run_replicas`` reads them by name). ``sharded[c]``: the dense groups, one a rank;
        ``expert_sharded[c]``: the members' groups, rank after rank."""
        p, P, T = self.mesh, self.layout.expert_parallel, self.mesh.shape.tensor
        dense, members = [], []
        for t in range(T):
            groups = self._expert_groups(c, t, segments, contexts, keys)
            if t:   # a global norm (clipping) counts once what every rank holds whole: the experts, and the
                # dense arrays the tensor specs replicate
                _mark_shard_copies(groups[0], [self._specs[self._indices[c][0][k]] for k in self._dense_at[c]])
                for group in groups[1:]:
                    _mark_shard_copies(group, [Replicated()] * len(group.shapes))
            dense.append(groups[0])
            members.append(groups[1:])
        self.sharded[c], self.expert_sharded[c] = dense, [g for rank in members for g in rank]

        def joined(held, s):
            # replica d's rank t holds the experts of member e (its coordinate on the expert axis), as their i-th
            # holder
            member = [p.replica_coords(d).expert for d in range(p.replicas)]
            return [[_joined(held(dense[t])[s][d], held(members[t][e])[s][p.holders(expert=e).index(d)])
                     for t in range(T)] for d, e in enumerate(member)]

        parts = [joined(lambda g: g.parts, s) for s in range(len(segments))]
        scratch = [joined(lambda g: g.scratch, s) for s in range(len(segments))]

        def buffers(d):   # replica d's gradient buffers: each rank's dense group's, and its member's experts'
            e = p.replica_coords(d).expert
            return [g for t in range(T) for g in (dense[t].grad_buffer(d),
                                                    members[t][e].grad_buffer(p.holders(expert=e).index(d)))]

        summed = functools.partial(self._sum_joined, c, parts, buffers) if self._summed[c] else None
        blocks = self._sharded_blocks(segments, dense + self.expert_sharded[c], summed)
        return Chunk(blocks, _per_rank(parts, T), _per_rank(scratch, T), contexts)

    def _expert_groups(self, c, t, segments, contexts, keys):
        """Tensor rank ``t``'s ZeRO-3 groups of chunk ``c`` with experts: its dense arrays over every replica, then
        each member's experts over the replicas holding them."""
        p, P, n = self.mesh, self.layout.expert_parallel, len(segments)
        local, names, aux, _ = self._local(c, t)
        at, dense_at = self._expert_at[c], self._dense_at[c]
        ranks = (P + 1) * p.shape.tensor   # every group of the model numbered alike (see _sharded_chunk)

        def over(positions, with_aux):   # the blocks over the arrays at ``positions`` (of the chunk's, in order)
            return [Segment(s.net, bisect.bisect_left(positions, s.first), bisect.bisect_left(positions, s.stop),
                            s.aux_first if with_aux else 0, s.aux_stop if with_aux else 0, s.label, s.block)
                    for s in segments]

        def group(arrays, positions, held, rank):   # rank 0: the dense arrays (and the other arrays); m + 1: member m
            made = ShardedGroup(arrays, [names[k] for k in positions], [] if rank else aux,
                                over(positions, not rank), [contexts[d][t] for d in held], self.reducer,
                                Keys(keys[0], keys[1], t * (P + 1) + rank, ranks, keys[2]), self.prefetch)
            keys[0] += n * len(held)
            keys[1] += n
            return made

        return [group([local[k] for k in dense_at], dense_at, range(p.replicas), 0)] + [
            group([self._experts[names[k]].local(local[k], m, P) for k in at], at, p.holders(expert=m), m + 1)
            for m in range(P)]

    def _sharded_blocks(self, segments, groups, before_reduce=None):
        """ZeRO-3's blocks over ``groups``: recomputed, each gathered and reduce-scattered by the hooks (which zero
        a block's gradient buffer first when a replica may leave its part unwritten)."""
        hooks = ShardedHooks(groups, clear=self.skips_parameters, before_reduce=before_reduce)
        return Blocks(segments, recompute=True, hooks=hooks, algorithm=self.reducer.algorithm,
                      retain_graph=self.layout.micro > 1, sequence=self.layout.sequence, kept=self.kept)

    def _array_places(self):
        """Where each of the model's trained arrays lies: its chunk's stores (one a rank), its index there."""
        p, places, P = self.mesh, [None] * len(self._host[1]), self.layout.expert_parallel
        for c, (index, _) in enumerate(self._indices):
            stores = (self.sharded[c] if self.layout.zero == 3 else
                      [ReplicatedStore([self.replicas[d][c][t] for d in range(p.replicas)]) for t in range(p.shape.tensor)])
            at = self._expert_at[c]
            members = ([CopiedStore(self.expert_sharded[c][m::P]) for m in range(P)] if self.layout.zero == 3 else
                       [ReplicatedStore([self.expert_replicas[d][c][t] for d in p.holders(expert=m)
                                         for t in range(p.shape.tensor)]) for m in range(P) if at])
            where = {k: (stores, i, self._specs[index[k]]) for i, k in enumerate(self._dense_at[c])}
            where.update({k: (members, i, self._experts[self._host[0][index[k]]]) for i, k in enumerate(at)})
            for k, j in enumerate(index):
                held, i, spec = where[k]
                places[j] = ArrayPlace(held, i, spec, self._host[1][j].shape)
        return places

    # ---- what the step takes (parallel.step.Replicas) ------------------------------------------------------

    @functools.cached_property
    def in_ctx_list(self):
        """Where each replica takes its shard of the batch: its first chunk's first rank's context (a context
        group's first member's); read every step, computed once."""
        return [self.context(group[0], 0) for group in self.mesh.replica_groups("context")]

    @functools.cached_property
    def out_ctx_list(self):
        """Where each replica gives its outputs: its last chunk's first rank's context (a context group's first
        member's); computed once."""
        return [self.context(group[0], len(self.ranges) - 1) for group in self.mesh.replica_groups("context")]

    def groups(self):
        """The trained arrays as ``optimizer_step`` takes them: chunk ``c``'s rank ``t`` of every replica forms a
        group, summed over the replicas; with ZeRO-3 each context's shard is a group of its own."""
        if self.layout.zero == 3:
            return [[shard] for group in self._sharded_groups() for shard in group.shards]
        p, P = self.mesh, self.layout.expert_parallel
        # then each member's experts over the replicas holding them
        return ([[self.replicas[d][c][t] for d in range(p.replicas)] for c in range(len(self.ranges))
                 for t in range(p.shape.tensor)] +
                [[self.expert_replicas[d][c][t] for d in p.holders(expert=m)] for c in range(len(self.ranges))
                 if self._expert_at[c] for t in range(p.shape.tensor) for m in range(P)])

    def aux(self, r=0):
        """Replica ``r``'s arrays that are not trained (BatchNorm's running statistics), in the model's order."""
        by_index = {}
        for c, (_, aux_index) in enumerate(self._indices):
            held = (self.sharded[c][0].aux_arrays[r] if self.layout.zero == 3 else self.replicas[r][c][0].aux)
            by_index.update(zip(aux_index, held))
        return [by_index[i] for i in range(len(by_index))]

    def finish_backward(self):
        """Sequence parallelism: the arrays a rank computes on its slice of the sequence (the blocks' layer norms,
        the row-parallel biases) have a part of their gradient on each rank; sum them over each tensor group (one
        allreduce of their concatenation a chunk and replica), so every rank holds the whole, as without it."""
        if self.layout.zero == 3:   # summed block by block, before each block's reduce-scatter (_sum_sequence)
            return
        for c, indices in enumerate(self._summed):
            for d in range(self.mesh.replicas if indices else 0):
                # a chunk's arrays as its blocks read them (with experts: its dense arrays' and its experts')
                held = [r for pair in zip(self.replicas[d][c], self.expert_replicas[d][c]) for r in pair
                        if r is not None]
                self._sum_over_ranks([[rank[i].grad for i in indices] for rank in self.views[d][c]],
                                     [g for r in held for g in r.grads])

    def _sum_over_ranks(self, grads, buffers):
        """Each rank's ``grads`` (one list a rank, the same arrays' parts) replaced by their sum over the ranks: one
        allreduce of their concatenation. ``buffers``: the ranks' gradient buffers they are views of, which the
        trace's bracket names (an engine operation that names one buffer twice never runs: parallel.trace)."""
        with issued("tensor", lambda: buffers, "tensor sequence-parallel sums", collective="allreduce") as made:
            flats = [mx.nd.concat(*[g.reshape((-1,)) for g in own], dim=0) for own in grads]
            made += flats
            algorithms.allreduce(flats, self.reducer.algorithm)
            for own, flat in zip(grads, flats):
                offset = 0
                for grad in own:
                    grad[:] = flat[offset:offset + grad.size].reshape(grad.shape)
                    offset += grad.size

    def _sum_sequence(self, c, groups, s):
        """ZeRO-3's ``finish_backward``: block ``s`` of chunk ``c``'s sequence-parallel arrays summed over each
        tensor group, in the gathered gradient buffers, before the block's reduce-scatter."""
        segment = groups[0].units[s].segment
        local = [k - segment.first for k in self._summed[c] if segment.first <= k < segment.stop]
        for d in range(self.mesh.replicas if local else 0):
            self._sum_over_ranks([[g.parts[s][d][i].grad for i in local] for g in groups],
                                 [g.grad_buffer(d) for g in groups])

    def _sum_joined(self, c, parts, buffers, s):
        """``_sum_sequence`` of a chunk with experts (ZeRO-3): block ``s``'s sequence-parallel arrays (its layer
        norms, row-parallel biases, router and experts) in each replica's gathered ``parts`` (one a rank, read by
        name) summed over its tensor group; ``buffers(d)``: replica ``d``'s gradient buffers they are views of."""
        names = {self._host[0][self._indices[c][0][k]] for k in self._summed[c]}
        for d, ranks in enumerate(parts[s]):
            local = [i for i, name in enumerate(ranks[0].names) if name in names]
            if local:
                self._sum_over_ranks([[rank[i].grad for i in local] for rank in ranks], buffers(d))

    def activations(self):
        """What the tensor ranks' forwards of the last step kept for backward, per context: ``{context:
        {"replicated": bytes, "total": bytes}}`` (``SegmentTape.kept``): the layer norms' inputs and the residual
        stream, whole on every rank of a tensor group, or its slice with sequence parallelism; and every array the
        tapes recorded. ``{}`` without tensor ranks, or when the step did not count them (``count_activations``)."""
        return {ctx: dict(entry) for ctx, entry in self.kept.items()}

    def count_activations(self, counting):
        """Whether the next steps count what their forwards keep for backward (``activations``; on when the
        strategy is made); returns the setting before."""
        before, self.kept.counting = self.kept.counting, bool(counting)
        return before

    def forward_backward(self, X_shards, y_shards, loss, counted=None):
        """Each replica's shard in micro-batches through the chunks, in the schedule's order (``issue``); the step
        counts the metrics afterwards (``counted`` is left uncalled)."""
        m = self.layout.micro
        X_parts, y_parts = micro_batches(X_shards, m), micro_batches(y_shards, m)
        n = len(self.in_ctx_list)
        if self.lockstep and X_shards and any(len(part) < n for part in X_parts):
            examples = sum(X.shape[0] for X in X_shards)
            raise BadValue("batch_size", f"a batch of {examples} example(s) cannot feed the {n} replicas' {m} "
                                         f"micro-batch(es), which compute together; use batches of at least {n * m} "
                                         "examples")
        outputs, y, losses, peak = issue(self.plan(), self.chunks, X_parts, y_parts, loss)
        self.last_stash = [n / self.layout.virtual if self.layout.virtual > 1 else n for n in peak]
        return outputs, y, losses

    # ---- the strategy ------------------------------------------------------------------------------------------

    def train_step(self, X, y, lr=None, loss=softmax_cross_entropy, optimizer=None, accumulate=1):
        """One optimizer step on the batch (``parallel.step.step_replicas``): returns (summed loss, correct count),
        each (1,) on the first replica's first context, not waited for. In a job, ``X`` and ``y`` are the global
        batch and this worker trains its slice (``parallel.job.worker_slice``); every worker must call it for every
        batch (one without an example still makes every collective)."""
        optimizer = as_optimizer(lr, optimizer)
        if (optimizer.zero == 3) != (self.layout.zero == 3):
            raise ValueError(f"optimizer zero={optimizer.zero} but the layout's zero={self.layout.zero}: ZeRO-3 shards "
                             "the parameters the strategy lays out; give both the same zero")
        for group in self._sharded_groups():
            group.stale()
        self.kept.clear()   # the step's own: its forwards add to it
        return worker_step(self, X, y, loss, optimizer, accumulate, self.job)

    def evaluate(self, data_iter):
        """Accuracy over ``data_iter``, each batch split over the replicas, each through the chunks."""
        for group in self._sharded_groups():
            group.stale()
        return accuracy(data_iter, self._predict, self.in_ctx_list, self.job, collective=self.layout.zero == 3)

    def _predict(self, X_shards):
        hidden = list(X_shards)
        for c, chunk in enumerate(self.chunks):
            if c:
                hidden = chunk.receive(hidden, grad=False)
            hidden = chunk.predict(hidden)
        return [self.chunks[-1].logits(out) for out in hidden]

    def places(self):
        return self._places

    @property
    def stage_params(self):
        """The first replica's arrays of each chunk (its first rank's), each on its chunk's context: a
        ``FlatReplica`` a chunk (without ZeRO-3)."""
        return [self.replicas[0][c][0] for c in range(len(self.ranges))]

    def replica_params(self, d):
        """Replica ``d``'s trained arrays of one rank, the model's whole arrays when the ranks are one, in the
        model's order (without ZeRO-3): what every replica holds the same of after a step. Public API, beside
        ``aux(d)``: how a user checks that the replicas agree (``params()`` is the model whole, read once)."""
        by_index = {}
        for c, (index, _) in enumerate(self._indices):
            by_index.update(zip(index, self.views[d][c][0]))
        return [by_index[j] for j in range(len(by_index))]

    @property
    def gathers_collectively(self):
        """ZeRO-3 in a job: reading the model gathers every worker's chunks."""
        return self.layout.zero == 3 and self.job is not None

    def routing(self):
        """The MoE layers' last forward (``RoutingStats``), in order."""
        return [layer.last for layer in self.meter.layers]

    def epoch_metrics(self):
        """A mixture of experts' routing over the training steps since the last call (``RoutingMeter.read``:
        ``{"experts": ...}``); ``{}`` without experts."""
        return self.meter.read()

    def names(self):
        """The model's trainable arrays' names (a gluon block's ``param.name``s), in ``params()`` order; ``[]`` for
        LeNet."""
        return list(self._host[0])

    def aux_names(self):
        return list(self._host[2])

    def memory_buffers(self):
        """ZeRO-3's gather buffers (gathered) and block gradient buffers (temporary), per context."""
        gathered, temporary = {}, {}
        for group in self._sharded_groups():
            for held, own in ((gathered, group.gathered_bytes()), (temporary, group.temporary_bytes())):
                for ctx, nbytes in own.items():
                    held[ctx] = held.get(ctx, 0) + nbytes
        return gathered, temporary

    def _sharded_groups(self):
        return [group for rows in (self.sharded, self.expert_sharded) for row in rows for group in row]

    def plan(self, micro_batches=None):
        """The ``parallel.strategies.schedules.Schedule`` a batch of ``micro_batches`` (default the layout's) runs."""
        return pipeline_schedule(self.layout.schedule, self.mesh.shape.stage, micro_batches or self.layout.micro,
                                 self.layout.virtual)

    def bubble_fraction(self):
        """The idle fraction of a full batch's schedule: ``(K-1)/(M+K-1)`` for K stages and M micro-batches
        (GPipe and 1F1B), about V times less interleaved."""
        return self.plan().bubble

    def metrics(self):
        """What ``--metrics-json`` records of a pipeline (its ``"pipeline"``): the schedule, each stage's peak of
        micro-batches' activations held at once and the bubble, of the schedule a full batch runs."""
        if not self.layout.pipelined:
            return {}
        plan = self.plan()
        name = self.layout.schedule if self.layout.virtual == 1 else "interleaved-1f1b"
        return {"pipeline": {"schedule": name, "micro_batches": plan.micro_batches,
                             "virtual_stages": self.layout.virtual, "stashed_peak": plan.stashed_peak,
                             "bubble": plan.bubble}}

    @functools.cached_property
    def replicates_only(self):
        """Whether the layout is data replicas alone (the data preset): one chunk that every replica holds whole,
        no tensor ranks, no ZeRO-3, nothing in lockstep (experts, context groups)."""
        return (self.layout.strategy == "data" and len(self.ranges) == 1 and self.mesh.shape.tensor == 1
                and self.layout.zero < 3 and not self.lockstep)

    @property
    def model(self):
        """What ``fit`` returns: for data replicas alone (``replicates_only``) the replicas, one a context, as the
        textbook keeps them (``device_params``); else the strategy."""
        if self.replicates_only:
            return [self.replicas[d][0][0] for d in range(self.mesh.replicas)]
        return self

    def describe(self, accumulate=1):
        """One line: the axes, each chunk and the contexts holding it, and what is sharded, recomputed or
        pipelined; for data replicas alone, ``describe_replicas``'s line."""
        if self.replicates_only:
            statistics = bool(self.aux())   # BatchNorm's, synchronized over the replicas
            recomputed = len(self.chunks[0].blocks.segments) if self.layout.recompute else None
            return describe_replicas(self.reducer, self.mesh.replicas, accumulate, statistics or None, recomputed,
                                     statistics)
        p, labels = self.mesh, self._cut.labels
        where = " | ".join(f"{label} @ " + ",".join(str(self.context(d, c, t)) for d in range(p.replicas)
                                                    for t in range(p.shape.tensor)) for c, label in enumerate(labels))
        line = f"{self.layout.describe_axes(p)}: {where}"
        if self.layout.pipelined and self.layout.micro > 1:
            schedule = (self.layout.schedule if self.layout.virtual == 1 else
                        f"interleaved 1f1b, {self.layout.virtual} chunks a device")
            line += f", {self.layout.micro} micro-batches, schedule {schedule}"
        if self.layout.zero == 3:
            workers = 1 if self.job is None else self.job.num_workers
            shards = f"1/{p.replicas}" if workers == 1 else f"1/{p.replicas * workers} ({workers} workers x {p.replicas} contexts)"
            blocks = len(self.chunks[0].blocks.segments)
            each = f"each of the {blocks} blocks{' a chunk' if len(self.chunks) > 1 else ''}"
            if p.replicas * workers == 1:   # one replica: every shard is the whole, what is left is the gathers' cost
                line += (f", ZeRO-3 with one replica: nothing to shard; {each} still gathered into a buffer before "
                         "it runs and recomputed for its backward (more memory and time than without ZeRO-3)")
            else:
                line += (f", ZeRO-3: each context keeps {shards} of the parameters, their gradients and optimizer "
                         f"state; {each} gathered before it runs and again for its backward (recomputed), gradients "
                         "reduce-scattered")
                if self.layout.expert_parallel > 1:   # a member's experts: over the replicas that hold them
                    held = p.replicas // self.layout.expert_parallel
                    line += (f" (a member's experts over the {held} replica{'s' if held > 1 else ''} holding them"
                             + (" and the workers" if workers > 1 else "") + ")")
        elif self.layout.recompute:
            line += ", activations recomputed in backward"
        if self.layout.context > 1:
            line += (f", each example's tokens split over groups of {self.layout.context} replicas (attention by "
                     "ring attention)")
        if self.meter.layers:
            E, P, n = self.meter.experts, self.layout.expert_parallel, len(self.meter.layers)
            line += f", each replica holding {'all' if P == 1 else f'{E // P} of the'} {E} experts of {n} MoE " \
                    f"layer{'s' if n > 1 else ''}" + (f" (expert-parallel groups of {P})" if P > 1 else "")
        if self.layout.sequence:
            line += (", sequence parallel: layer norms and the residual stream split along the sequence over each "
                     "tensor group (f and g an all-gather and a reduce-scatter)")
        summed = self.reducer.describe(p.replicas)
        if summed:
            line += f"; {summed}"
        if self.job is not None:
            line += f"; over {self.job.num_workers} worker(s) through {self.job.describe()}"
            if self.aux():
                line += f" ({batchnorm_across(self.job)})"
        return line


class ModelParallel(Hybrid):
    """A model cut into stages, stage ``s`` on ``ctx_list[s]``, the whole batch through each: the model strategy
    (``Layout("model", stages, boundaries)``), trained with the same step as ``train_batch``.

    >>> from parallel import init_lenet_params
    >>> ModelParallel(init_lenet_params(seed=0), [mx.cpu(0), mx.cpu(1)], boundaries=[2])
    ModelParallel(2 stages: conv1,conv2 @ cpu(0) | dense1,dense2 @ cpu(1))
    """

    def __init__(self, model, ctx_list, stages=None, boundaries=None, reducer=None):
        super().__init__(model, ctx_list, Layout("model", stages=stages, boundaries=boundaries), reducer)

    def forward(self, X):
        """Outputs of ``X`` on the last stage's context; outside ``autograd.record()`` BatchNorm uses its running
        statistics."""
        return self._predict([X.as_in_context(self.context(0, 0))])[0]

    def __call__(self, X):
        return self.forward(X)


class Pipeline(Hybrid):
    """A model cut into stages fed micro-batches in a schedule's order (GPipe, 1F1B, interleaved 1F1B), one update
    per batch: the pipeline strategy (``Layout("pipeline", ...)``, ``parallel.strategies.pipeline``).

    >>> from parallel import init_lenet_params
    >>> model = Pipeline(init_lenet_params(seed=0), [mx.cpu(0), mx.cpu(1)], stages=2, micro_batches=4)
    >>> model.bubble_fraction()   # (2-1) / (4+2-1)
    0.2
    """

    def __init__(self, model, ctx_list, stages=None, boundaries=None, micro_batches=None, schedule="gpipe",
                 virtual=1, reducer=None):
        super().__init__(model, ctx_list, Layout("pipeline", stages=stages, boundaries=boundaries,
                                                 micro_batches=micro_batches, schedule=schedule, virtual=virtual),
                         reducer)


class FullyShardedDataParallel(Hybrid):
    """The data strategy with ZeRO stage 3 (``Layout("data", zero=3)``, ``parallel.strategies.sharded``): each
    context keeps its chunk of every block's parameters, gradients and optimizer state, gathers a block before it
    runs and recomputes it in backward.

    Attributes
    ----------
    group : ShardedGroup
        The model's arrays sharded over the contexts: its ``shards`` (one a context) and ``units`` (the blocks).
    """

    def __init__(self, params, ctx_list, reducer=None, prefetch=False):
        super().__init__(params, ctx_list, Layout("data", zero=3), reducer, prefetch)
        self.group = self.sharded[0][0]

    @property
    def shards(self):
        return self.group.shards

    @property
    def blocks(self):
        return self.group.units

    def bytes_moved(self, accumulate=1):
        """Bytes one step copies between this process's contexts (``ShardedGroup.bytes_moved``)."""
        return self.group.bytes_moved(accumulate)

    def network_bytes(self, accumulate=1):
        """Bytes this worker pushes to the kvstore's servers in one step (``ShardedGroup.network_bytes``)."""
        return self.group.network_bytes(accumulate)


# ---- building the layout ---------------------------------------------------------------------------------------

def _host_model(params, job):
    """The model's arrays on the host, ``(names, arrays, aux_names, aux)`` (LeNet's names empty), rank 0's in a
    job (a collective call: every worker makes it)."""
    if isinstance(params, mx.gluon.Block):
        names, arrays, aux_names, aux = block_state(params)
    else:
        names, arrays, aux_names, aux = [], list(params), [], []
    arrays, aux = [a.copyto(mx.cpu()) for a in arrays], [a.copyto(mx.cpu()) for a in aux]
    if job is not None:   # every worker starts from rank 0's model
        broadcast_arrays(job, KEYS["params"], arrays)
        if aux:
            broadcast_arrays(job, KEYS["aux"], aux)
    return list(names), arrays, list(aux_names), aux


def _tensor_specs(behaviour, params, host, tensor):
    """Each of the model's trained arrays' tensor-parallel spec (``parallel.shard``): all replicated on one rank;
    ``BadValue`` naming ``tensor`` for more ranks than the model's parallel layers split into."""
    if tensor == 1:
        return [Replicated()] * len(host[1])
    most = most_ranks(params) if isinstance(params, mx.gluon.Block) else 1
    if tensor > most:
        raise BadValue("tensor", f"{{tensor={tensor}}} ranks cannot split this model: its parallel layers split "
                                 f"into at most {most} (a model without them into 1); use at most {most}")
    by_name = behaviour.shard_specs(params)
    return [by_name[name] for name in host[0]]


def _sequence_region(layout, behaviour, params, host, indices):
    """Sequence parallelism's region, as the model's plan (``parallel.models.plan``) lays it: for each chunk, the
    positions in its arrays of those computed on each rank's slice of the sequence (their gradients summed over the
    ranks: ``Hybrid.finish_backward``), and the names of the arrays a run that starts inside the region begins
    with. None of either without sequence parallelism."""
    if not layout.sequence:
        return [[] for _ in indices], set()
    plan = behaviour.plan(params)
    names = set(plan.summed(params))
    if not names:
        raise BadValue("sequence", "{sequence} splits the tokens between a model's Transformer blocks' parallel "
                                   "layers; this model has no such blocks in its plan (parallel.models.plan: the ViT "
                                   "and the Transformer have)")
    return [[k for k, j in enumerate(index) if host[0][j] in names] for index, _ in indices], plan.inside(params)


def _chunk_indices(host, cut, c):
    """The indices (in the model's order) of chunk ``c``'s trained arrays and of its other arrays."""
    names, arrays, aux_names, _ = host
    if not names:   # LeNet: layer i owns arrays 2 i and 2 i + 1
        start, stop = cut.ranges[c]
        return list(range(2 * start, 2 * stop)), []
    stage_names, _, stage_aux, _ = block_state(cut.sources[c])
    where, aux_where = {n: i for i, n in enumerate(names)}, {n: i for i, n in enumerate(aux_names)}
    return [where[n] for n in stage_names], [aux_where[n] for n in stage_aux]


def _whole_stage(cut, c, count, aux_count):
    """Stage ``c`` of ``cut`` as one block: its own net (a cached graph of the whole stage)."""
    source = cut.sources[c]
    return Segment(cut.nets[c], 0, count, 0, aux_count, label=cut.labels[c],
                   block=source if isinstance(source, mx.gluon.Block) else None)


def _on_ranks(segments, tensor, inside):
    """``segments`` as a tensor group of ``tensor`` ranks runs them (each block split by its parallel layers;
    ``inside[s]``: block ``s`` starts inside sequence parallelism's region)."""
    if tensor == 1:
        return segments
    return [Segment(RankedNet(s.block, i), s.first, s.stop, s.aux_first, s.aux_stop, s.label, s.block)
            for s, i in zip(segments, inside)]


def _per_rank(parts, tensor):
    """``parts[s][d][t]`` as the blocks take them: a list of ranks, or for one rank the part itself."""
    return parts if tensor > 1 else [[ranks[0] for ranks in per_replica] for per_replica in parts]


def _joined(dense, experts):
    """A block's ``Part`` of a replica's dense arrays and its experts, the latter after the former (read by name)."""
    return Part(list(dense) + list(experts), list(dense.names or []) + list(experts.names or []), dense.aux)


def _replica(arrays, names, aux, aux_names, ctx, bucket_mb):
    """A replica of ``arrays`` on ``ctx`` in buckets of ``bucket_mb`` MiB, with its names and other arrays."""
    replica = get_params(arrays, ctx, bucket_mb)
    return FlatReplica(list(replica), replica.data, replica.grads, replica.buckets, names or (),
                       [a.copyto(ctx) for a in aux], aux_names)


def _mark_copies(replica, specs):
    """The arrays every rank holds whole, marked on a rank but the first (``FlatReplica.copies``)."""
    offset = 0
    for i, (array, spec) in enumerate(zip(replica, specs)):
        if isinstance(spec, Replicated):
            replica.copies.add(i)
            replica.uncounted.append((offset, offset + array.size))
        offset += array.size


def _mark_shard_copies(group, specs):
    """The elements of each shard that belong to arrays every rank holds whole (``FlatReplica.uncounted``)."""
    whole = [(group.starts[i], group.starts[i + 1]) for i, spec in enumerate(specs) if isinstance(spec, Replicated)]
    for c, shard in enumerate(group.shards):
        for unit in group.units:
            a, b = unit.owned[c]
            for lo, hi in whole:
                lo, hi = max(lo - unit.start, a), min(hi - unit.start, b)
                if hi > lo:
                    shard.uncounted.append((unit.offsets[c] + lo - a, unit.offsets[c] + hi - a))
        shard.uncounted.sort()

