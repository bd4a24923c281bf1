"""Fully sharded data parallelism (ZeRO stage 3, PyTorch's FSDP): the parameters sharded too, gathered a block at a
time.

ZeRO-1 and 2 shard the optimizer state and the update; every context still holds the whole model. Here context
``i`` of ``K`` keeps only its chunk ``i`` of every block's parameters (``_chunk_bounds``: chunks that differ by at
most one element), with that chunk's gradient and optimizer state: 1/K of the model's 16 bytes a parameter under
Adam. A step runs the model block by block (the blocks of ``parallel.models.Recompute``: LeNet's layers,
ResNet-18's residual blocks):

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

Prefetch (``prefetch=True``, FSDP's forward and backward prefetch): two gather buffers a context, and the next
block's gather is queued before the current block runs, so MXNet's engine can copy while it computes; without, one
buffer, and each gather waits for the block before it to finish with the buffer. The gathered peak (full
parameters at once on a context) is one block's (the largest) without prefetch, two blocks' with it.

The same model as without sharding: the same operators on the same values (the gathered parameters are copies of
the same bits), the fused allreduce's additions, the same elementwise update: bitwise ``zero=0`` with the
``fused`` allreduce (``tests/test_sharded.py``).
"""
import mxnet as mx
from mxnet import autograd

from ..comm import algorithms
from ..comm.algorithms import _chunk_bounds, exclusive, receive
from ..comm.reducer import as_reducer
from ..comm.replica import Bucket, FlatReplica, get_params
from ..evaluate import evaluate_accuracy
from ..models.lenet import softmax_cross_entropy
from ..models.recompute import _Part, _run
from ..models.registry import behaviour_of
from ..optim.zero import _clip, _update, as_optimizer
from ..split import split_and_load
from ..step import check_batch, check_labels, loss_and_correct
from ..validate import BadValue, check_bool, check_contexts, check_int

__all__ = ["FullyShardedDataParallel"]


class _Block:
    """Where a block's parameters lie: elements ``start .. stop - 1`` of the model's flat buffer, cut into K chunks
    (``bounds``), chunk ``i`` at ``offset .. offset + size_i - 1`` of context ``i``'s shard."""

    def __init__(self, segment, start, stop, k, offsets):
        self.segment, self.start, self.stop = segment, start, stop
        self.bounds = _chunk_bounds(stop - start, k)
        self.offsets = offsets   # per context: where its chunk starts in its shard

    @property
    def size(self):
        return self.stop - self.start

    def chunk(self, i):
        return self.bounds[i], self.bounds[i + 1]


class FullyShardedDataParallel:
    """The data strategy with ZeRO stage 3 (see the module's docstring): ``make_strategy("data", ..., zero=3)``.

    Parameters
    ----------
    params : list of NDArray or mxnet.gluon.nn.HybridSequential
        The initial model (LeNet's arrays or a gluon block of ``parallel.models``); copied, not modified.
    ctx_list : list of mxnet.Context
        Distinct contexts; each keeps ``1/K`` of every block's parameters.
    reducer : parallel.comm.Reducer or str, optional
        Only its algorithm ``"fused"`` (the default): the reduce-scatter makes its additions. No job, no
        compression (not yet).
    prefetch : bool
        Queue the next block's gather before the current block runs (two gather buffers a context).

    Attributes
    ----------
    shards : list of FlatReplica
        Context ``i``'s chunks of every block, one flat buffer with its gradient (a bucket of one), in block order.
    """

    name = "data"

    def __init__(self, params, ctx_list, reducer=None, prefetch=True):
        self.ctx_list = check_contexts(ctx_list)
        self.reducer = as_reducer(reducer)
        self.prefetch = check_bool(prefetch, "prefetch")
        if self.reducer.job is not None or self.reducer.codec is not None or self.reducer.algorithm != "fused":
            raise BadValue("zero", "{zero=3} shards the parameters over one process's contexts with the fused "
                                   "allreduce's additions; without a job, without compression, {algorithm=fused}")
        behaviour = behaviour_of(params)
        self.full_net, segments = behaviour.net(params), behaviour.segments(params)
        source = get_params(params, mx.cpu())   # the initial values, whole, on the host
        self.names, self.aux_names = list(getattr(source, "names", ())), list(getattr(source, "aux_names", ()))
        self._shapes = [p.shape for p in source]
        self._starts = [0]
        for p in source:
            self._starts.append(self._starts[-1] + p.size)
        k = len(self.ctx_list)
        self.blocks, sizes = [], [0] * k
        for segment in segments:
            block = _Block(segment, self._starts[segment.first], self._starts[segment.stop], k, list(sizes))
            for i in range(k):
                a, b = block.chunk(i)
                sizes[i] += b - a
            self.blocks.append(block)
        dtype = source.data.dtype
        self.shards = []
        for i, ctx in enumerate(self.ctx_list):
            data = self._chunks(source.data, i).copyto(ctx) if sizes[i] else mx.nd.zeros((0,), ctx=ctx, dtype=dtype)
            grad = mx.nd.zeros(data.shape, ctx=ctx, dtype=dtype)
            self.shards.append(FlatReplica([data], data, [grad], [Bucket(0, 1, 0, data.size)]))
        self.aux_arrays = [[a.copyto(ctx) for a in getattr(source, "aux", ())] for ctx in self.ctx_list]
        largest = max(b.size for b in self.blocks)
        buffers = 2 if self.prefetch else 1
        self._gathered = [[mx.nd.zeros((largest,), ctx=ctx, dtype=dtype) for _ in range(buffers)]
                          for ctx in self.ctx_list]
        self._gathered_grads = [mx.nd.zeros((largest,), ctx=ctx, dtype=dtype) for ctx in self.ctx_list]
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
        return None

    def describe(self, accumulate=1):
        return (f"one replica per context, ZeRO-3: each context keeps 1/{len(self.ctx_list)} of the parameters, "
                f"their gradients and optimizer state; each of the {len(self.blocks)} blocks gathered before its "
                f"forward and again for its backward (recomputed), gradients reduce-scattered with the fused "
                f"allreduce's additions" + (", the next block's gather prefetched" if self.prefetch else ""))

    # ---- the collectives -------------------------------------------------------------------------------------

    def _gather(self, s, contexts=None):
        """Every context (or those of ``contexts``) copies every owner's chunk of block ``s`` into its buffer."""
        block = self.blocks[s]
        with exclusive():
            for i in (range(len(self.ctx_list)) if contexts is None else contexts):
                buffer = self._gathered[i][s % len(self._gathered[i])]
                for j, shard in enumerate(self.shards):
                    a, b = block.chunk(j)
                    if b > a:
                        algorithms._copy(shard.data[block.offsets[j]:block.offsets[j] + b - a], buffer[a:b])

    def _reduce_scatter(self, s):
        """Each owner sums the contexts' gradients of its chunk of block ``s`` (context order, one ``add_n``)."""
        block = self.blocks[s]
        with exclusive():
            for i, shard in enumerate(self.shards):
                a, b = block.chunk(i)
                if b == a:
                    continue
                ctx = self.ctx_list[i]
                pieces = [grads[a:b] if j == i else receive(grads[a:b], ctx, slot=j)
                          for j, grads in enumerate(self._gathered_grads)]
                out = shard.grads[0][block.offsets[i]:block.offsets[i] + b - a]
                mx.nd.add_n(*pieces, out=out) if len(pieces) > 1 else algorithms._copy(pieces[0], out)

    # ---- a step ------------------------------------------------------------------------------------------------

    def _forward_backward(self, X_shards, y_shards, loss):
        """The sharded forward and backward of one batch (see the module's docstring); returns outputs and losses."""
        n = len(self.blocks)
        prefetch = self.prefetch
        self._gather(0)
        hidden, kept = list(X_shards), []
        active = range(len(X_shards))
        with autograd.pause(train_mode=True):
            for s in range(n - 1):
                if prefetch:
                    self._gather(s + 1)
                kept.append(hidden)
                hidden = _run(self.blocks[s].segment.net, hidden, [self._parts[s][1][i] for i in active])
                if not prefetch:
                    self._gather(s + 1)
        if n > 1:
            hidden = [X.detach() for X in hidden]
            for X in hidden:
                X.attach_grad()
        with autograd.record():
            outputs = _run(self.blocks[-1].segment.net, hidden, [self._parts[-1][0][i] for i in active])
            losses = [loss(out, y) for out, y in zip(outputs, y_shards)]
        if len(X_shards) < len(self.ctx_list):   # contexts without a shard add a zero gradient
            for grads in self._gathered_grads[len(X_shards):]:
                grads[:] = 0
        autograd.backward(losses)
        for s in reversed(range(n - 1)):
            if prefetch:
                self._gather(s)   # into the other buffer: queued before block s+1's reduce-scatter
            self._reduce_scatter(s + 1)
            if not prefetch:
                self._gather(s)
            inputs = [X.detach() for X in kept[s]]
            if s:
                for X in inputs:
                    X.attach_grad()
            with autograd.record():
                again = _run(self.blocks[s].segment.net, inputs, [self._parts[s][0][i] for i in active])
            autograd.backward(again, [X.grad for X in hidden])
            hidden = inputs
        self._reduce_scatter(0)
        return outputs, losses

    def train_step(self, X, y, lr=None, loss=softmax_cross_entropy, optimizer=None, accumulate=1):
        """One step on the batch (see the module's docstring): returns (summed loss, correct count), each (1,) on
        ``ctx_list[0]``, not waited for. ``accumulate`` must be 1 (not yet sharded)."""
        check_batch(X, y)
        optimizer = as_optimizer(lr, optimizer)
        if check_int(accumulate, "accumulate", low=1) != 1:
            raise BadValue("accumulate", "{accumulate} > 1 does not work with {zero=3} yet; use {zero=2}")
        X_shards, y_shards = split_and_load(X, self.ctx_list), split_and_load(y, self.ctx_list)
        outputs, losses = self._forward_backward(X_shards, y_shards, loss)
        check_labels(y, outputs[0].shape[-1], loss)
        for r in range(len(X_shards), len(self.ctx_list)):   # an idle context takes the first one's statistics
            for first, aux in zip(self.aux_arrays[0], self.aux_arrays[r]):
                first.copyto(aux)
        t = optimizer.num_update + 1
        lr_t = optimizer.lr_at(t)
        regions = [[[(0, shard.data.size)]] for shard in self.shards]
        if optimizer.clip_norm is not None:   # the norm of every context's chunks, as ZeRO-2 adds its shards'
            _clip(optimizer.clip_norm, self.groups(), regions, 2, X.shape[0])
        for shard, (shard_regions,) in zip(self.shards, regions):
            if shard.data.size:
                _update(optimizer, shard, shard_regions, lr_t, 1.0 / X.shape[0], t)
        optimizer.num_update = t
        return loss_and_correct(outputs, y_shards, losses, self.ctx_list[0])

    # ---- what the training loop reads ----------------------------------------------------------------------------

    def groups(self):
        """Each context's shard, as one group each (what ``memory_table`` measures; each is updated alone)."""
        return [[shard] for shard in self.shards]

    def bytes_moved(self):
        """Bytes one step copies between contexts, over all of them: each block's gather in forward and again in
        backward (not the last block's, whose buffer still holds it), each owner receiving the other contexts'
        copies of its chunk in the reduce-scatter: ``(K - 1) (3 Psi - Psi_last)`` elements of ``Psi``, ZeRO's
        3 Psi a device (times (K - 1) / K, the part that is not already there)."""
        k, itemsize = len(self.ctx_list), self.shards[0].data.dtype(0).itemsize
        psi = sum(block.size for block in self.blocks)
        return (k - 1) * (3 * psi - self.blocks[-1].size) * itemsize

    def _chunks(self, flat, i):
        """Context ``i``'s chunks of every block of ``flat`` (a flat array of the model), one after the other: the
        layout of its shard (``_whole`` puts them back). Context ``i`` must own at least one element."""
        return mx.nd.concat(*[flat[b.start + b.chunk(i)[0]:b.start + b.chunk(i)[1]] for b in self.blocks
                              if b.chunk(i)[1] > b.chunk(i)[0]], dim=0)

    def _whole(self, chunks):
        """One flat array of the model on the CPU from each context's flat array of its chunks (``chunks[i]``)."""
        whole = mx.nd.zeros((self._starts[-1],), ctx=mx.cpu(), dtype=self.shards[0].data.dtype)
        for block in self.blocks:
            for j, chunk in enumerate(chunks):
                a, b = block.chunk(j)
                if b > a:
                    algorithms._copy(chunk[block.offsets[j]:block.offsets[j] + b - a],
                                     whole[block.start + a:block.start + b])
        return whole

    def _arrays(self, whole):
        """A flat array of the model cut into its parameters' shapes (views)."""
        return [whole[a:b].reshape(shape) for a, b, shape in zip(self._starts, self._starts[1:], self._shapes)]

    def gather_state(self, optimizer):
        """The optimizer's state as a checkpoint stores it (``parallel.optim.gather_state``'s form): ``{state name:
        [array per parameter]}``, whole, on the CPU; zeros where it has not stepped yet."""
        entries = [optimizer.states.get((id(shard.data), (0, shard.data.size))) for shard in self.shards]
        state = {}
        for k, name in enumerate(optimizer.state_names()):
            chunks = [entry[1][k] if entry else shard.data.zeros_like() for entry, shard in zip(entries, self.shards)]
            state[name] = self._arrays(self._whole(chunks))
        return state

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
        """``{context: bytes}`` of full-size block arrays each context holds at once: its gather buffers (one
        block's parameters, two with prefetch) and the block gradient buffer reduce-scattered from."""
        return {ctx: sum(b.size * b.dtype(0).itemsize for b in buffers + [grads])
                for ctx, buffers, grads in zip(self.ctx_list, self._gathered, self._gathered_grads)}

    def params(self):
        """The model's trainable arrays, whole, on the CPU, copied from the shards."""
        return self._arrays(self._whole([shard.data for shard in self.shards]))

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
        """Accuracy over ``data_iter``, each batch split across the contexts, each gathering block by block."""
        return evaluate_accuracy(data_iter, list(range(len(self.ctx_list))), self.ctx_list,
                                 net=lambda X, i: self._predict(X, i))
