"""Fully sharded data parallelism (ZeRO stage 3, PyTorch's FSDP) as hooks around a network's blocks: the parameters
sharded too, gathered a block at a time.

ZeRO-1 and 2 shard the optimizer state and the update; every context still holds the whole model. With ZeRO-3 the
D data-parallel replicas of a group of arrays (a data-parallel model's, or one pipeline stage's on one tensor rank)
keep only their chunk of every block's parameters (a ``ShardedGroup``): replica ``i`` of ``D`` owns elements
``shard_range(size, D, i)`` of each block (in a job, of the W x D contexts of the job), with that chunk's gradient
and optimizer state: 1/D of the model's 16 bytes a parameter under Adam. The blocks are a model's ``units``
(recomputation's blocks, LeNet's layers, each of ResNet-18's residual blocks cut in its two halves, so that no
block holds two of its largest convolutions). The network runs as ``parallel.models.recompute.Blocks`` with
recomputation and these hooks (fairscale's ``FSDP(checkpoint_wrapper(block))``, composed):

- before a block runs (its forward, its recomputation in backward, evaluation), every replica *all-gathers* the
  block's full parameters into a gather buffer (a copy of each owner's chunk);
- after a block's backward, its gradient (each replica's, in a buffer of the block's size) is *reduce-scattered*
  through the strategy's ``parallel.comm.Reducer`` (``Reducer.reduce_scatter``: the fused allreduce's additions,
  or its hook's), and each owner adds its chunk of the sum into its shard's gradient;
- the optimizer then updates each shard with its own state (``optimizer_step`` with ``zero=3``).

Why recompute: MXNet's tape keeps every array an operator's backward reads, the weights among them, and has no
way to release an array's memory while the tape holds it (FSDP resizes the storage to zero); so a block's
gathered weights can only be freed after its forward if the block runs again in backward.

In a job, local context ``j`` sums its piece (``shard_range(size, D, j)``) of a block over the workers: a gather
fills each piece with this worker's chunks (zeros elsewhere) and sums it over the workers through the kvstore,
then every context copies the other pieces; a reduction leaves each piece's sum over every context of the job on
context ``j`` (the Reducer's), and each owner copies its chunk out of the pieces. A worker without an example
still makes every collective. Micro-batches (accumulation, a pipeline's) each make a block's gathers and
reductions, their sums added in the shards.

Prefetch (``prefetch=True``, FSDP's forward and backward prefetch): two gather buffers a context, and the block
after the one about to run (before it in backward) is gathered at once, so MXNet's engine can copy while it
computes; without (the default), one buffer. ResNet-18's largest block is 22% of the model, so prefetch takes
the gathered peak from 22% to 45%, for 1-3% of the step time measured here (``benchmarks/memory.py``).

The same model as without sharding: the same operators on the same values (the gathered parameters are copies of
the same bits), the fused allreduce's additions, the same elementwise update: bitwise ``zero=0`` with the
``fused`` allreduce (``tests/test_sharded.py``).
"""
from typing import NamedTuple

import mxnet as mx
from mxnet import autograd

from ..comm import algorithms
from ..comm.algorithms import chunk_bounds, exclusive, shard_range
from ..comm.replica import Bucket, FlatReplica
from ..job import KEYS
from ..models.recompute import BlockHooks, Part
from ..trace import collective, mark_recompute

__all__ = ["ShardedGroup", "ShardedHooks", "Keys"]


class Keys(NamedTuple):
    """Where a ``ShardedGroup``'s kvstore keys start in a job: its first block's gather (``gathers``: a block's
    gather takes one key a context of the group in this process, its blocks' one after the other) and bucket
    (``buckets``, the Reducer's), and how a checkpoint's gathers are numbered: the group's ``rank`` of ``ranks``
    groups that hold parts of the same arrays (tensor ranks, expert-parallel members), and the model's count of
    trained ``arrays``."""
    gathers: int = 0
    buckets: int = 0
    rank: int = 0
    ranks: int = 1
    arrays: int = 0


class _Unit:
    """Where a block's parameters lie: elements ``start .. stop - 1`` of the group's flat buffer; the piece each
    local context sums (``pieces[i]``: ``shard_range(size, K, i)``, where the Reducer's reduce-scatter leaves it)
    and the chunk of it each owns (``owned[i]``, block offsets, at ``offsets[i]`` of its shard): the whole piece in
    one process, in a job of W workers worker ``rank``'s W-th of it, so that no chunk crosses into another
    context's piece."""

    def __init__(self, segment, start, stop, workers, rank, k, offsets):
        self.segment, self.start, self.stop = segment, start, stop
        self.pieces = [shard_range(stop - start, k, i) for i in range(k)]
        self.owned = []
        for p, q in self.pieces:
            bounds = chunk_bounds(q - p, workers)
            self.owned.append((p + bounds[rank], p + bounds[rank + 1]))
        self.offsets = list(offsets)

    @property
    def size(self):
        return self.stop - self.start

    def overlap(self, i, low, high):
        """The part of local context ``i``'s chunk within the block's elements ``low .. high - 1``: ``(a, b,
        start)``, elements ``a .. b - 1`` of the block at ``start ..`` of the context's shard; None if empty."""
        first, last = self.owned[i]
        a, b = max(first, low), min(last, high)
        return (a, b, self.offsets[i] + a - first) if b > a else None


class ShardedGroup:
    """One group of arrays (their host values ``arrays``, in order, with ``names`` and running statistics ``aux``)
    sharded over the contexts ``ctx_list`` (the data-parallel replicas of one process; with the reducer's job,
    of every worker), cut into the blocks ``segments`` (see the module's docstring).

    Parameters
    ----------
    arrays, names, aux : lists
        The group's trained arrays (NDArrays, any context; rank 0's in a job), their names (or None) and its other
        arrays.
    segments : list of parallel.models.recompute.Segment
        The blocks over the group's arrays, in order.
    ctx_list : list of mxnet.Context
    reducer : parallel.comm.Reducer
        Sums a block's gradient over the contexts and the workers (``reduce_scatter``).
    keys : Keys
        Where this group's kvstore keys start, in a job.
    prefetch : bool

    Attributes
    ----------
    shards : list of FlatReplica
        Context ``i``'s chunks of every block, one flat buffer with its gradient (a bucket of one), in block order.
    parts, scratch : list of list of Part
        ``parts[s][i]``: block ``s``'s parameters on context ``i`` as views of a gather buffer (with the context's
        running statistics; ``scratch``: copies of them).
    """

    def __init__(self, arrays, names, aux, segments, ctx_list, reducer, keys=Keys(), prefetch=False):
        self.ctx_list, self.reducer, self.prefetch = list(ctx_list), reducer, bool(prefetch)
        self.names, self.keys = names, keys
        job, k = reducer.job, len(self.ctx_list)
        workers, rank = (1, 0) if job is None else (job.num_workers, job.rank)
        self.shapes = [a.shape for a in arrays]
        self.starts = [0]
        for a in arrays:
            self.starts.append(self.starts[-1] + a.size)
        self.units, sizes = [], [0] * k
        for segment in segments:
            unit = _Unit(segment, self.starts[segment.first], self.starts[segment.stop], workers, rank, k, sizes)
            for i, (a, b) in enumerate(unit.owned):
                sizes[i] += b - a
            self.units.append(unit)
        dtype = arrays[0].dtype if arrays else "float32"
        flat = mx.nd.concat(*[a.reshape(-1).as_in_context(mx.cpu()) for a in arrays], dim=0) if arrays else None
        self.shards = []
        for i, ctx in enumerate(self.ctx_list):
            data = self.chunks(flat, i).copyto(ctx) if sizes[i] else mx.nd.zeros((0,), ctx=ctx, dtype=dtype)
            self.shards.append(FlatReplica([data], data, [mx.nd.zeros(data.shape, ctx=ctx, dtype=dtype)],
                                           [Bucket(0, 1, 0, data.size)]))
        self.aux_arrays = [[a.copyto(ctx) for a in aux] for ctx in self.ctx_list]
        largest = max([u.size for u in self.units] + [1])
        self._buffers = [[mx.nd.zeros((largest,), ctx=ctx, dtype=dtype) for _ in range(2 if prefetch else 1)]
                         for ctx in self.ctx_list]
        self._grads = [mx.nd.zeros((largest,), ctx=ctx, dtype=dtype) for ctx in self.ctx_list]
        self._resident = [None] * len(self._buffers[0])   # the block each buffer slot holds gathered
        self.parts, self.scratch, self._sums, self._copies, self._adds = [], [], [], [], []
        for s in range(len(self.units)):
            self._lay_out(s)

    def _lay_out(self, s):
        """Block ``s``'s views of a gather buffer and of the gradient buffer on every context (marked as variables
        whose gradients are the latter), its parts and scratch parts, and what its reduction sums."""
        unit, segment = self.units[s], self.units[s].segment
        names = self.names[segment.first:segment.stop] if self.names else None
        parts, scratch, sums = [], [], []
        for i, ctx in enumerate(self.ctx_list):
            buffer, grads = self._buffers[i][s % len(self._buffers[i])], self._grads[i]
            views, grad_views = [], []
            for j in range(segment.first, segment.stop):
                a, b = self.starts[j] - unit.start, self.starts[j + 1] - unit.start
                views.append(buffer[a:b].reshape(self.shapes[j]))
                grad_views.append(grads[a:b].reshape(self.shapes[j]))
            if views:
                autograd.mark_variables(views, grad_views)
            aux = self.aux_arrays[i][segment.aux_first:segment.aux_stop]
            parts.append(Part(views, names, aux))
            scratch.append(Part(views, names, [a.copy() for a in aux]))
            sums.append(FlatReplica(views, buffer[:unit.size], [grads[:unit.size]],
                                    [Bucket(0, len(views), 0, unit.size)]))
        self.parts.append(parts)
        self.scratch.append(scratch)
        self._sums.append(sums)
        self._copies.append(self._gather_copies(s))
        self._adds.append(self._owner_adds(s))

    def _gather_copies(self, s):
        """The copies a gather of block ``s`` makes in one process: ``(owner's chunk, place in a buffer)`` views."""
        unit, copies = self.units[s], []
        for own in self._buffers:
            buffer = own[s % len(own)]
            for i, shard in enumerate(self.shards):
                part = unit.overlap(i, 0, unit.size)
                if part:
                    a, b, start = part
                    copies.append((shard.data[start:start + b - a], buffer[a:b]))
        return copies

    def _owner_adds(self, s):
        """What each owner adds after block ``s``'s reduce-scatter: ``(its shard's gradient, the summed piece's part,
        the piece's context)`` views, the part of each piece that holds part of its chunk (one a context: its own
        piece, whose chunk it is)."""
        unit, adds = self.units[s], []
        for i, shard in enumerate(self.shards):
            for j in range(len(self.shards)):
                part = unit.overlap(i, *unit.pieces[j])
                if part is not None:
                    lo, hi, start = part
                    adds.append((shard.grads[0][start:start + hi - lo], self._grads[j][lo:hi], j != i))
        return adds

    def __repr__(self):
        return f"ShardedGroup({len(self.units)} blocks over {len(self.ctx_list)} contexts)"

    # ---- the collectives -------------------------------------------------------------------------------------

    def _touched(self, i, buffer=None):
        """What context ``i``'s collectives read or write (a trace's marks write them all)."""
        shard = self.shards[i]
        return [shard.data, shard.grads[0], self._grads[i]] + ([] if buffer is None else [buffer])

    def gather(self, s):
        """Every context copies every owner's chunk of block ``s`` into its gather buffer, unless the buffer holds
        the block already. In a job, local context ``j`` fills its piece of the block with this worker's chunks
        (zeros elsewhere) and sums it over the workers (adding zeros changes no float: the owners' bits), then
        every context copies the pieces of the others."""
        slot = s % len(self._resident)
        if self._resident[slot] == s or not self.units[s].size:
            return
        self._resident[slot] = s
        buffers = [own[slot] for own in self._buffers]
        with exclusive(), collective("gather", lambda: [self._touched(i, b) for i, b in enumerate(buffers)]):
            if self.reducer.job is None:
                for chunk, place in self._copies[s]:
                    algorithms.copy_to(chunk, place)
            else:
                self._gather_across(s, buffers)

    def _fill(self, s, buffer, low, high):
        """Copy into ``buffer`` this worker's chunks of block ``s`` that fall in its elements ``low .. high - 1``."""
        unit = self.units[s]
        for i, shard in enumerate(self.shards):
            part = unit.overlap(i, low, high)
            if part:
                a, b, start = part
                algorithms.copy_to(shard.data[start:start + b - a], buffer[a:b])

    def _gather_across(self, s, buffers):
        unit, job = self.units[s], self.reducer.job
        for j, buffer in enumerate(buffers):
            p, q = unit.pieces[j]
            if q == p:
                continue
            buffer[p:q] = 0   # other workers' elements
            self._fill(s, buffer, p, q)
            job.allsum(KEYS["sharded"] + self.keys.gathers + s * len(buffers) + j, buffer[p:q], kind="allgather")
        for i, buffer in enumerate(buffers):
            for j, other in enumerate(buffers):
                p, q = unit.pieces[j]
                if j != i and q > p:
                    algorithms.copy_to(other[p:q], buffer[p:q])

    def grad_buffer(self, i):
        """Context ``i``'s gradient buffer, whose views its blocks' gradients are."""
        return self._grads[i]

    def clear(self, s):
        """Zero block ``s``'s part of every context's gradient buffer (before a backward that may not write it
        all)."""
        size = self.units[s].size
        if not size:   # a block without trained arrays: nothing to zero
            return
        for grads in self._grads:
            grads[:size] = 0

    def reduce(self, s, active):
        """Block ``s``'s gradient summed over the contexts (and workers) through the reducer's reduce-scatter, each
        owner adding its chunk of the sum into its shard's gradient; contexts ``active ..`` computed nothing (their
        gradient buffer holds another block's, or another micro-batch's) and add zeros."""
        unit, k = self.units[s], len(self.ctx_list)
        if not unit.size:
            return
        with exclusive(), collective("reduce-scatter", lambda: [self._touched(i) for i in range(k)]):
            self.reducer.reduce_scatter(self._sums[s], active, self.keys.buckets + s)
            for out, summed, elsewhere in self._adds[s]:
                if elsewhere:
                    summed = algorithms.receive(summed, out.context)
                mx.nd.elemwise_add(out, summed, out=out)

    def chunks(self, flat, i):
        """Context ``i``'s chunks of every block of ``flat`` (the group's arrays, one flat array), one after the
        other: the layout of its shard."""
        pieces = [flat[u.start + a:u.start + b] for u in self.units for a, b in [u.owned[i]] if b > a]
        return mx.nd.concat(*pieces, dim=0) if len(pieces) > 1 else pieces[0]

    # ---- a store of the group's arrays (parallel.strategies.base) ----------------------------------------------

    def _holders(self, optimizer, state):
        if state < 0:
            return [shard.data for shard in self.shards]
        held = []
        for shard in self.shards:
            found = optimizer.region_state(shard.data, (0, shard.data.size)) if shard.data.size else None
            held.append(found[state] if found else shard.data.zeros_like())
        return held

    def read(self, optimizer, state, i, key=None):
        """The group's array ``i`` whole on the CPU: its parameters (``state`` -1) or state buffer ``state``, from
        the chunks of every context (in a job, a collective call: this worker fills its elements, zeros elsewhere,
        and sums over the workers under the key of the model's array ``key[0]``, ``(j, state)``)."""
        unit = next(u for u in self.units if u.segment.first <= i < u.segment.stop)
        low, high = self.starts[i] - unit.start, self.starts[i + 1] - unit.start
        whole = mx.nd.zeros((high - low,), ctx=mx.cpu(), dtype=self.shards[0].data.dtype)
        for c, held in enumerate(self._holders(optimizer, state)):
            part = unit.overlap(c, low, high)
            if part:
                lo, hi, start = part
                algorithms.copy_to(held[start:start + hi - lo], whole[lo - low:hi - low])
        if self.reducer.job is not None:   # under the key of the model's array ``key[0]``, state, tensor rank
            k = self.keys
            index = ((state + 1) * k.arrays + (i if key is None else key[0])) * k.ranks + k.rank
            self.reducer.job.allsum(KEYS["sharded_arrays"] + index, whole, kind="allgather")
            # waited for: MXNet's kvstore lets a push of another array under the key overtake this pull
            whole.wait_to_read()
        return whole.reshape(self.shapes[i])

    def write(self, optimizer, state, arrays):
        """Give every context its chunks of ``arrays`` (the group's, in order): the parameters (``state`` -1) or
        state buffer ``state``."""
        flat = mx.nd.concat(*[a.reshape(-1).as_in_context(mx.cpu()) for a in arrays], dim=0)
        for i, shard in enumerate(self.shards):
            if not shard.data.size:
                continue
            values = self.chunks(flat, i).as_in_context(shard.data.context).astype(shard.data.dtype)
            if state < 0:
                shard.data[:] = values
                continue
            region = (0, shard.data.size)
            kept = optimizer.region_state(shard.data, region) or optimizer.create_state(shard.data)
            kept[state] = values
            optimizer.set_region_state(shard.data, region, kept)
        self.stale()

    # ---- what a step measures ----------------------------------------------------------------------------------

    def gathered_bytes(self):
        """``{context: bytes}`` of full parameters each context holds gathered at once: its gather buffers."""
        return {ctx: sum(b.size * b.dtype(0).itemsize for b in buffers)
                for ctx, buffers in zip(self.ctx_list, self._buffers)}

    def temporary_bytes(self):
        """``{context: bytes}`` of the block gradient buffer each context's backward writes and reduces from."""
        return {ctx: grads.size * grads.dtype(0).itemsize for ctx, grads in zip(self.ctx_list, self._grads)}

    def bytes_moved(self, accumulate=1):
        """Bytes one step copies between this process's contexts, over all of them: each block's gather in forward
        and again in backward (not the last block's, whose buffer still holds it, nor with prefetch the one before
        it, held in the other buffer), each context receiving the other contexts' copies of its piece in the
        reduction: ``(K - 1) (3 Psi - Psi_last)`` elements of ``Psi`` without prefetch, ZeRO's 3 Psi a device (times
        (K - 1) / K, the part that is not already there), in a job as in one process (a context's chunks lie in
        its own piece). ``accumulate`` micro-batches: as many times."""
        k, itemsize, n = len(self.ctx_list), self.shards[0].data.dtype(0).itemsize, len(self.units)
        held = {n - 1, n - 2} if self.prefetch else {n - 1}   # still gathered when their backward comes
        elements = sum((2 if s in held else 3) * (k - 1) * unit.size for s, unit in enumerate(self.units))
        return accumulate * elements * itemsize

    def network_bytes(self, accumulate=1):
        """Bytes this worker pushes to the kvstore's servers in one step (and pulls back as many): every gather
        and every reduction of a block sums the whole block over the workers, ``3 Psi - Psi_last``, ZeRO's 3 Psi.
        0 in one process."""
        if self.reducer.job is None:
            return 0
        psi = sum(unit.size for unit in self.units)
        return accumulate * (3 * psi - self.units[-1].size) * self.shards[0].data.dtype(0).itemsize

    def gathered(self, s, i):
        """Context ``i``'s gather buffer of block ``s``."""
        return self._buffers[i][s % len(self._buffers[i])]

    def stale(self):
        """The shards changed (an update): no gather buffer holds a block any more."""
        self._resident = [None] * len(self._resident)


class ShardedHooks(BlockHooks):
    """The hooks of one chunk of a network (``Blocks``): for each tensor rank's ``ShardedGroup`` of it, gather a
    block before it runs (and, with prefetch, the next one) and reduce-scatter its gradient after its backward."""

    def __init__(self, groups, clear=False, before_reduce=None):
        self.groups = list(groups)
        #: called with a block's index after its backward, before its reduce-scatter (sequence parallelism's sums)
        self.before_reduce = before_reduce
        #: zero a block's gradient buffer before each backward of it: a backward that leaves a replica's part of the
        #: block unwritten (no loss reads it: a context group's members' heads) would otherwise reduce another block's
        self.clear = clear

    def _clear(self, s):
        if self.clear:
            for group in self.groups:
                group.clear(s)

    def before_forward(self, s, after=None, recompute=False):
        for group in self.groups:
            group.gather(s)
            if group.prefetch and after is not None:
                group.gather(after)
        if recompute:
            self._clear(s)
        if recompute:   # a trace names what follows the gathered parameters a recomputation
            mark_recompute(lambda: [group.gathered(s, i) for group in self.groups
                                    for i in range(len(group.ctx_list))])

    def before_backward(self, s):
        for group in self.groups:   # another micro-batch's blocks may have taken the buffer meanwhile
            group.gather(s)
        self._clear(s)

    def after_backward(self, s, active):
        if self.before_reduce is not None:
            self.before_reduce(s)
        for group in self.groups:
            group.reduce(s, active)
