"""The optimizer step of every replica, replicated or sharded (ZeRO), and its state as a checkpoint stores it.

Once each replica holds the gradient of its shard of the batch, ``optimizer_step`` takes the same step everywhere.
It works on *groups*: the replicas that hold the same parameters on distinct contexts (data parallelism: one
group of K replicas; hybrid parallelism: one group per stage; model and pipeline parallelism: one group of one
replica per stage). For each group, with ``zero`` the optimizer's stage:

- ``zero=0``: the ``Reducer`` all-reduces the gradients, bucket by bucket; every context updates its whole flat
  buffer (one update a bucket) with its whole copy of the optimizer state (replicated, as ``gluon.Trainer`` keeps
  it on every device);
- ``zero=1`` (ZeRO stage 1, PyTorch's ``ZeroRedundancyOptimizer``): all-reduce; context ``i`` updates only its
  shard ``shard_range(n, K, i)`` of each bucket, with the state of those shards alone (``1/K`` of it); then the
  parameters are all-gathered;
- ``zero=2`` (stage 2): each bucket's gradients are reduce-scattered instead (the first half of the ring),
  context ``i`` updates its shards, and the parameters are all-gathered (the second half): the ring allreduce cut
  in two, the optimizer in the middle, with no more bytes moved than ``zero=0``.

The update of a shard is the same elementwise operator on the same values as the update of the whole buffer, so
every stage gives the same model, bit for bit (``zero=2``'s reduce-scatter makes its allreduce's additions, in the
same order: ``parallel.comm.reduce_scatter``).
Clipping by global norm needs the norm of the whole summed gradient: the squared norm of every tensor (with
``zero=2``, of every shard a context owns) is added, in the same order on every context, so the scale is bitwise
the same everywhere (and on every worker, whose summed gradients are the same bits).

Across processes (the reducer's ``job``), each worker's contexts reduce first, then the workers' sums are summed
through the kvstore (``parallel.job.allreduce_across``): with ``zero=2``, each context's shard alone. The state is
sharded over a worker's contexts and replicated over the workers (what PyTorch's FSDP calls hybrid sharding).
"""
import contextlib
import functools
from typing import NamedTuple

import mxnet as mx
import numpy as np

from ..comm.algorithms import all_gather, shard_range
from ..comm.reducer import as_reducer
from ..comm.replica import FlatReplica, data_of, grads_of, is_split
from ..job import KEYS
from ..trace import issued
from ..validate import BadType, check_int
from .optimizers import SGD, Optimizer

__all__ = ["as_optimizer", "optimizer_step", "update_groups", "owned_regions", "ReplicatedStore", "CopiedStore",
           "gather_state", "load_state", "memory_per_context", "MemoryUse", "memory_table"]

#: Added to the gradient's norm before dividing by it, as ``gluon.utils.clip_global_norm`` does.
CLIP_EPS = 1e-8


def as_optimizer(lr=None, optimizer=None):
    """The optimizer of a step: ``optimizer``, or plain SGD at ``lr`` (the textbook's call, ``train_batch(...,
    lr)``: stateless, so a new ``SGD(lr)`` per step is the same step). Exactly one of them must be given."""
    if optimizer is None:
        if lr is None:
            raise TypeError("give lr (plain SGD at that rate) or optimizer (e.g. parallel.optim.SGD(0.1, "
                            "momentum=0.9))")
        return SGD(lr)
    if lr is not None:
        raise ValueError(f"lr={lr!r} and an optimizer were both given; the optimizer has its own lr "
                         f"({optimizer.lr if isinstance(optimizer, Optimizer) else '?'}): drop lr")
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be a parallel.optim.Optimizer (SGD, Adam, AdamW), got {optimizer!r}")
    return optimizer


def owned_regions(group, zero):
    """The element ranges ``(start, stop)`` of its flat buffer each replica of ``group`` updates, one a bucket: the
    whole bucket (``zero=0``) or the replica's shard of it (``shard_range``); None for a list of arrays."""
    if not isinstance(group[0], FlatReplica):
        return [None] * len(group)
    layouts, k = group[0].buckets, len(group)
    if zero == 0:
        return [[(b.start, b.end) for b in layouts]] * k
    return [[tuple(b.start + x for x in shard_range(b.end - b.start, k, i)) for b in layouts] for i in range(k)]


def _check_groups(groups, zero):
    for g, group in enumerate(groups):
        if not group:
            raise ValueError(f"groups[{g}] is empty; a group holds the replicas of the same parameters")
        flat = all(isinstance(replica, FlatReplica) for replica in group)
        if zero and not flat:   # the replicas' type, as every check of "needs flat replicas": a TypeError
            raise BadType("zero", "{zero} > 0 shards flat buffers: build the replicas with get_params from parameters "
                                  "of one dtype, or use {zero=0}")
        if zero and any(is_split(replica) for replica in group):
            raise ValueError(f"zero={zero} shards the flat buffer, and groups[{g}]'s parameters are split into one "
                             "buffer a bucket (Reducer(cross_barrier=True)): use zero=0 with a cross barrier")
        if zero == 3 and len(group) > 1:
            raise ValueError(f"groups[{g}] holds {len(group)} replicas; with zero=3 each group is one context's "
                             "shard, its gradient already reduced (parallel.strategies.sharded)")


def _pieces(replica, regions):
    """``(region, weight, grad)`` of each bucket's non-empty region of a flat replica: views of its parameter
    buffer and of the bucket's gradient buffer (the buffers themselves where a region is all of them: no view made
    every step)."""
    pieces, whole = [], replica.data.shape[0]
    for (start, stop), layout, grad in zip(regions, replica.buckets, replica.grads):
        if stop > start:   # a bucket's gradient buffer holds its elements layout.start .. layout.end
            weight = replica.data if (start, stop) == (0, whole) else replica.data[start:stop]
            if (start, stop) != (layout.start, layout.end):
                grad = grad[start - layout.start:stop - layout.start]
            pieces.append(((start, stop), weight, grad))
    return pieces


def _owned_grads(group, regions, zero):
    """The gradients whose squared norms add up to the group's whole summed gradient, once each: every tensor's
    (``zero`` 0 and 1: the same pieces whatever the buckets; not the ``copies`` of another group's), or each
    replica's owned shards (``zero`` 2 and 3), but the elements another group's replica also holds
    (``FlatReplica.uncounted``)."""
    if zero >= 2:
        grads = []
        for replica, replica_regions in zip(group, regions):
            for (start, stop), _, grad in _pieces(replica, replica_regions):
                grads += [grad[a - start:b - start] for a, b in _counted(start, stop, replica.uncounted)]
        return grads
    copies = group[0].copies if isinstance(group[0], FlatReplica) else ()
    return [param.grad for i, param in enumerate(group[0]) if i not in copies]


def _counted(start, stop, uncounted):
    """The element ranges of ``start .. stop - 1`` outside every range of ``uncounted`` (sorted, disjoint)."""
    ranges, low = [], start
    for a, b in uncounted:
        if b <= low or a >= stop:
            continue
        if a > low:
            ranges.append((low, a))
        low = max(low, b)
    if stop > low:
        ranges.append((low, stop))
    return ranges


def _squared_norms(groups, regions, zero, combine=None):
    """The squared norm of each owned gradient (``_owned_grads``), a (1,) array on its gradient's context: together
    the whole summed gradient's. ``combine``: a function of them giving every squared norm to add (ZeRO-3 in a job:
    every worker's)."""
    partials = [mx.nd.norm(grad).reshape((1,)) ** 2
                for group, group_regions in zip(groups, regions) for grad in _owned_grads(group, group_regions, zero)]
    return partials if combine is None else combine(partials)


def _clip(clip_norm, groups, regions, partials, batch_size):
    """Scale every gradient so that the mean gradient's global norm (the squared norms ``partials`` added, its
    square) is at most ``clip_norm``, in place."""
    scales = {}
    for group, group_regions in zip(groups, regions):
        for replica, region in zip(group, group_regions):
            ctx = grads_of(replica)[0].context
            if ctx not in scales:   # the same sum, in the same order, on every context: the same bits
                total = mx.nd.add_n(*[p.as_in_context(ctx) for p in partials])
                norm = total.sqrt() / batch_size
                scales[ctx] = mx.nd.clip(clip_norm / (norm + CLIP_EPS), 0.0, 1.0)
            grads = grads_of(replica) if region is None else [grad for _, _, grad in _pieces(replica, region)]
            for grad in grads:
                if grad.size:
                    mx.nd.broadcast_mul(grad, scales[ctx], out=grad)


def _update(optimizer, replica, regions, lr, rescale, t):
    """Update ``replica``: each of its arrays (a list), or each bucket's region of its flat buffer."""
    if not isinstance(replica, FlatReplica):   # a list of arrays: one update per array
        for param in replica:
            optimizer.update(param, param.grad, optimizer.state_for(param, (id(param), None), param), lr, rescale, t)
        return
    if replica.pieces is not None:   # split (a cross barrier): each bucket's piece, first layers first
        for b in reversed(range(len(replica.buckets))):
            _update_piece(optimizer, replica, b, lr, rescale, t)
        return
    for region, weight, grad in _pieces(replica, regions):
        optimizer.update(weight, grad, optimizer.state_for(replica.data, (id(replica.data), region), weight), lr,
                         rescale, t)


def _update_piece(optimizer, replica, b, lr, rescale, t):
    """Update bucket ``b`` of a split ``FlatReplica`` (``zero=0``): its parameter piece, then its copy in ``data``,
    bracketed on their own for a trace (the next forward's layers wait for their piece alone). The state is the
    bucket's region's, as without the split."""
    layout, piece, grad = replica.buckets[b], replica.pieces[b], replica.grads[b]
    region = (layout.start, layout.end)
    with issued("update", lambda: [piece, replica.data, grad], lambda: f"update bucket {b}", bucket=b):
        optimizer.update(piece, grad, optimizer.state_for(replica.data, (id(replica.data), region), piece), lr,
                         rescale, t)
        piece.copyto(replica.data[layout.start:layout.end])


def _updated_arrays(groups):
    """Every array an update of ``groups`` writes or reads from the step: each replica's parameters and gradients
    (a ``FlatReplica``'s flat buffer and bucket buffers)."""
    arrays = []
    for group in groups:
        for replica in group:
            arrays += data_of(replica) + grads_of(replica)
    return [array for array in arrays if array is not None]


def optimizer_step(optimizer, groups, batch_size, reducer=None, active=None):
    """One optimizer step of every replica of ``groups``, from the gradients each computed, in place.

    Parameters
    ----------
    optimizer : parallel.optim.Optimizer
        Its ``zero`` says how the state is laid out; its step count ``num_update`` grows by one.
    groups : list of list
        Each group: the replicas (``FlatReplica``, or lists of arrays for ``zero=0``) holding the same parameters
        on distinct contexts, each ``grad`` holding the gradient of its shard of the batch.
    batch_size : int
        The global batch: the summed gradient is divided by it (``rescale = 1 / batch_size``).
    reducer : parallel.comm.Reducer or str, optional
        How each group's gradients are summed (``Reducer.reduce``: its algorithm, buckets, hook and job; an
        algorithm's name for ``Reducer(name)``). With ``zero=2`` its algorithm is the reduce-scatter and
        all-gather: ``"ring"`` or ``"fused"`` (``parallel.comm.SHARDED_ALGORITHMS``); ``zero=1`` all-gathers
        with the ring after a ring allreduce and directly otherwise.
    active : int, optional
        Replicas ``active..`` of each group computed nothing this step: they add zero.

    Afterwards every replica of a group holds the same parameters; with ``optimizer.record_norm``,
    ``optimizer.grad_norm`` holds the mean gradient's global norm before clipping. Nothing waits for the devices.
    """
    check_int(batch_size, "batch_size", low=1)
    reducer = as_reducer(reducer)
    flight = None if reducer.job is None else reducer.job.flight   # a Job always has its recorder
    if flight is not None:   # the flight recorder numbers the steps its collectives belong to
        flight.next_step()
    zero = optimizer.zero
    _check_groups(groups, zero)
    first_bucket = 0   # in a job, each group's buckets under keys of their own
    for group in groups if zero < 3 else ():   # ZeRO-3 reduce-scattered each block as its backward ended
        (reducer.reduce_scatter if zero == 2 else reducer.reduce)(group, active, first_bucket)
        first_bucket += len(group[0].buckets) if isinstance(group[0], FlatReplica) else 0
    _update_groups(optimizer, groups, batch_size, reducer)


def update_groups(optimizer, groups, batch_size, reducer=None):
    """The update half of ``optimizer_step``, once each group's gradients are summed (``Reducer.reduce``, or
    reduce-scattered for ``zero=2``): clip, update every replica's parameters (its shards with ZeRO), all-gather
    the shards, count the step. The one update of the package: ``optimizer_step`` and ``DataParallel.update`` (the
    textbook's ``allreduce_grads()`` then ``update()``) both take it. Arguments as ``optimizer_step``'s."""
    check_int(batch_size, "batch_size", low=1)
    _check_groups(groups, optimizer.zero)
    _update_groups(optimizer, groups, batch_size, as_reducer(reducer))


def _update_groups(optimizer, groups, batch_size, reducer):
    """``update_groups`` of checked arguments (``optimizer_step`` has checked them before its reductions)."""
    zero = optimizer.zero
    t = optimizer.num_update + 1
    lr = optimizer.lr_at(t)
    regions = [owned_regions(group, zero) for group in groups]
    split = any(is_split(replica) for group in groups for replica in group)
    # a trace's bracket of the update (parallel.trace); split replicas bracket each bucket's update instead (one
    # bracket over them all would hold every bucket's update back until every sum had landed)
    with contextlib.nullcontext() if split else issued("update", lambda: _updated_arrays(groups)):
        if optimizer.clip_norm is not None or optimizer.record_norm:   # ZeRO-3's shards in a job: every worker's
            combine = functools.partial(_every_workers, reducer.job) if zero == 3 and reducer.job is not None else None
            partials = _squared_norms(groups, regions, zero, combine)
            if optimizer.record_norm and partials:   # queued, not read: fit reads it with the step's loss
                ctx = partials[0].context
                optimizer.grad_norm = mx.nd.add_n(*[p.as_in_context(ctx) for p in partials]).sqrt() / batch_size
            if optimizer.clip_norm is not None:
                _clip(optimizer.clip_norm, groups, regions, partials, batch_size)
        for group, group_regions in zip(groups, regions):
            for replica, replica_regions in zip(group, group_regions):
                _update(optimizer, replica, replica_regions, lr, 1.0 / batch_size, t)
    gather = "ring" if reducer.algorithm == "ring" else "fused"
    for group in groups if zero else ():
        if len(group) > 1:
            for b, layout in enumerate(group[0].buckets):
                pieces = [replica.data[layout.start:layout.end] for replica in group]
                with issued("gather", lambda: pieces, lambda: f"gather bucket {b}", bucket=b,
                            bytes=lambda: pieces[0].size * np.dtype(pieces[0].dtype).itemsize):
                    all_gather(pieces, gather)
    optimizer.num_update = t
    reducer.steps += 1   # the steps its sums fed: a compression's warm-up counts them (Reducer.warmup)


def _every_workers(job, partials):
    """The squared norms of every worker's shards in rank order (this worker's ``partials``): one gather over the
    workers, so that every context of the job adds the same numbers in the same order (ZeRO-3 in a job)."""
    local = mx.nd.concat(*[p.as_in_context(mx.cpu()) for p in partials], dim=0)
    gathered = job.allgather(KEYS["norms"], local)
    return [row[i:i + 1] for row in gathered for i in range(len(partials))]


class CopiedStore:
    """Stores that hold copies of the same arrays (a tensor group's ranks' copies of what every rank holds whole,
    each rank's store a ``ReplicatedStore`` or a ZeRO-3 group): read from the first, written to every one."""

    def __init__(self, stores):
        self.stores = list(stores)

    def read(self, optimizer, state, i, key=None):
        """Array ``i`` (or its state buffer ``state``) as the first store holds it (a collective call where the
        first store's read is one)."""
        return self.stores[0].read(optimizer, state, i, key)

    def write(self, optimizer, state, arrays):
        """Give every store ``arrays`` (their parameters, ``state`` -1, or state buffer ``state``)."""
        for store in self.stores:
            store.write(optimizer, state, arrays)


class ReplicatedStore:
    """A group of replicas holding the same parameters on distinct contexts (``FlatReplica``s, or lists of arrays):
    the parameters are read from the first and written to every one; the optimizer's state from the regions each
    replica updates (``parallel.optim.owned_regions``: the whole buffer with ``zero=0``, its shards with 1 or 2)."""

    def __init__(self, group):
        self.group = list(group)
        first = self.group[0]
        self.offsets = [0]
        for array in first:
            self.offsets.append(self.offsets[-1] + array.size)
        self.flat = isinstance(first, FlatReplica)

    def read(self, optimizer, state, i, key=None):
        """Array ``i`` of the group: the first replica's live array (``state`` -1), or state buffer ``state`` of the
        optimizer, whole, on the CPU (zeros before the first step)."""
        first = self.group[0]
        if state < 0:
            return first[i]
        if not self.flat:
            found = optimizer.region_state(first[i], None)
            return (found[state] if found else mx.nd.zeros(first[i].shape, dtype=first[i].dtype)).copyto(mx.cpu())
        low, high = self.offsets[i], self.offsets[i + 1]
        whole = mx.nd.zeros((high - low,), ctx=mx.cpu(), dtype=first.data.dtype)
        owners = list(zip(self.group, owned_regions(self.group, optimizer.zero)))
        for replica, regions in owners[:1] if optimizer.zero == 0 else owners:   # replicated: the first's
            for a, b in regions:
                lo, hi = max(a, low), min(b, high)
                found = optimizer.region_state(replica.data, (a, b)) if hi > lo else None
                if found:
                    whole[lo - low:hi - low] = found[state][lo - a:hi - a].as_in_context(mx.cpu())
        return whole.reshape(first[i].shape)

    def write(self, optimizer, state, arrays):
        """Give the group ``arrays`` (one a trained array, the group's order, any context): the parameters
        (``state`` -1) of every replica, or state buffer ``state`` of each region a replica updates."""
        if state < 0:
            for replica in self.group:
                for target, value in zip(replica, arrays):
                    target[:] = value.as_in_context(target.context).astype(target.dtype)
            return
        names = optimizer.state_names()
        for replica, regions in zip(self.group, owned_regions(self.group, optimizer.zero)):
            if not self.flat:
                for target, value in zip(replica, arrays):
                    kept = optimizer.region_state(target, None) or optimizer.create_state(target)
                    kept[state] = value.as_in_context(target.context).astype(target.dtype)
                    optimizer.set_region_state(target, None, kept)
                continue
            flat = mx.nd.concat(*[a.reshape(-1) for a in arrays], dim=0) if len(arrays) > 1 else arrays[0].reshape(-1)
            for a, b in regions:
                if b > a:
                    kept = optimizer.region_state(replica.data, (a, b)) or [
                        mx.nd.zeros((b - a,), ctx=replica.data.context, dtype=replica.data.dtype) for _ in names]
                    kept[state] = flat[a:b].as_in_context(replica.data.context).astype(replica.data.dtype)
                    optimizer.set_region_state(replica.data, (a, b), kept)


def gather_state(optimizer, groups, params):
    """The optimizer's state of a layout as layout-free arrays: ``{state name: [array per param]}``, one array of
    each parameter's shape on the CPU, in ``params`` order (the arrays of the groups' first replicas, as a
    strategy's ``params()`` gives them); whole, however it is sharded (``zero``). ``{}`` for a stateless optimizer.
    Reading the arrays waits for the devices."""
    places = _places(groups, params)
    return {name: [store.read(optimizer, k, i) for store, i in places]
            for k, name in enumerate(optimizer.state_names())}


def load_state(optimizer, groups, params, state):
    """Give ``optimizer`` the state ``state`` (``gather_state``'s form, from any layout) for ``groups``, laid out
    as its ``zero`` says: each replica's copy (or shard) on its context. Replaces what it held for them."""
    names = optimizer.state_names()
    if sorted(state) != sorted(names):
        raise ValueError(f"state holds {sorted(state)} but {optimizer.name} keeps {list(names)}")
    for name in names:
        if len(state[name]) != len(params):
            raise ValueError(f"state[{name!r}] holds {len(state[name])} arrays, the model {len(params)}")
    places = _places(groups, params)
    for k, name in enumerate(names):
        per_store = {}
        for (store, i), value in zip(places, state[name]):
            per_store.setdefault(store, {})[i] = value if isinstance(value, mx.nd.NDArray) else mx.nd.array(value)
        for store, arrays in per_store.items():
            store.write(optimizer, k, [arrays[i] for i in range(len(arrays))])


def _places(groups, params):
    """For each array of ``params``, the ``ReplicatedStore`` of its group and its index there."""
    stores = [ReplicatedStore(group) for group in groups]
    where = {id(array): (store, j) for store in stores for j, array in enumerate(store.group[0])}
    try:
        return [where[id(param)] for param in params]
    except KeyError:
        raise ValueError("params are not the first replicas' arrays of groups") from None


class MemoryUse(NamedTuple):
    """Bytes one context holds for training: the parameters, their gradients, the optimizer's state."""
    params: int
    grads: int
    state: int


def memory_per_context(optimizer, groups):
    """What each context holds, measured on the arrays: ``{context: MemoryUse}``. The gradient buffers are
    whole on every context whatever ``zero`` (MXNet's backward writes the whole gradient); the state is what
    ``optimizer`` holds (after its first step). A split replica's parameters count twice: its pieces and ``data``."""
    use = {}
    for group in groups:
        for replica in group:
            arrays = data_of(replica) + (replica.pieces if is_split(replica) else [])
            ctx = arrays[0].context
            nbytes = sum(a.size * a.dtype(0).itemsize for a in arrays)
            grad_bytes = sum(g.size * g.dtype(0).itemsize for g in grads_of(replica))
            params, grads, state = use.get(ctx, (0, 0, 0))
            use[ctx] = (params + nbytes, grads + grad_bytes, state)
    for owner, states in optimizer.states.values():
        ctx = owner.context
        params, grads, state = use.get(ctx, (0, 0, 0))
        use[ctx] = (params, grads, state + sum(s.size * s.dtype(0).itemsize for s in states))
    return {ctx: MemoryUse(*values) for ctx, values in use.items()}


def _planned_state(optimizer, groups):
    """``{context: bytes}`` of the state ``optimizer`` holds once it has stepped, from the layout alone: one buffer a
    state name for each region a replica updates (its whole buffer, or its shards with ``zero``)."""
    names = len(optimizer.state_names())
    planned = {}
    for group in groups:
        for replica, regions in zip(group, owned_regions(group, optimizer.zero)):
            if regions is None:   # a list of arrays: one state per array
                arrays = list(replica)
                nbytes = sum(a.size * a.dtype(0).itemsize for a in arrays)
                ctx = arrays[0].context
            else:
                nbytes = sum(stop - start for start, stop in regions) * replica.data.dtype(0).itemsize
                ctx = replica.data.context
            planned[ctx] = planned.get(ctx, 0) + names * nbytes
    return planned


def memory_table(optimizer, groups, gathered=None, temporary=None):
    """What each context holds for training, as ``--metrics-json`` records it (ZeRO's count): a list, one dict a
    context in the order the groups first name it, ``{"context", "parameters", "gradients", "optimizer_state",
    "gathered_peak", "temporary_buffers"}`` in bytes. Parameters and gradients are measured on the replicas' arrays;
    the optimizer's state is measured on its buffers once it has stepped, and before that is what it will hold (the
    regions each context updates times the state's buffers a parameter). ``gathered_peak`` is the most bytes of
    full parameters gathered at once on the context, ``gathered`` (``{context: bytes}``: ZeRO-3's gather buffers),
    else 0: every other ``zero`` keeps the parameters whole. ``temporary_buffers`` (ZeRO's "temporary buffers",
    which it counts apart from the model's states) is ``temporary`` (``{context: bytes}``: the buffers a
    reduction receives into, ZeRO-3's block gradient), else 0. Reads no array's values: nothing waits.

    >>> import mxnet as mx
    >>> from parallel import get_params, init_lenet_params
    >>> replicas = [get_params(init_lenet_params(), mx.cpu(i)) for i in range(2)]
    >>> [row["optimizer_state"] for row in memory_table(SGD(0.1, momentum=0.9, zero=1), [replicas])]
    [258136, 258136]
    """
    measured = memory_per_context(optimizer, groups)
    planned = None if optimizer.states else _planned_state(optimizer, groups)
    return [{"context": str(ctx), "parameters": use.params, "gradients": use.grads,
             "optimizer_state": use.state if planned is None else planned.get(ctx, 0),
             "gathered_peak": (gathered or {}).get(ctx, 0), "temporary_buffers": (temporary or {}).get(ctx, 0)}
            for ctx, use in measured.items()]
