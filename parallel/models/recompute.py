"""Activation recomputation (activation checkpointing): keep each block's input, recompute its forward in backward.

A training step keeps, until its backward pass, every array the backward of each operator reads: the
activations of the whole network. ``Recompute(net, segments)`` runs the network as a chain of blocks (LeNet's
layers, ResNet-18's residual blocks) and keeps only what enters each block: during backward each block's forward
runs again, recorded this time, and its backward follows at once, so at most one block's activations exist at a
time besides the blocks' inputs (Chen et al. 2016: O(sqrt(n)) memory for a network of n layers cut into sqrt(n)
blocks, for about one more forward pass). MXNet's ``MXNET_BACKWARD_DO_MIRROR`` does this only in the symbolic
executor, not for gluon or cached graphs, so it is written here, explicitly:

- forward: every block but the last runs off the tape (in training mode: BatchNorm normalises by the batch), its
  input kept; the last block runs on the tape;
- backward (``Recompute.backward``, which the training step calls in place of ``autograd.backward``): the last
  block's backward, then for each block before it, last first, its forward again under ``autograd.record()`` on
  its kept input and the replica's own parameter arrays, and its backward from the gradient of its output. The
  parameters' gradients land where an ordinary backward writes them, with their ``grad_req`` (so accumulation
  works). BatchNorm's running statistics are updated once a step, by the recomputation (MXNet's BatchNorm
  updates them in its backward pass, the synchronized one in its forward): the forward off the tape writes
  them into scratch arrays.

Each block runs the same operators on the same values as in the whole network, so the gradients are bitwise an
ordinary step's (``tests/test_recompute.py``). A block spans every context of a step, so BatchNorm synchronized
across the contexts (``GluonNet.forward_all``) recomputes over the whole batch.

Why not an ``autograd.Function`` a block: MXNet 1.9.1's ``Function`` stops assigning input gradients at the first
input whose gradient is not requested (the data), and never adds one where ``grad_req`` is ``"add"`` (it compares
the request's number with the string ``'add'``): the first block and accumulation would silently get no gradient.
"""
import mxnet as mx
from mxnet import autograd

__all__ = ["Recompute", "Segment"]


class Segment:
    """One block of a ``Recompute``: ``net(X, params)`` run on a replica's trained arrays ``first .. stop - 1``
    and its other arrays (BatchNorm's running statistics) ``aux_first .. aux_stop - 1``."""

    def __init__(self, net, first, stop, aux_first=0, aux_stop=0, label=""):
        self.net, self.first, self.stop, self.aux_first, self.aux_stop = net, first, stop, aux_first, aux_stop
        self.label = label

    def __repr__(self):
        return f"Segment({self.label or self.net!r}, arrays {self.first}..{self.stop - 1})"


class _Part(list):
    """A segment's arrays of one replica, as ``GluonNet`` takes a replica: trained arrays, ``names`` and ``aux``."""

    def __init__(self, arrays, names, aux):
        super().__init__(arrays)
        self.names, self.aux = names, aux


def _run(net, X_shards, parts):
    """``net`` on each context's input (an array, or a tuple of arrays for a block of several inputs)."""
    forward_all = getattr(net, "forward_all", None)
    if forward_all is not None:
        return forward_all(X_shards, parts)
    return [net(X, part) for X, part in zip(X_shards, parts)]


def _flat(states):
    """Every array of each context's state (an array or a tuple of them), in order."""
    return [X for state in states for X in (state if isinstance(state, tuple) else (state,))]


def _detached(states, attach=True):
    """Each context's state off the tape (a tuple stays a tuple), its arrays with gradients attached if
    ``attach``: a block's input, whose gradient the block's backward writes."""
    detached = []
    for state in states:
        arrays = tuple(X.detach() for X in (state if isinstance(state, tuple) else (state,)))
        for X in arrays if attach else ():
            X.attach_grad()
        detached.append(arrays if isinstance(state, tuple) else arrays[0])
    return detached


class Recompute:
    """A network ``full`` (a function ``net(X, params)`` of a replica, e.g. ``lenet_cached`` or a ``GluonNet``)
    trained block by block with activation recomputation (see the module's docstring).

    Parameters
    ----------
    full : callable
        The whole network: what runs outside ``autograd.record()`` (evaluation).
    segments : list of Segment
        The blocks in order, covering the replica's trained arrays (and its other arrays) once each, in order.

    Inside ``autograd.record()``, ``net.forward_all(X_shards, device_params)`` (or ``net(X, params)``) runs every
    block but the last off the tape, keeping each one's input, and the last block on the tape; then
    ``net.backward(heads)`` (in place of ``autograd.backward(heads)``) runs the last block's backward and, for
    each block before it, its forward again (recorded) and its backward. The parameters' gradients are written
    where an ordinary backward writes them, with their ``grad_req`` (``"add"`` accumulates). A recorded forward
    replaces the one before it that was not followed by ``backward``.

    >>> import mxnet as mx
    >>> from mxnet import autograd
    >>> from parallel import get_params, init_lenet_params
    >>> from parallel.models import MODELS
    >>> lenet = MODELS["lenet"].behaviour
    >>> net = Recompute(lenet.net(None), lenet.segments(init_lenet_params()))
    >>> params = get_params(init_lenet_params(), mx.cpu())
    >>> with autograd.record():
    ...     loss = net(mx.nd.ones((4, 1, 28, 28)), params).sum()
    >>> net.backward([loss])
    >>> bool((params[0].grad != 0).sum() > 0)   # the first layer got its gradient
    True
    """

    def __init__(self, full, segments):
        segments = list(segments)
        if not segments:
            raise ValueError("segments is empty; a network recomputes block by block")
        for a, b in zip(segments, segments[1:]):
            if (a.stop, a.aux_stop) != (b.first, b.aux_first):
                raise ValueError(f"segments {a!r} and {b!r} do not follow each other in the replica's arrays")
        self.full, self.segments = full, segments
        self._parts = {}     # id(replica) -> (replica, [part per segment], [part with scratch aux per segment])
        self._pending = None   # what the last recorded forward left for backward: [(segment index, inputs)]

    def __repr__(self):
        return f"Recompute({self.full!r}, {len(self.segments)} blocks)"

    def _parts_of(self, replica):
        """A replica's arrays per segment, and the same with scratch running statistics (which a recomputed
        forward writes instead of the replica's, updated once a step). Made once per replica, so that cached graphs
        bound to the arrays are built once."""
        entry = self._parts.get(id(replica))
        if entry is None:
            names, aux = list(getattr(replica, "names", ())), list(getattr(replica, "aux", ()))
            parts, scratch = [], []
            for s in self.segments:
                arrays, block_aux = replica[s.first:s.stop], aux[s.aux_first:s.aux_stop]
                block_names = names[s.first:s.stop] if names else None
                parts.append(_Part(arrays, block_names, block_aux))
                scratch.append(_Part(arrays, block_names, [a.copy() for a in block_aux]))
            entry = self._parts[id(replica)] = (replica, parts, scratch)
        return entry[1], entry[2]

    def __call__(self, X, params):
        return self.forward_all([X], [params])[0]

    def forward_all(self, X_shards, device_params):
        """The outputs of every shard on its replica's context (``GluonNet.forward_all``'s contract)."""
        if len(X_shards) != len(device_params):
            raise ValueError(f"{len(X_shards)} shards but {len(device_params)} replicas")
        if not autograd.is_recording():
            return _run(self.full, X_shards, device_params)
        per_replica = [self._parts_of(replica) for replica in device_params]
        hidden, kept = list(X_shards), []
        with autograd.pause(train_mode=True):   # BatchNorm by the batch, its running statistics into scratch copies
            for s, segment in enumerate(self.segments[:-1]):
                kept.append(hidden)
                hidden = _run(segment.net, hidden, [scratch[s] for _, scratch in per_replica])
        last = len(self.segments) - 1
        if last:
            hidden = _detached(hidden)
        self._pending = (per_replica, kept, hidden)
        return _run(self.segments[last].net, hidden, [parts[last] for parts, _ in per_replica])

    def backward(self, heads, head_grads=None):
        """The backward pass of the last recorded forward: ``autograd.backward(heads, head_grads)`` through the
        last block, then each earlier block recomputed and differentiated, last first. Nothing waits."""
        if self._pending is None:
            raise RuntimeError("net.backward follows a forward recorded under autograd.record(); there is none")
        per_replica, kept, hidden = self._pending
        self._pending = None
        autograd.backward(heads, head_grads)
        for s in reversed(range(len(kept))):
            grads = [X.grad for X in _flat(hidden)]
            inputs = _detached(kept[s], attach=s > 0)   # the first block's input is the data: no gradient
            with autograd.record(train_mode=True):
                outputs = _run(self.segments[s].net, inputs, [parts[s] for parts, _ in per_replica])
            autograd.backward(_flat(outputs), grads)
            hidden = inputs
