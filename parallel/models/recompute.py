"""A network run block by block, with hooks around each block and, optionally, activation recomputation.

A training step keeps, until its backward pass, every array the backward of each operator reads: the activations
of the whole network. ``Blocks(segments, recompute=True)`` runs a network as a chain of blocks (LeNet's layers,
ResNet-18's residual blocks, the ViT's children) and keeps only what enters each block: during backward each
block's forward runs again, recorded this time, and its backward follows at once, so at most one block's
activations exist at a time besides the blocks' inputs (Chen et al. 2016: O(sqrt(n)) memory for a network of n
layers cut into sqrt(n) blocks, for about one more forward pass). MXNet's ``MXNET_BACKWARD_DO_MIRROR`` does this
only in the symbolic executor, not for gluon or cached graphs, so it is written here, explicitly:

- forward: every block but the last runs off the tape (in training mode: BatchNorm normalises by the batch), its
  input kept; the last block runs on the tape;
- backward: the last block's backward, then for each block before it, last first, its forward again under
  ``autograd.record()`` on its kept input and the replica's own parameter arrays, and its backward from the
  gradient of its output. The parameters' gradients land where an ordinary backward writes them, with their
  ``grad_req`` (so accumulation works). BatchNorm's running statistics are updated once a step, by the
  recomputation (MXNet's BatchNorm updates them in its backward pass, the synchronized one in its forward): the
  forward off the tape writes them into scratch arrays.

*Hooks* (``BlockHooks``) run before each block's forward (again before its recomputation) and after its backward:
ZeRO-3 is this class with hooks that gather a block's sharded parameters and reduce-scatter its gradients
(``parallel.strategies.sharded``), as fairscale composes ``FSDP(checkpoint_wrapper(block))``. A block's net runs
every replica of a step at once (``run_net``: BatchNorm synchronized across them); a tensor-parallel block runs
on its ranks and records its collectives on the *tape* each forward is given (``parallel.comm.tensor``), whose
backward the block's backward runs.

Each block runs the same operators on the same values as in the whole network, so the gradients are bitwise an
ordinary step's (``tests/test_recompute.py``). ``Recompute(full, segments)`` is the network of a data-parallel
replica as ``parallel.step`` runs it (``forward_all`` / ``backward``).

Why not an ``autograd.Function`` a block: MXNet 1.9.1's ``Function`` stops assigning input gradients at the first
input whose gradient is not requested (the data), and never adds one where ``grad_req`` is ``"add"`` (it compares
the request's number with the string ``'add'``): the first block and accumulation would silently get no gradient.
"""
from typing import NamedTuple

import mxnet as mx
from mxnet import autograd

from ..comm.replica import Replica, aux_of, names_of
from ..comm.statistics import Gathers
from ..comm.tensor import SegmentTape
from ..trace import mark_backward_each
from .base import Net

__all__ = ["Recompute", "Segment", "Blocks", "BlockHooks", "Part", "run_net", "flat_arrays", "detached", "parts_of"]


class Segment:
    """One block of a network: ``net(X, params)`` run on a replica's trained arrays ``first .. stop - 1`` and its
    other arrays (BatchNorm's running statistics) ``aux_first .. aux_stop - 1``; ``block``, the gluon block it
    runs (None for LeNet's layers), which a tensor-parallel run splits."""

    def __init__(self, net, first, stop, aux_first=0, aux_stop=0, label="", block=None):
        self.net, self.first, self.stop, self.aux_first, self.aux_stop = net, first, stop, aux_first, aux_stop
        self.label, self.block = label, block

    def __repr__(self):
        return f"Segment({self.label or self.net!r}, arrays {self.first}..{self.stop - 1})"


class Part(Replica):
    """A block's arrays of one replica, as ``GluonNet`` takes a replica: trained arrays, ``names`` and ``aux``."""

    def __init__(self, arrays, names, aux):
        super().__init__(arrays, names)
        self.aux = aux   # the replica's own list (or its scratch copies), not a copy of it


def run_net(net, X_shards, parts, tape=None):
    """``net`` on each replica's input (an array, a tuple of arrays for a block of several inputs, or a tensor-parallel
    group's ``Ranks``), all replicas at once where the net takes them so (``forward_all``: BatchNorm synchronized,
    a tensor-parallel block recording on ``tape``). With no input, what the net makes without an example on the
    replicas ``parts`` (``Net.idle_all``: a job's BatchNorm gathers); returns ``[]``."""
    if not isinstance(net, Net):   # a plain function net(X, params)
        return [net(X, part) for X, part in zip(X_shards, parts)]
    if not X_shards and not net.ranked:
        net.idle_all(parts)
        return []
    if net.ranked:   # tensor groups: on the tape
        return net.forward_all(X_shards, parts, tape)
    return net.forward_all(X_shards, parts)


def flat_arrays(states):
    """Every array of each replica's state (an array, a tuple of arrays, or a ``Ranks``), in order."""
    arrays = []
    for state in states:
        if isinstance(state, tuple):
            arrays.extend(state)
        elif isinstance(state, mx.nd.NDArray):
            arrays.append(state)
        else:   # a tensor-parallel group's value: one array a rank
            arrays.extend(state.arrays)
    return arrays


def detached(states, attach=True):
    """Each replica's state off the tape (a tuple stays a tuple, ``Ranks`` stay ``Ranks``), its arrays with gradients
    attached if ``attach``: a block's input, whose gradient the block's backward writes."""
    out = []
    for state in states:
        if isinstance(state, tuple):
            arrays = tuple(X.detach() for X in state)
        elif isinstance(state, mx.nd.NDArray):
            arrays = state.detach()
        else:
            arrays = state.detach()
        for X in flat_arrays([arrays]) if attach else ():
            X.attach_grad()
        out.append(arrays)
    return out


def parts_of(segments, replica, scratch=False):
    """A replica's arrays per segment (``Part``s); ``scratch``: with copies of its running statistics, which a forward
    off the tape writes instead of the replica's (updated once a step, by the recomputation)."""
    names, aux = list(names_of(replica) or ()), aux_of(replica)
    parts = []
    for s in segments:
        block_aux = aux[s.aux_first:s.aux_stop]
        parts.append(Part(replica[s.first:s.stop], names[s.first:s.stop] if names else None,
                          [a.copy() for a in block_aux] if scratch else block_aux))
    return parts


class BlockHooks:
    """What ``Blocks`` calls around each block ``s`` (the default does nothing): ``before_forward(s, after,
    recompute)`` before the block runs (its forward, in evaluation, and again before its recomputation, then with
    ``recompute``; ``after``: the block that will run next, for a prefetch, or None), ``before_backward(s)`` before
    the backward of a block recorded in the forward (the last), ``after_backward(s, active)`` once its backward is
    issued, ``active`` the replicas that computed (the first ones: the others' gradients are not this pass's)."""

    def before_forward(self, s, after=None, recompute=False):
        """Called before block ``s`` runs."""

    def before_backward(self, s):
        """Called before the backward of block ``s``'s recorded forward."""

    def after_backward(self, s, active):
        """Called once block ``s``'s backward is issued, for the first ``active`` replicas."""


class Pending(NamedTuple):
    """What a recorded forward leaves for its backward: the tape of the last block (every block's, without
    recomputation), the kept inputs of the blocks before it, the inputs the last block read, and how many replicas
    computed (a micro-batch may leave the last ones without an example)."""
    tape: object
    kept: list
    hidden: list
    active: int
    #: More heads of the backward and their gradients (``Blocks.extra_heads``): what the recorded blocks added to
    #: the loss (a mixture of experts' auxiliary losses).
    extra: tuple = ((), ())
    #: What each block's forward gathered over a job's workers (BatchNorm's statistics), one
    #: ``parallel.comm.statistics.Gathers`` a block: kept for the recomputation of the blocks run off the tape, and
    #: the backward rounds a forward without an example owes.
    statistics: tuple = ()


class Blocks:
    """A network as a chain of blocks run over the replicas of a step, with hooks, optionally recomputing (see the
    module's docstring).

    Parameters
    ----------
    segments : list of Segment
        The blocks in order, covering the replica's trained arrays (and its other arrays) once each, in order.
    recompute : bool
        Keep only each block's input and run its forward again in backward.
    hooks : BlockHooks, optional
    algorithm : str
        The allreduce of a tensor-parallel block's collectives (its tape's).
    retain_graph : bool
        Keep what autograd holds of a block's graph after its backward (``autograd.backward``'s): with BatchNorm,
        the running statistics are in the graph of every micro-batch still pending (a pipeline's).
    sequence : bool
        Sequence parallelism on the tensor-parallel blocks' tapes (``SegmentTape``'s).
    kept : parallel.comm.tensor.KeptBytes, optional
        Where the tapes add the bytes each forward keeps for backward (``SegmentTape``'s).
    """

    def __init__(self, segments, recompute=False, hooks=None, algorithm="fused", retain_graph=False, sequence=False,
                 kept=None):
        segments = list(segments)
        if not segments:
            raise ValueError("segments is empty; a network runs block by block")
        for a, b in zip(segments, segments[1:]):
            if (a.stop, a.aux_stop) != (b.first, b.aux_first):
                raise ValueError(f"segments {a!r} and {b!r} do not follow each other in the replica's arrays")
        self.segments, self.recompute = segments, bool(recompute)
        self.hooks, self.algorithm, self.retain_graph = hooks or BlockHooks(), algorithm, retain_graph
        self.sequence, self.kept = sequence, kept
        ranked = [s.net for s in segments if isinstance(s.net, Net) and s.net.ranked]
        self._ranked = bool(ranked)
        # replicas in lockstep that are tensor groups record on one tape, its collectives over each group
        self._group = next((net.tensor for net in ranked if net.tensor is not None), None)

    def __repr__(self):
        return f"Blocks({len(self.segments)} blocks{', recomputed' if self.recompute else ''})"

    def _tape(self):
        """A new tape for a forward of tensor-parallel blocks (their collectives' backward); None for blocks of one
        rank, whose backward is autograd's own."""
        return SegmentTape(self.algorithm, self.sequence, self.kept, self._group) if self._ranked else None

    def _backward(self, tape, heads, head_grads):
        if tape is None:
            autograd.backward(heads, head_grads, retain_graph=self.retain_graph)
        else:
            tape.backward(heads, head_grads, self.retain_graph)

    def _run(self, s, X_shards, parts, tape=None):
        """Block ``s`` on the replicas that have an input (the first ones), or, with none, on every replica of
        ``parts`` (``run_net``: what a block makes without an example)."""
        return run_net(self.segments[s].net, X_shards, parts[:len(X_shards)] if X_shards else parts, tape)

    def extra_heads(self, s):
        """What the last recorded run of block ``s`` added to the loss besides its outputs, ``(heads, gradients)``:
        its net's ``take_heads()`` (a mixture of experts' auxiliary losses: ``parallel.models.lockstep``), or
        nothing. Its backward runs with the block's."""
        net = self.segments[s].net
        return net.take_heads() if isinstance(net, Net) else ((), ())

    @staticmethod
    def _with(heads, head_grads, extra):
        """``heads`` and ``head_grads`` with the ``extra`` heads and their gradients after them."""
        more, grads = extra
        if not more:
            return heads, head_grads
        head_grads = [None] * len(heads) if head_grads is None else list(head_grads)
        return list(heads) + list(more), head_grads + list(grads)

    def _next(self, s):
        return s + 1 if s + 1 < len(self.segments) else None

    def predict(self, X_shards, parts):
        """The outputs of every replica's input, outside ``autograd.record()`` (evaluation): each block after
        its hook. ``parts[s][r]``: block ``s``'s arrays of replica ``r``."""
        hidden = list(X_shards)
        for s in range(len(self.segments)):
            self.hooks.before_forward(s, self._next(s))
            hidden = self._run(s, hidden, parts[s], self._tape())
        return hidden

    def forward(self, X_shards, parts, scratch=None):
        """The recorded forward (call it inside ``autograd.record()``) of every replica's input; returns the outputs
        and the ``Pending`` its ``backward`` takes. ``parts[s][r]``: block ``s``'s arrays of replica ``r``;
        ``scratch`` the same with copies of the running statistics, for the blocks run off the tape (default
        ``parts``). Several forwards may be pending at once (a pipeline's micro-batches)."""
        hidden, n = list(X_shards), len(self.segments)
        # what each block gathers over a job's workers, kept for the blocks recomputed (all but the last)
        statistics = [Gathers(recomputed=self.recompute and s < n - 1) for s in range(n)]
        if not self.recompute:
            tape, more, grads = self._tape(), [], []
            for s in range(n):
                self.hooks.before_forward(s, self._next(s))
                with statistics[s].collecting():
                    hidden = self._run(s, hidden, parts[s], tape)
                extra = self.extra_heads(s)
                more += extra[0]
                grads += extra[1]
            return hidden, Pending(tape, [], [], len(X_shards), (more, grads), statistics)
        scratch = parts if scratch is None else scratch
        kept = []
        with autograd.pause(train_mode=True):   # BatchNorm by the batch, its running statistics into scratch copies
            for s in range(n - 1):
                self.hooks.before_forward(s, self._next(s))
                kept.append(hidden)
                with statistics[s].collecting():   # kept for the recomputation
                    hidden = self._run(s, hidden, scratch[s], self._tape())
        if n > 1:
            hidden = detached(hidden)
        self.hooks.before_forward(n - 1, None)
        tape = self._tape()
        with statistics[n - 1].collecting():
            out = self._run(n - 1, hidden, parts[n - 1], tape)
        return out, Pending(tape, kept, hidden, len(X_shards), self.extra_heads(n - 1), statistics)

    def backward(self, pending, heads, head_grads=None, parts=None):
        """The backward pass of a recorded forward: ``heads`` (arrays computed from its outputs, the losses; or its
        outputs' arrays with ``head_grads``) through the last block, then each earlier block recomputed (on
        ``parts``, ``forward``'s) and differentiated, last first, each followed by its hook. A kept input that is
        the forward's own input keeps its gradient where the caller attached it. Nothing waits. An empty
        micro-batch computed nothing: its hooks still run, and each block's backward rounds owed to a job's
        workers are made in its place (``parallel.comm.statistics.Gathers.settle``)."""
        n = len(self.segments)
        for s in reversed(range(len(pending.kept), n)):   # the blocks recorded in the forward
            self.hooks.before_backward(s)
        if len(heads):
            self._backward(pending.tape, *self._with(heads, head_grads, pending.extra))
        if not self.recompute:
            for s in reversed(range(n)):
                pending.statistics[s].settle()
                self.hooks.after_backward(s, pending.active)
            return
        pending.statistics[n - 1].settle()
        self.hooks.after_backward(n - 1, pending.active)
        hidden = pending.hidden
        for s in reversed(range(len(pending.kept))):
            grads = [X.grad for X in flat_arrays(hidden)]
            inputs = pending.kept[s]
            if s > 0:   # the first block's input is the data, or the caller's leaf (a pipeline stage's input)
                inputs = detached(inputs)
            self.hooks.before_forward(s, s - 1 if s else None, recompute=True)
            tape = self._tape()
            with autograd.record(train_mode=True), pending.statistics[s].reusing():   # gathered in the forward
                outputs = self._run(s, inputs, parts[s], tape)
            extra = self.extra_heads(s)
            if grads:
                heads = flat_arrays(outputs)
                mark_backward_each(heads)   # a trace's recomputed forward ends here, its backward follows
                self._backward(tape, *self._with(heads, grads, extra))
            pending.statistics[s].settle()
            self.hooks.after_backward(s, pending.active)
            hidden = inputs


class Recompute(Net):
    """A network ``full`` (a function ``net(X, params)`` of a replica, e.g. ``lenet_cached`` or a ``GluonNet``)
    trained block by block with activation recomputation (see the module's docstring): the net of a data-parallel
    replica (``parallel.step.DeviceReplicas``).

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
        self.full, self.blocks = full, Blocks(segments, recompute=True)
        self.segments = self.blocks.segments
        self._parts = {}     # id(replica) -> (replica, [part per segment], [part with scratch aux per segment])
        self._pending = None   # what the last recorded forward left for backward: (Pending, parts)

    def __repr__(self):
        return f"Recompute({self.full!r}, {len(self.segments)} blocks)"

    def _parts_of(self, replica):
        """A replica's arrays per segment, and the same with scratch running statistics. Made once per replica, so
        that cached graphs bound to the arrays are built once."""
        entry = self._parts.get(id(replica))
        if entry is None:
            entry = self._parts[id(replica)] = (replica, parts_of(self.segments, replica),
                                                parts_of(self.segments, replica, scratch=True))
        return entry[1], entry[2]

    def __call__(self, X, params):
        return self.forward_all([X], [params])[0]

    def forward_all(self, X_shards, device_params):
        """The outputs of every shard on its replica's context (``GluonNet.forward_all``'s contract)."""
        if len(X_shards) != len(device_params):
            raise ValueError(f"{len(X_shards)} shards but {len(device_params)} replicas")
        if not autograd.is_recording():
            return run_net(self.full, X_shards, device_params)
        per_replica = [self._parts_of(replica) for replica in device_params]
        parts = [[own[s] for own, _ in per_replica] for s in range(len(self.segments))]
        scratch = [[spare[s] for _, spare in per_replica] for s in range(len(self.segments))]
        outputs, pending = self.blocks.forward(X_shards, parts, scratch)
        self._pending = (pending, parts)
        return outputs

    def idle_all(self, device_params):
        """In training, a forward and backward of no example through the blocks (each block's ``idle_all``, a job's
        BatchNorm gathers, and the running statistics they give, once: in the recomputation, as with examples)."""
        if not autograd.is_training():
            return
        per_replica = [self._parts_of(replica) for replica in device_params]
        parts = [[own[s] for own, _ in per_replica] for s in range(len(self.segments))]
        scratch = [[spare[s] for _, spare in per_replica] for s in range(len(self.segments))]
        with autograd.record():
            _, pending = self.blocks.forward([], parts, scratch)
        self.blocks.backward(pending, [], None, parts)

    def backward(self, heads, head_grads=None):
        """The backward pass of the last recorded forward: ``autograd.backward(heads, head_grads)`` through the
        last block, then each earlier block recomputed and differentiated, last first. Nothing waits."""
        if self._pending is None:
            raise RuntimeError("net.backward follows a forward recorded under autograd.record(); there is none")
        (pending, parts), self._pending = self._pending, None
        self.blocks.backward(pending, heads, head_grads, parts)
