"""The optimizer step of every replica, replicated or sharded (ZeRO), and its state as a checkpoint stores it.

Once each replica holds the gradient of its shard of the batch, ``optimizer_step`` takes the same step everywhere.
It works on *groups*: the replicas that hold the same parameters on distinct contexts (data parallelism: one
group of K replicas; hybrid parallelism: one group per stage; model and pipeline parallelism: one group of one
replica per stage). For each group, with ``zero`` the optimizer's stage:

- ``zero=0``: all-reduce the gradients (``allreduce_grads``); every context updates its whole flat buffer with
  its whole copy of the optimizer state (replicated, as ``gluon.Trainer`` keeps it on every device);
- ``zero=1`` (ZeRO stage 1, PyTorch's ``ZeroRedundancyOptimizer``): all-reduce; context ``i`` updates only its
  shard ``shard_range(n, K, i)`` of the buffer, with the state of that shard alone (``1/K`` of it); then the
  parameters are all-gathered;
- ``zero=2`` (stage 2): the gradients are reduce-scattered instead (the first half of the ring), context ``i``
  updates its shard, and the parameters are all-gathered (the second half): the ring allreduce cut in two, the
  optimizer in the middle, with no more bytes moved than ``zero=0``.

The update of a shard is the same elementwise operator on the same values as the update of the whole buffer, so
every stage gives the same model (``zero=2`` sums in the reduce-scatter's order, the same as the ring's).
Clipping by global norm needs the norm of the whole summed gradient: each context contributes the squared norm
of what it owns, and every context adds the same contributions in the same order, so the scale is bitwise the
same everywhere (and on every worker, whose summed gradients are the same bits).

Across processes (``across``: the kvstore, ``parallel.job.allreduce_across``), each worker's contexts
reduce first, then the workers' sums are summed: with ``zero=2``, each context's shard alone. The state is
sharded over a worker's contexts and replicated over the workers (what PyTorch's FSDP calls hybrid sharding).
"""
from typing import NamedTuple

import mxnet as mx

from ..comm import DEFAULT_ALGORITHM, SHARDED_ALGORITHMS
from ..comm.algorithms import all_gather, reduce_scatter, shard_range
from ..comm.replica import FlatReplica, allreduce_grads, grads_of
from ..validate import check_int
from .optimizers import SGD, Optimizer

__all__ = ["as_optimizer", "optimizer_step", "gather_state", "load_state", "memory_per_context", "MemoryUse"]

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


def _regions(group, zero):
    """The elements ``(start, stop)`` of its flat buffer each replica of ``group`` updates."""
    if zero == 0 or not isinstance(group[0], FlatReplica):
        return [None] * len(group)   # the whole replica
    return [shard_range(group[0].data.size, len(group), i) for i in range(len(group))]


def _check_groups(groups, zero, algorithm):
    for g, group in enumerate(groups):
        if not group:
            raise ValueError(f"groups[{g}] is empty; a group holds the replicas of the same parameters")
        flat = all(isinstance(replica, FlatReplica) for replica in group)
        if zero and not flat:
            raise ValueError("zero > 0 shards flat buffers: build the replicas with get_params from parameters of "
                             "one dtype, or use zero=0")
        if zero == 2 and len(group) > 1 and algorithm not in SHARDED_ALGORITHMS:
            raise ValueError(f"zero=2 reduce-scatters the gradients, which the {algorithm} allreduce cannot; use "
                             f"algorithm {' or '.join(repr(a) for a in SHARDED_ALGORITHMS)}")


def _reduce(group, zero, algorithm, active, across, regions, compressor=None):
    """Sum the group's gradients: all-reduced (zero 0, 1) or reduce-scattered (zero 2), then over the workers."""
    if zero < 2:
        allreduce_grads(group, algorithm, active, compressor)
        if across is not None:
            across(group, None)
        return
    for replica in group[len(group) if active is None else active:]:   # idle replicas add nothing
        replica.grad[:] = 0
    reduce_scatter([replica.grad for replica in group], algorithm)
    if across is not None:
        across(group, regions)


def _owned_grads(group, regions, zero):
    """The gradient buffers whose squared norms add up to the group's whole summed gradient, once each."""
    if zero == 2:
        return [replica.grad[a:b] for replica, (a, b) in zip(group, regions) if b > a]
    return grads_of(group[0])


def _clip(clip_norm, groups, regions, zero, batch_size):
    """Scale every gradient so that the mean gradient's global norm is at most ``clip_norm``, in place."""
    partials = [mx.nd.norm(grad).reshape((1,)) ** 2
                for group, group_regions in zip(groups, regions) for grad in _owned_grads(group, group_regions, zero)]
    scales = {}
    for group, group_regions in zip(groups, regions):
        for replica, region in zip(group, group_regions):
            ctx = grads_of(replica)[0].context
            if ctx not in scales:   # the same sum, in the same order, on every context: the same bits
                total = mx.nd.add_n(*[p.as_in_context(ctx) for p in partials])
                norm = total.sqrt() / batch_size
                scales[ctx] = mx.nd.clip(clip_norm / (norm + CLIP_EPS), 0.0, 1.0)
            grads = grads_of(replica) if region is None else [replica.grad[region[0]:region[1]]]
            for grad in grads:
                if grad.size:
                    mx.nd.broadcast_mul(grad, scales[ctx], out=grad)


def _update(optimizer, replica, region, lr, rescale, t):
    """Update ``replica`` (its whole buffer, each of its arrays, or the elements ``region`` of its buffer)."""
    if not isinstance(replica, FlatReplica):   # a list of arrays: one update per array
        for param in replica:
            optimizer.update(param, param.grad, optimizer.state_for(param, (id(param), None), param), lr, rescale, t)
        return
    if region is None:
        weight, grad = replica.data, replica.grad
    else:
        start, stop = region
        if start == stop:
            return
        weight, grad = replica.data[start:stop], replica.grad[start:stop]
    optimizer.update(weight, grad, optimizer.state_for(replica.data, (id(replica.data), region), weight), lr,
                     rescale, t)


def optimizer_step(optimizer, groups, batch_size, algorithm=DEFAULT_ALGORITHM, active=None, across=None,
                   compressor=None):
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
    algorithm : str
        The allreduce (``zero`` 0 and 1) or, for ``zero=2``, the reduce-scatter and all-gather: ``"ring"`` or
        ``"fused"`` (``parallel.comm.SHARDED_ALGORITHMS``). ``zero=1`` all-gathers with the ring after a ring
        allreduce and directly otherwise.
    active : int, optional
        Replicas ``active..`` of each group computed nothing this step: they add zero.
    across : callable, optional
        ``across(group, regions)`` sums the group's gradients over the workers of a distributed job, in place:
        the whole buffers (``regions`` None) or each replica's region (``zero=2``).
    compressor : parallel.compress.Compressor, optional
        Sum the gradients between the contexts as compressed payloads, with error feedback (``zero`` 0 and 1).

    Afterwards every replica of a group holds the same parameters. Nothing waits for the devices.
    """
    check_int(batch_size, "batch_size", low=1)
    zero = optimizer.zero
    _check_groups(groups, zero, algorithm)
    if compressor is not None and zero == 2:
        raise ValueError("zero=2 reduce-scatters the gradients, which compression does not do yet; use zero=0 or "
                         "zero=1 with compression")
    t = optimizer.num_update + 1
    lr = optimizer.lr_at(t)
    regions = [_regions(group, zero) for group in groups]
    for group, group_regions in zip(groups, regions):
        _reduce(group, zero, algorithm, active, across, group_regions, compressor)
    if optimizer.clip_norm is not None:
        _clip(optimizer.clip_norm, groups, regions, zero, batch_size)
    for group, group_regions in zip(groups, regions):
        for replica, region in zip(group, group_regions):
            _update(optimizer, replica, region, lr, 1.0 / batch_size, t)
        if zero and len(group) > 1:
            all_gather([replica.data for replica in group], "ring" if algorithm == "ring" else "fused")
    optimizer.num_update = t


def _group_state(optimizer, group, regions):
    """The whole state of a group's parameters, per state name: one flat array on the CPU (or, for lists of
    arrays, one per array); zeros where the optimizer has not stepped yet."""
    first = group[0]
    names = optimizer.state_names()
    if not isinstance(first, FlatReplica):
        entries = [optimizer.states.get((id(p), None)) for p in first]
        return {name: [(e[1][k] if e else mx.nd.zeros(p.shape, dtype=p.dtype)).as_in_context(mx.cpu())
                       for e, p in zip(entries, first)] for k, name in enumerate(names)}
    pieces = {name: [] for name in names}
    for replica, region in sorted(zip(group, regions), key=lambda item: (item[1] or (0, 0))[0]):
        size = replica.data.size if region is None else region[1] - region[0]
        entry = optimizer.states.get((id(replica.data), region))
        for k, name in enumerate(names):
            piece = entry[1][k] if entry else mx.nd.zeros((size,), dtype=first.data.dtype)
            pieces[name].append(piece.as_in_context(mx.cpu()))
        if region is None:
            break   # replicated: the first replica's state is everyone's
    return {name: [mx.nd.concat(*parts, dim=0) if len(parts) > 1 else parts[0]]
            for name, parts in pieces.items() if parts}


def _positions(groups, params):
    """For each array of ``params`` (a strategy's ``params()``), its group and index in the group's replicas."""
    where = {id(array): (g, j) for g, group in enumerate(groups) for j, array in enumerate(group[0])}
    try:
        return [where[id(param)] for param in params]
    except KeyError:
        raise ValueError("params are not the first replicas' arrays of groups") from None


def _split(flat, replica):
    """A flat array cut into the shapes of ``replica``'s arrays, in order (views)."""
    arrays, offset = [], 0
    for param in replica:
        arrays.append(flat[offset:offset + param.size].reshape(param.shape))
        offset += param.size
    return arrays


def gather_state(optimizer, groups, params):
    """The optimizer's state of a layout as layout-free arrays: ``{state name: [array per param]}``, one array of
    each parameter's shape on the CPU, in ``params`` order (the strategy's ``params()``); whole, however it is
    sharded (``zero``). ``{}`` for a stateless optimizer. Reading the arrays waits for the devices."""
    names = optimizer.state_names()
    if not names:
        return {}
    per_group = []
    for group in groups:
        state = _group_state(optimizer, group, _regions(group, optimizer.zero))
        per_group.append({name: (_split(arrays[0], group[0]) if isinstance(group[0], FlatReplica) else arrays)
                          for name, arrays in state.items()})
    return {name: [per_group[g][name][j] for g, j in _positions(groups, params)] for name in names}


def load_state(optimizer, groups, params, state):
    """Give ``optimizer`` the state ``state`` (``gather_state``'s form, from any layout) for ``groups``, laid out
    as its ``zero`` says: each replica's copy (or shard) on its context. Replaces what it held for them."""
    names = optimizer.state_names()
    if sorted(state) != sorted(names):
        raise ValueError(f"state holds {sorted(state)} but {optimizer.name} keeps {list(names)}")
    positions = _positions(groups, params)
    for name in names:
        if len(state[name]) != len(params):
            raise ValueError(f"state[{name!r}] holds {len(state[name])} arrays, the model {len(params)}")
    for g, group in enumerate(groups):
        by_index = {j: k for k, (gg, j) in enumerate(positions) if gg == g}
        first = group[0]
        for i, (replica, region) in enumerate(zip(group, _regions(group, optimizer.zero))):
            if not isinstance(first, FlatReplica):
                for j, param in enumerate(replica):
                    optimizer.states[(id(param), None)] = (param, [state[name][by_index[j]].as_in_context(
                        param.context).astype(param.dtype) for name in names])
                continue
            flats = {name: mx.nd.concat(*[state[name][by_index[j]].reshape(-1) for j in range(len(first))], dim=0)
                     for name in names}
            start, stop = (0, replica.data.size) if region is None else region
            optimizer.states[(id(replica.data), region)] = (replica.data, [
                flats[name][start:stop].as_in_context(replica.data.context).astype(replica.data.dtype)
                for name in names])


class MemoryUse(NamedTuple):
    """Bytes one context holds for training: the parameters, their gradients, the optimizer's state."""
    params: int
    grads: int
    state: int


def memory_per_context(optimizer, groups):
    """What each context holds, measured on the arrays: ``{context: MemoryUse}``. The gradient buffers are
    whole on every context whatever ``zero`` (MXNet's backward writes the whole gradient); the state is what
    ``optimizer`` holds (after its first step)."""
    use = {}
    for group in groups:
        for replica in group:
            arrays = [replica.data] if isinstance(replica, FlatReplica) else list(replica)
            ctx = arrays[0].context
            nbytes = sum(a.size * a.dtype(0).itemsize for a in arrays)
            params, grads, state = use.get(ctx, (0, 0, 0))
            use[ctx] = (params + nbytes, grads + nbytes, state)
    for owner, states in optimizer.states.values():
        ctx = owner.context
        params, grads, state = use.get(ctx, (0, 0, 0))
        use[ctx] = (params, grads, state + sum(s.size * s.dtype(0).itemsize for s in states))
    return {ctx: MemoryUse(*values) for ctx, values in use.items()}
