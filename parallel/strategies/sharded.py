"""Fully sharded data parallelism (ZeRO stage 3, PyTorch's FSDP): the parameters sharded too, gathered a block at a
time.

ZeRO-1 and 2 shard the optimizer state and the update; every context still holds the whole model. Here context
``i`` of ``K`` keeps only its chunk ``i`` of every block's parameters (``chunk_bounds``: chunks that differ by at
most one element), with that chunk's gradient and optimizer state: 1/K of the model's 16 bytes a parameter under
Adam. A step runs the model block by block (a model's ``units``: recomputation's blocks, LeNet's layers, each of
ResNet-18's residual blocks cut in its two halves, ``Residual.parts``, so that no block holds two of its largest
convolutions; a block after a half takes a tuple, the half's output and the residual block's input):

- forward: before a block runs, every context *all-gathers* the block's full parameters into a gather buffer (a
  copy of each owner's chunk); the block runs off the tape and its input is kept; the buffer is then free for
  the next block. The last block runs on the tape.
- backward, last block first: the block's parameters are gathered again, its forward recomputed under
  ``autograd.record()`` and its backward run into a gradient buffer of the block's size, whose sum over the
  contexts is *reduce-scattered* into the owners' chunks (each owner adds the K copies of its chunk in context
  order, with one ``add_n``: the additions the fused allreduce makes, so the sums are its bits).
- update: each context updates its chunks with its own optimizer state.

Why recompute: MXNet's tape keeps every array an operator's backward reads, the weights among them, and has no
way to release an array's memory while the tape holds it (FSDP resizes the storage to zero); so a block's
gathered weights can only be freed after its forward if the block runs again in backward. ZeRO-3 here is
therefore activation recomputation plus sharding: one more forward pass a step, and the activations of one block
at a time besides the blocks' inputs.

In a job (a reducer with a ``job``), the chunks are W x K, one per context of the job: worker ``r``'s context ``i``
owns chunk ``r K + i``. Each block is also cut into K *pieces*, one per local context: a gather fills each piece
with this worker's chunks (zeros elsewhere) and sums it over the workers through the kvstore, then every context
copies the other pieces; a reduction adds every local context's copy of a piece in context order and sums it over
the workers, and each owner copies its chunk out of the pieces. Those are the additions ``zero=0`` makes in a job
(the contexts, then the servers): bitwise the same model. A worker without an example still makes every
collective. Micro-batches (``accumulate``) each make a step's gathers and reductions, their sums added in the
shards.

Prefetch (``prefetch=True``, FSDP's forward and backward prefetch): two gather buffers a context, and the next
block's gather is queued before the current block runs, so MXNet's engine can copy while it computes; without
(the default), one buffer, and each gather waits for the block before it to finish with the buffer. The gathered
peak (full parameters at once on a context) is one block's (the largest) without prefetch, two blocks' with it:
ResNet-18's largest block is 22% of the model, so prefetch takes the peak from 22% to 45%, for 1-3% of the step
time measured here (``benchmarks/memory.py``; CPU contexts share the cores that copy and compute).

The same model as without sharding: the same operators on the same values (the gathered parameters are copies of
the same bits), the fused allreduce's additions, the same elementwise update: bitwise ``zero=0`` with the
``fused`` allreduce (``tests/test_sharded.py``).
"""
import functools

import mxnet as mx
import numpy as np
from mxnet import autograd

from ..comm import algorithms
from ..comm.algorithms import chunk_bounds, exclusive
from ..comm.reducer import as_reducer
from ..comm.replica import Bucket, FlatReplica, get_params
from ..evaluate import evaluate_accuracy
from ..export import LazyArrays
from ..job import KEYS, broadcast_arrays, sum_values, worker_slice
from ..models.lenet import softmax_cross_entropy
from ..models.recompute import _detached, _flat, _Part, _run
from ..models.registry import behaviour_of
from ..optim.zero import _clip, _update, as_optimizer
from ..split import shard_sizes, split_and_load
from ..step import check_accumulate, check_batch, check_labels, loss_and_correct
from ..trace import collective, mark_backward_each, mark_recompute
from ..validate import BadValue, check_bool, check_contexts

__all__ = ["FullyShardedDataParallel"]


def _block_key(s, kind, j, k):
    """The kvstore key under which local context ``j`` of ``k`` sums its piece of block ``s`` over the workers:
    ``kind`` 0 for a gather, 1 for a reduction."""
    return KEYS["sharded"] + (2 * s + kind) * k + j


class _Block:
    """Where a block's parameters lie: elements ``start .. stop - 1`` of the model's flat buffer, cut into one chunk
    per context of the job (``bounds``: W x K chunks, worker ``r``'s contexts owning chunks ``r K .. r K + K - 1``,
    ``first`` the first of them), this worker's context ``i``'s chunk at ``offsets[i]`` of its shard. ``pieces``
    cut the block into K parts, one a local context: what each context sums over the contexts of its process
    (and, in a job, over the workers); in one process the pieces are the chunks."""

    def __init__(self, segment, start, stop, n, first, k, offsets):
        self.segment, self.start, self.stop, self.first = segment, start, stop, first
        self.bounds = chunk_bounds(stop - start, n)
        self.pieces = chunk_bounds(stop - start, k)
        self.offsets = offsets   # per local context: where its chunk starts in its shard

    @property
    def size(self):
        return self.stop - self.start

    def chunk(self, i):
        """Local context ``i``'s chunk: ``(a, b)``, element offsets in the block."""
        return self.bounds[self.first + i], self.bounds[self.first + i + 1]

    def piece(self, j):
        return self.pieces[j], self.pieces[j + 1]

    def mine(self):
        """The elements this worker's contexts own, one run: ``(a, b)``."""
        return self.bounds[self.first], self.bounds[self.first + len(self.offsets)]

    def overlap(self, i, low, high):
        """The part of local context ``i``'s chunk within the block's elements ``low .. high - 1``: ``(a, b,
        start)``, elements ``a .. b - 1`` of the block at ``start ..`` of the context's shard; None if empty."""
        first, last = self.chunk(i)
        a, b = max(first, low), min(last, high)
        return (a, b, self.offsets[i] + a - first) if b > a else None


class FullyShardedDataParallel:
    """The data strategy with ZeRO stage 3 (see the module's docstring): ``make_strategy("data", ..., zero=3)``.

    Parameters
    ----------
    params : list of NDArray or mxnet.gluon.nn.HybridSequential
        The initial model (LeNet's arrays or a gluon block of ``parallel.models``); copied, not modified.
    ctx_list : list of mxnet.Context
        Distinct contexts; each keeps ``1/K`` of every block's parameters.
    reducer : parallel.comm.Reducer or str, optional
        Only its algorithm ``"fused"`` (the default): the reduce-scatter makes its additions; no compression. With
        a ``job``, the shards span every context of every worker (a collective constructor: every worker makes
        it; rank 0's initial model wins).
    prefetch : bool
        Queue the next block's gather before the current block runs (two gather buffers a context: twice the
        gathered peak). Off by default.

    Attributes
    ----------
    shards : list of FlatReplica
        Context ``i``'s chunks of every block, one flat buffer with its gradient (a bucket of one), in block order.
    """

    name = "data"

    def __init__(self, params, ctx_list, reducer=None, prefetch=False):
        self.ctx_list = check_contexts(ctx_list)
        self.reducer = as_reducer(reducer)
        self.prefetch = check_bool(prefetch, "prefetch")
        if self.reducer.codec is not None or self.reducer.algorithm != "fused":
            raise BadValue("zero", "{zero=3} shards the parameters with the fused allreduce's additions; without "
                                   "compression, {algorithm=fused}")
        job, k = self.reducer.job, len(self.ctx_list)
        workers, rank = (1, 0) if job is None else (job.num_workers, job.rank)
        behaviour = behaviour_of(params)
        self.full_net, segments = behaviour.net(params), behaviour.units(params)
        source = get_params(params, mx.cpu())   # the initial values, whole, on the host
        self.names, self.aux_names = list(getattr(source, "names", ())), list(getattr(source, "aux_names", ()))
        aux = list(getattr(source, "aux", ()))
        if job is not None:   # every worker starts from rank 0's model
            job.broadcast(KEYS["params"], source.data)
            if aux:
                broadcast_arrays(job, KEYS["aux"], aux)
        self._shapes = [p.shape for p in source]
        self._starts = [0]
        for p in source:
            self._starts.append(self._starts[-1] + p.size)
        self.blocks, sizes = [], [0] * k
        for segment in segments:
            block = _Block(segment, self._starts[segment.first], self._starts[segment.stop], workers * k, rank * k, k,
                           list(sizes))
            for i in range(k):
                a, b = block.chunk(i)
                sizes[i] += b - a
            self.blocks.append(block)
        if job is not None and _block_key(len(self.blocks), 0, 0, k) >= KEYS["sharded_arrays"]:
            raise BadValue("zero", f"{{zero=3}} in a job sums each block under keys of its own; {len(self.blocks)} "
                                   f"blocks on {k} contexts need more than it has")
        dtype = source.data.dtype
        self.shards = []
        for i, ctx in enumerate(self.ctx_list):
            data = self._chunks(source.data, i).copyto(ctx) if sizes[i] else mx.nd.zeros((0,), ctx=ctx, dtype=dtype)
            grad = mx.nd.zeros(data.shape, ctx=ctx, dtype=dtype)
            self.shards.append(FlatReplica([data], data, [grad], [Bucket(0, 1, 0, data.size)]))
        self.aux_arrays = [[a.copyto(ctx) for a in aux] for ctx in self.ctx_list]
        largest = max(b.size for b in self.blocks)
        buffers = 2 if self.prefetch else 1
        self._gathered = [[mx.nd.zeros((largest,), ctx=ctx, dtype=dtype) for _ in range(buffers)]
                          for ctx in self.ctx_list]
        self._gathered_grads = [mx.nd.zeros((largest,), ctx=ctx, dtype=dtype) for ctx in self.ctx_list]
        # each context's receive buffers for the reduction: the other contexts' copies of its piece of a block
        piece = max(b.pieces[1] for b in self.blocks)
        self._received = [[mx.nd.zeros((piece,), ctx=ctx, dtype=dtype) for _ in range(k - 1)]
                          for ctx in self.ctx_list]
        self._parts = [self._block_parts(s) for s in range(len(self.blocks))]

    def _block_parts(self, s):
        """Block ``s``'s parameters on every context as views of a gather buffer, marked as variables whose
        gradients are views of the gradient buffer; with the context's running statistics and scratch copies."""
        block, segment = self.blocks[s], self.blocks[s].segment
        names = self.names[segment.first:segment.stop] if self.names else None
        parts, scratch = [], []
        for i in range(len(self.ctx_list)):
            buffer, grads = self._gathered[i][s % len(self._gathered[i])], self._gathered_grads[i]
            views, grad_views = [], []
            for j in range(segment.first, segment.stop):
                a, b = self._starts[j] - block.start, self._starts[j + 1] - block.start
                views.append(buffer[a:b].reshape(self._shapes[j]))
                grad_views.append(grads[a:b].reshape(self._shapes[j]))
            autograd.mark_variables(views, grad_views)
            aux = self.aux_arrays[i][segment.aux_first:segment.aux_stop]
            parts.append(_Part(views, names, aux))
            scratch.append(_Part(views, names, [a.copy() for a in aux]))
        return parts, scratch

    def __repr__(self):
        return f"FullyShardedDataParallel({self.describe()})"

    @property
    def job(self):
        """The distributed job whose W x K contexts share the shards (the reducer's), or None."""
        return self.reducer.job

    @property
    def gathers_collectively(self):
        """Whether reading the model (``params``, ``gather_state``) is a collective call: in a job every worker
        must make it, also those that do not use the result."""
        return self.job is not None

    def describe(self, accumulate=1):
        k, job = len(self.ctx_list), self.job
        over = f"1/{k}" if job is None else f"1/{k * job.num_workers} ({job.num_workers} workers x {k} contexts)"
        line = (f"one replica per context, ZeRO-3: each context keeps {over} of the parameters, their gradients "
                f"and optimizer state; each of the {len(self.blocks)} blocks gathered before its forward and again "
                f"for its backward (recomputed), gradients reduce-scattered with the fused allreduce's additions")
        if job is not None:
            line += f", summed over the workers through the {job.kv.type} kvstore"
        if accumulate > 1:
            line += f", once a micro-batch ({accumulate})"
        return line + (", the next block's gather prefetched" if self.prefetch else "")

    # ---- the collectives -------------------------------------------------------------------------------------

    def _touched(self, i, buffer=None):
        """What context ``i``'s collectives read or write (a trace's marks write them all: ``parallel.trace``): its
        shard and its gradient, the block gradient buffer and receive buffers, and a gather's ``buffer``."""
        shard = self.shards[i]
        return [shard.data, shard.grads[0], self._gathered_grads[i], *self._received[i]] + (
            [] if buffer is None else [buffer])

    def _gather(self, s, contexts=None):
        """Every context (or those of ``contexts``, in one process) copies every owner's chunk of block ``s`` into
        its buffer. In a job, local context ``j`` fills its piece of the block with this worker's chunks (zeros
        elsewhere) and sums it over the workers (adding zeros changes no float: the owners' bits), then every
        context copies the pieces of the others."""
        block, job = self.blocks[s], self.job
        buffers = [gathered[s % len(gathered)] for gathered in self._gathered]
        with exclusive(), collective("gather", [self._touched(i, buffer) for i, buffer in enumerate(buffers)]):
            if job is None:
                for i in (range(len(self.ctx_list)) if contexts is None else contexts):
                    for j, shard in enumerate(self.shards):
                        part = block.overlap(j, 0, block.size)
                        if part:
                            a, b, start = part
                            algorithms.copy_to(shard.data[start:start + b - a], buffers[i][a:b])
                return
            low, high = block.mine()
            for j, buffer in enumerate(buffers):
                p, q = block.piece(j)
                if q == p:
                    continue
                for a, b in ((p, min(q, low)), (max(p, high), q)):   # other workers' elements
                    if b > a:
                        buffer[a:b] = 0
                for i, shard in enumerate(self.shards):   # this worker's chunks that fall in the piece
                    part = block.overlap(i, p, q)
                    if part:
                        a, b, start = part
                        algorithms.copy_to(shard.data[start:start + b - a], buffer[a:b])
                job.allsum(_block_key(s, 0, j, len(buffers)), buffer[p:q], kind="allgather")
            for i, buffer in enumerate(buffers):
                for j, other in enumerate(buffers):
                    p, q = block.piece(j)
                    if j != i and q > p:
                        algorithms.copy_to(other[p:q], buffer[p:q])

    def _reduce_scatter(self, s, active, accumulate=False):
        """Each owner gets the sum over the contexts (and the workers) of its chunk of block ``s``'s gradient,
        written into its shard's gradient (``accumulate``: added to it); contexts ``active ..`` computed nothing
        and add zeros. Local context ``j`` sums every context's
        copy of its piece in context order with one ``add_n`` (the fused allreduce's additions); in a job the sum
        is then summed over the workers (each piece under its own key) and each owner copies its chunk out of the
        pieces."""
        block, job, k = self.blocks[s], self.job, len(self.ctx_list)
        grads = self._gathered_grads
        direct = job is None and not accumulate   # in one process a piece is its owner's chunk
        for i in range(active, k):   # contexts without a shard add zeros (their buffer may hold an earlier sum)
            grads[i][:block.size] = 0
        with exclusive(), collective("reduce-scatter", [self._touched(i) for i in range(k)]):
            for j in range(k):
                p, q = block.piece(j)
                if q == p:
                    continue
                mine = grads[j][p:q]
                pieces = [mine if i == j else algorithms.copy_to(grads[i][p:q], self._received[j][i - (i > j)][:q - p])
                          for i in range(k)]
                out = self.shards[j].grads[0][block.offsets[j]:block.offsets[j] + q - p] if direct else mine
                if k > 1:
                    mx.nd.add_n(*pieces, out=out)
                elif direct:   # one context: its piece is the sum
                    algorithms.copy_to(mine, out)
                if job is not None:
                    job.allsum(_block_key(s, 1, j, k), mine, kind="reduce_scatter")
            if direct:
                return
            for i, shard in enumerate(self.shards):
                for j in range(k):   # the pieces that hold part of chunk i
                    part = block.overlap(i, *block.piece(j))
                    if part is None:
                        continue
                    lo, hi, start = part
                    out = shard.grads[0][start:start + hi - lo]
                    summed = grads[j][lo:hi]
                    if not accumulate:
                        algorithms.copy_to(summed, out)
                        continue
                    if j != i:   # into a receive buffer of context i (its reduction is queued before this)
                        summed = algorithms.copy_to(summed, self._received[i][j - (j > i)][:hi - lo])
                    mx.nd.elemwise_add(out, summed, out=out)

    # ---- a step ------------------------------------------------------------------------------------------------

    def _forward_backward(self, X_shards, y_shards, loss, accumulate=False):
        """The sharded forward and backward of one batch (see the module's docstring); returns outputs and losses.
        A worker of a job without an example (no shard) still makes every gather and reduction, adding zeros.
        ``accumulate``: the reduced gradients are added to the shards' (a micro-batch after the first)."""
        n = len(self.blocks)
        prefetch, computes = self.prefetch, bool(X_shards)
        self._gather(0)
        hidden, kept = list(X_shards), []
        active = range(len(X_shards))
        with autograd.pause(train_mode=True):
            for s in range(n - 1):
                if prefetch:
                    self._gather(s + 1)
                kept.append(hidden)
                if computes:
                    hidden = _run(self.blocks[s].segment.net, hidden, [self._parts[s][1][i] for i in active])
                if not prefetch:
                    self._gather(s + 1)
        outputs, losses = [], []
        if n > 1:
            hidden = _detached(hidden)
        if computes:
            with autograd.record():
                outputs = _run(self.blocks[-1].segment.net, hidden, [self._parts[-1][0][i] for i in active])
                mark_backward_each(outputs)   # a trace's backward: after the block (the loss's backward may not wait)
                losses = [loss(out, y) for out, y in zip(outputs, y_shards)]
            autograd.backward(losses)
        for s in reversed(range(n - 1)):
            if prefetch:
                self._gather(s)   # into the other buffer: queued before block s+1's reduce-scatter
            self._reduce_scatter(s + 1, len(X_shards), accumulate)
            if not prefetch:
                self._gather(s)
            inputs = _detached(kept[s], attach=s > 0)
            if computes:
                mark_recompute([self._gathered[i][s % len(self._gathered[i])] for i in active])
                with autograd.record():
                    again = _run(self.blocks[s].segment.net, inputs, [self._parts[s][0][i] for i in active])
                mark_backward_each(_flat(again))
                autograd.backward(_flat(again), [X.grad for X in _flat(hidden)])
            hidden = inputs
        self._reduce_scatter(0, len(X_shards), accumulate)
        return outputs, losses

    def train_step(self, X, y, lr=None, loss=softmax_cross_entropy, optimizer=None, accumulate=1):
        """One step on the batch (see the module's docstring): returns (summed loss, correct count), each (1,) on
        ``ctx_list[0]``, not waited for. In a job, ``X`` and ``y`` are the global batch, this worker trains its
        slice (``parallel.job.worker_slice``) and every worker must call it for every batch. ``accumulate``:
        the batch runs as that many micro-batches, each gathered, recomputed and reduce-scattered, their sums
        added in the shards (FSDP's accumulation: the same model as the whole batch up to float rounding)."""
        check_batch(X, y)
        optimizer = as_optimizer(lr, optimizer)
        accumulate = check_accumulate(accumulate, X.shape[0])
        n, job = X.shape[0], self.job
        if job is not None:
            start, stop = worker_slice(n, len(self.ctx_list), job.rank, job.num_workers)
            X, y = X[start:stop], y[start:stop]
        sizes = shard_sizes(X.shape[0], accumulate) if X.shape[0] else []   # this worker's slice, as zero=0 cuts
        sizes += [0] * (accumulate - len(sizes))   # every worker runs as many: each makes the same collectives
        bounds = np.cumsum([0] + sizes).tolist()
        sums, checked = [], False
        for m, (a, b) in enumerate(zip(bounds, bounds[1:])):
            X_shards = split_and_load(X[a:b], self.ctx_list) if b > a else []
            y_shards = split_and_load(y[a:b], self.ctx_list) if b > a else []
            outputs, losses = self._forward_backward(X_shards, y_shards, loss, accumulate=m > 0)
            if outputs and not checked:
                check_labels(y, outputs[0].shape[-1], loss)
                checked = True
            if outputs:
                sums.append(loss_and_correct(outputs, y_shards, losses, self.ctx_list[0]))
            for r in range(len(X_shards), len(self.ctx_list)):   # an idle context takes the first one's statistics
                for first, aux in zip(self.aux_arrays[0], self.aux_arrays[r]):
                    first.copyto(aux)
        t = optimizer.num_update + 1
        lr_t = optimizer.lr_at(t)
        regions = [[[(0, shard.data.size)]] for shard in self.shards]
        if optimizer.clip_norm is not None:   # the norm of every context's chunks, as ZeRO-2 adds its shards'
            _clip(optimizer.clip_norm, self.groups(), regions, 2, n,
                  combine=None if job is None else self._all_partials)
        for shard, (shard_regions,) in zip(self.shards, regions):
            if shard.data.size:
                _update(optimizer, shard, shard_regions, lr_t, 1.0 / n, t)
        optimizer.num_update = t
        if not sums:
            zero = mx.nd.zeros((1,), ctx=self.ctx_list[0])
            return zero, zero.copy()
        if len(sums) == 1:
            return sums[0]
        return mx.nd.add_n(*[l for l, _ in sums]), mx.nd.add_n(*[c for _, c in sums])

    def _all_partials(self, partials):
        """The squared norms of every context's chunks in the job, in global context order (this worker's in
        ``partials``): one gather over the workers, so every context adds the same numbers in the same order."""
        local = mx.nd.concat(*[p.as_in_context(mx.cpu()) for p in partials], dim=0)
        gathered = self.job.allgather(KEYS["sharded_arrays"] - 1, local)
        return [row[i:i + 1] for row in gathered for i in range(len(partials))]

    # ---- what the training loop reads ----------------------------------------------------------------------------

    def groups(self):
        """Each context's shard, as one group each (what ``memory_table`` measures; each is updated alone)."""
        return [[shard] for shard in self.shards]

    def bytes_moved(self, accumulate=1):
        """Bytes one step copies between this process's contexts, over all of them: each block's gather in forward
        and again in backward (not the last block's, whose buffer still holds it), each context receiving the
        other contexts' copies of its piece in the reduction: ``(K - 1) (3 Psi - Psi_last)`` elements of ``Psi``,
        ZeRO's 3 Psi a device (times (K - 1) / K, the part that is not already there). In a job, add the copies
        of a chunk into a piece held by another context (filling a gather, and the owners' copies out of the
        summed pieces). ``accumulate`` micro-batches: as many times."""
        k, itemsize = len(self.ctx_list), self.shards[0].data.dtype(0).itemsize
        elements = 0
        for s, block in enumerate(self.blocks):
            gathers = 1 if s == len(self.blocks) - 1 else 2
            crossing = 0   # in a job: the parts of chunk i that fall in another context's piece j
            for i in range(k if self.job is not None else 0):
                for j in range(k):
                    part = block.overlap(i, *block.piece(j)) if j != i else None
                    crossing += part[1] - part[0] if part else 0
            elements += (gathers + 1) * ((k - 1) * block.size + crossing)
        return accumulate * elements * itemsize

    def network_bytes(self, accumulate=1):
        """Bytes this worker pushes to the kvstore's servers in one step (and pulls back as many): every gather
        and every reduction of a block sums the whole block over the workers, ``3 Psi - Psi_last``, ZeRO's 3 Psi.
        0 in one process. (The servers add every worker's pushes: a parameter-server job moves twice a ring's
        bytes.)"""
        if self.job is None:
            return 0
        psi = sum(block.size for block in self.blocks)
        return accumulate * (3 * psi - self.blocks[-1].size) * self.shards[0].data.dtype(0).itemsize

    def _chunks(self, flat, i):
        """Context ``i``'s chunks of every block of ``flat`` (a flat array of the model), one after the other: the
        layout of its shard. Context ``i`` must own at least one element."""
        return mx.nd.concat(*[flat[b.start + b.chunk(i)[0]:b.start + b.chunk(i)[1]] for b in self.blocks
                              if b.chunk(i)[1] > b.chunk(i)[0]], dim=0)

    def _array(self, chunks, j, state=-1):
        """The model's array ``j``, whole, on the CPU, from each local context's flat array of its chunks
        (``chunks[i]``, laid out as its shard): the only array of the model gathered at once. In a job, a
        collective call: this worker fills its elements, zeros elsewhere, and sums over the workers (the key of
        array ``j`` of state ``state``, -1 for the parameters)."""
        block = next(b for b in self.blocks if b.segment.first <= j < b.segment.stop)
        low, high = self._starts[j] - block.start, self._starts[j + 1] - block.start
        whole = mx.nd.zeros((high - low,), ctx=mx.cpu(), dtype=self.shards[0].data.dtype)
        for i, chunk in enumerate(chunks):
            part = block.overlap(i, low, high)
            if part:
                lo, hi, start = part
                algorithms.copy_to(chunk[start:start + hi - lo], whole[lo - low:hi - low])
        if self.job is not None:
            n = len(self._shapes)
            self.job.allsum(KEYS["sharded_arrays"] + n * (state + 1) + j, whole, kind="allgather")
            # waited for: MXNet's kvstore lets a push of another array under the key overtake this pull (it
            # pushes a CPU array without copying it, so nothing orders the two)
            whole.wait_to_read()
        return whole.reshape(self._shapes[j])

    def _state_chunks(self, optimizer):
        """Each state's flat array of chunks per local context: ``{name: [chunks of context i]}``."""
        entries = [optimizer.states.get((id(shard.data), (0, shard.data.size))) for shard in self.shards]
        return {name: [entry[1][k] if entry else shard.data.zeros_like() for entry, shard in zip(entries, self.shards)]
                for k, name in enumerate(optimizer.state_names())}

    def gather_state(self, optimizer):
        """The optimizer's state as a checkpoint stores it (``parallel.optim.gather_state``'s form): ``{state name:
        LazyArrays}``, item ``j`` the state of parameter ``j``, gathered whole on the CPU when read (zeros where
        it has not stepped yet), one at a time. In a job, reading an item is a collective call: every worker
        reads the same items in the same order (``parallel.checkpoint.read_all``)."""
        chunks = self._state_chunks(optimizer)
        return {name: LazyArrays(len(self._shapes), functools.partial(self._array, chunks[name], state=k))
                for k, name in enumerate(optimizer.state_names())}

    def lazy_params(self):
        """``params()`` as a ``LazyArrays``: item ``j`` gathered when read, so a checkpoint holds one array of the
        model whole at a time (``parallel.checkpoint.save_checkpoint``)."""
        return LazyArrays(len(self._shapes), functools.partial(self._array, [shard.data for shard in self.shards]))

    def load_state(self, optimizer, state):
        """Give ``optimizer`` the state ``state`` (``gather_state``'s form, from any layout): each context its
        chunks of it."""
        names = optimizer.state_names()
        if sorted(state) != sorted(names):
            raise ValueError(f"state holds {sorted(state)} but {optimizer.name} keeps {list(names)}")
        flats = {name: mx.nd.concat(*[a.reshape(-1) for a in state[name]], dim=0) for name in names}
        for i, shard in enumerate(self.shards):
            if not shard.data.size:
                continue
            optimizer.states[(id(shard.data), (0, shard.data.size))] = (shard.data, [
                self._chunks(flats[name], i).as_in_context(shard.data.context).astype(shard.data.dtype)
                for name in names])

    def gathered_bytes(self):
        """``{context: bytes}`` of full parameters each context holds gathered at once: its gather buffers, one
        block's parameters (the largest block's) each, two with prefetch."""
        return {ctx: sum(b.size * b.dtype(0).itemsize for b in buffers)
                for ctx, buffers in zip(self.ctx_list, self._gathered)}

    def temporary_bytes(self):
        """``{context: bytes}`` of the block-sized buffers of the gradients each context holds besides its shard:
        the block gradient buffer its backward writes and it reduces from, and the receive buffers of its piece
        (the other contexts' copies, K - 1 of a block's K-th): ZeRO's temporary buffers."""
        return {ctx: sum(b.size * b.dtype(0).itemsize for b in [grads] + received)
                for ctx, grads, received in zip(self.ctx_list, self._gathered_grads, self._received)}

    def params(self):
        """The model's trainable arrays, whole, on the CPU, gathered one at a time from the shards (in a job, a
        collective call: every worker gets them)."""
        return [self._array([shard.data for shard in self.shards], j) for j in range(len(self._shapes))]

    def aux(self):
        """The first context's running statistics (every context holds the same after synchronized training)."""
        return list(self.aux_arrays[0])

    @property
    def model(self):
        return self.params()

    def _predict(self, X, i):
        """The outputs of context ``i`` on ``X``, block by block, gathering each block on that context alone."""
        hidden = [X]
        for s, block in enumerate(self.blocks):
            self._gather(s, contexts=[i])
            hidden = _run(block.segment.net, hidden, [self._parts[s][0][i]])
        return hidden[0]

    def evaluate(self, data_iter):
        """Accuracy over ``data_iter``, each batch split across the contexts, each gathering block by block. In a
        job, each worker scores its slice of each batch (every worker gathers every block of every batch, with
        or without examples) and the counts are summed over the workers."""
        job = self.job
        if job is None:
            return evaluate_accuracy(data_iter, list(range(len(self.ctx_list))), self.ctx_list,
                                     net=lambda X, i: self._predict(X, i))
        correct, total = mx.nd.zeros((1,), ctx=self.ctx_list[0]), 0
        for X, y in data_iter:
            total += X.shape[0]
            start, stop = worker_slice(X.shape[0], len(self.ctx_list), job.rank, job.num_workers)
            hidden = split_and_load(X[start:stop], self.ctx_list) if stop > start else []
            for s, block in enumerate(self.blocks):
                self._gather(s)
                if hidden:
                    hidden = _run(block.segment.net, hidden, [self._parts[s][0][i] for i in range(len(hidden))])
            for out, y_shard in zip(hidden, split_and_load(y[start:stop], self.ctx_list) if hidden else []):
                right = out.argmax(axis=1) == y_shard.astype(out.dtype)
                correct += right.sum().astype(correct.dtype).as_in_context(self.ctx_list[0])
        if total == 0:
            raise ValueError("data_iter yielded no examples")
        return sum_values(job, [float(correct.asscalar())])[0] / total
