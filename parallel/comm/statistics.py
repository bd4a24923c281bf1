"""BatchNorm's statistics over every worker of a job: what makes W workers train one device's BatchNorm network.

Inside one process ``parallel.models.gluon`` normalises every BatchNorm over the whole batch of the process's
contexts (sums added through recorded copies). Across the workers of a job it goes on here, as PyTorch's
``SyncBatchNorm`` does across processes: each worker computes its slice's count, per-channel sum and sum of squared
deviations from its own mean (two passes, as MXNet's BatchNorm), every worker's three are gathered through the job
(one sum of a buffer of ``num_workers`` slots, each worker filling its own: adding zeros changes no float), and
every worker combines them in the same order (Chan et al.'s pairwise update: the mean of the whole batch, and its
sum of squared deviations ``sum_w M2_w + n_w (mean_w - mean)^2``), so every worker gets the same bits and the
running statistics stay equal on every worker. Unequal slices weigh by their counts.

The gather is recorded (``WorkerSum``, an ``autograd.Function``): its backward sums the gradient of the gathered
buffer over the workers (every worker's output depends on every worker's slot), so the backward pass takes the
gradient of the whole batch's statistics, the same arithmetic as across contexts. One collective a BatchNorm in
the forward pass and one in the backward pass, whatever the number of contexts (ResNet-18: 17 of each a step).

- ``across_workers(job)``: inside it, BatchNorm combines the statistics of ``job``'s workers (``parallel.step``'s
  ``worker_step`` enters it for a job unless ``job.statistics == "worker"``); ``workers()`` reads it.
- ``Gathers``: what one forward gathered (``parallel.models.recompute.Blocks`` makes one a forward): a recomputed
  forward takes the gathered buffers again instead of summing them twice, and its backward sums the gradient once;
  a forward without an example owes its backward rounds until its backward (``settle``).
- ``combine(job, key, where, count, sums, squares)``: the mean and variance of the job's batch; ``idle(job, key,
  channels, dtype)``: the two rounds a forward without an example still makes at a BatchNorm.
"""
import threading
from contextlib import contextmanager

import mxnet as mx
from mxnet import autograd

__all__ = ["across_workers", "workers", "Gathers", "WorkerSum", "combine", "idle", "gathering", "pooled", "row"]


#: The priority of BatchNorm's sums: above every bucket of gradients (the first layers' is 0), whose bytes would
#: otherwise go first where the transport orders by priority (P3); the pass waits for these, not for the buckets.
PRIORITY = 1


class _Local(threading.local):
    """This thread's job (``across_workers``) and the ``Gathers`` a forward collects into or reuses, with its mode."""
    job = None
    gathers = None
    reuse = False
    uses = {}   # where -> the gathers made there so far in this step (across_workers)


_LOCAL = _Local()


@contextmanager
def across_workers(job):
    """Inside the block, BatchNorm in training combines the statistics of every worker of ``job`` (None: this
    worker's contexts alone). A worker's step enters it on the thread that issues the step."""
    before = _LOCAL.job, _LOCAL.uses
    _LOCAL.job, _LOCAL.uses = job, {}
    try:
        yield
    finally:
        _LOCAL.job, _LOCAL.uses = before


def workers():
    """The job whose workers' statistics BatchNorm combines here (``across_workers``), or None."""
    return _LOCAL.job


class Gathers:
    """What BatchNorm gathered over a job's workers in one forward: the buffers a forward off the tape gathered
    (``collecting``), which its recorded recomputation takes again in the same order instead of summing them a
    second time (``reusing``); and the backward rounds a forward without an example owes (``idle``), made by
    ``settle`` once every forward round of it is made (``parallel.models.recompute.Blocks`` settles an empty
    micro-batch's in its backward). One a pending forward: a pipeline keeps several at once."""

    def __init__(self, recomputed=True):
        self.recomputed = recomputed   # False: a forward on the tape, never run again; nothing of it is kept
        self._gathered = {}   # (owner, node) -> the buffers gathered there, oldest first
        self._owed = []       # (job, key, width, dtype) of each backward round owed, in the forward's order

    def __repr__(self):
        return f"Gathers({sum(len(v) for v in self._gathered.values())} kept, {len(self._owed)} owed)"

    @contextmanager
    def _as(self, reuse):
        before = _LOCAL.gathers, _LOCAL.reuse
        _LOCAL.gathers, _LOCAL.reuse = self, reuse
        try:
            yield self
        finally:
            _LOCAL.gathers, _LOCAL.reuse = before

    def collecting(self):
        """Inside the block, what BatchNorm gathers is kept here, and the rounds an idle forward owes."""
        return self._as(False)

    def reusing(self):
        """Inside the block, BatchNorm takes what was kept here (in the order it was kept) instead of gathering,
        and a forward without an example makes nothing (it did, when first run)."""
        return self._as(True)

    def keep(self, where, gathered):
        """Keep ``(buffer, keys)``, what a gather at ``where`` gathered and under which keys, for a recomputation."""
        if self.recomputed:
            self._gathered.setdefault(where, []).append(gathered)

    def take(self, where):
        """The oldest ``(buffer, keys)`` kept at ``where``, removed; None when nothing is."""
        kept = self._gathered.get(where)
        return kept.pop(0) if kept else None

    def owe(self, job, key, width, dtype):
        self._owed.append((job, key, width, dtype))

    def settle(self):
        """Make the backward rounds owed, last BatchNorm first (the order of a backward pass), as zero gradients."""
        owed, self._owed = self._owed, []
        for job, key, width, dtype in reversed(owed):   # unrecorded, as the backward rounds they stand for
            _zero_round(job, key, width, dtype)


def _zero_round(job, key, width, dtype):
    """A worker's round of zeros under BatchNorm's backward ``key``, after its last round of the key."""
    zeros = mx.nd.zeros((width,), dtype=dtype)
    job.after_last_round(key, zeros)
    job.allsum(key, zeros, PRIORITY, recorded=False)


def gathering():
    """``(gathers, reuse)``: the ``Gathers`` a forward here collects into (``reuse`` False) or reuses from, or
    ``(None, False)``."""
    return _LOCAL.gathers, _LOCAL.reuse


class WorkerSum(autograd.Function):
    """``job.allsum`` of a buffer under ``keys[0]``, recorded: the backward pass sums the output's gradient over the
    workers under ``keys[1]`` (each worker's output is the sum of every worker's input). Given ``value`` (what a
    forward off the tape gathered), the forward returns a copy of it and sums nothing. The backward runs on
    MXNet's custom-operator thread when the engine reaches it, in an order nothing fixes against the step's other
    sums: its key is used once a step, so the servers pair every worker's round whatever the order (a worker
    without an example the next step makes its round of the key only once this one is made: ``idle``)."""

    def __init__(self, job, keys, value=None):
        super().__init__()
        self.job, self.keys, self.value = job, keys, value

    def forward(self, buffer):
        if self.value is not None:
            return self.value.copy()
        return self.job.allsum(self.keys[0], buffer.copy(), PRIORITY)   # a copy: the kvstore writes the sum into it

    def backward(self, grad):   # from the custom-operator thread: out of the flight records' one ordered stream
        return self.job.allsum(self.keys[1], grad.copy(), PRIORITY, recorded=False)


def _keys(job, where, like):
    """The job's keys of the next gather at ``where`` (a BatchNorm of a net) in this step and of its backward, one
    pair each gather a step (a micro-batch's, a pipeline's), so that no two rounds of one key are in flight at once
    and none is ordered against another by the thread that makes it; numbered, and the backward's initialised on
    the servers, here, on the thread issuing the step, in the order every worker runs the model."""
    n = _LOCAL.uses.get(where, 0)
    _LOCAL.uses[where] = n + 1
    keys = job.key_for((where, n, "forward")), job.key_for((where, n, "backward"))
    job.declare(keys[1], like)
    return keys


def _slots(job, mine):
    """``mine`` in this worker's slot of a buffer of ``job.num_workers`` slots, zeros elsewhere (recorded)."""
    width, rank, ctx, dtype = mine.size, job.rank, mine.context, mine.dtype
    parts = [mx.nd.zeros((rank * width,), ctx=ctx, dtype=dtype)] if rank else []
    parts.append(mine)
    if rank < job.num_workers - 1:
        parts.append(mx.nd.zeros(((job.num_workers - rank - 1) * width,), ctx=ctx, dtype=dtype))
    return mx.nd.concat(*parts, dim=0) if len(parts) > 1 else mine


def _gathered(job, where, slots):
    """Every worker's slot (``WorkerSum``), gathered once a forward: kept for, or taken by, its recomputation (which
    sums the gradient under the kept backward key)."""
    gathers, reuse = gathering()
    kept = gathers.take(where) if gathers is not None and reuse else None
    if kept is not None:
        return WorkerSum(job, kept[1], kept[0])(slots)
    keys = _keys(job, where, slots)
    gathered = WorkerSum(job, keys)(slots)
    if gathers is not None:
        gathers.keep(where, (gathered, keys))
    return gathered


def combine(job, where, count, sums, squares):
    """The mean and (biased) variance over the batch of every worker of ``job``, shape ``(channels,)`` on
    ``sums``' context (recorded: gradients reach ``sums`` and ``squares``).

    ``count``: this worker's examples times positions a channel (an int, at least 1); ``sums``: its per-channel
    sums; ``squares``: its per-channel sums of squared deviations from its own mean ``sums / count``. ``where``:
    the BatchNorm (its net and node), which names its keys. A collective call: every worker calls it (one without
    an example calls ``idle``)."""
    return _moments(_gathered(job, where, _slots(job, row(count, sums, squares))), job.num_workers, sums.size)


def row(count, sums, squares):
    """One batch's ``count``, per-channel ``sums`` and sums of squared deviations from its mean (``squares``) as one
    row of ``pooled``'s (a worker's slot, a context's row), on ``sums``' context (recorded)."""
    return mx.nd.concat(mx.nd.full((1,), count, ctx=sums.context, dtype=sums.dtype), sums, squares, dim=0)


def pooled(rows):
    """``(count, sums, squares)`` of the union of the batches whose rows ``rows`` holds, shape ``(R, 2 C + 1)``: each
    row a batch's count, per-channel sums and sums of squared deviations from its own mean; the union's count
    ``(1,)``, sums and sums of squared deviations from its mean ``(C,)``. Chan et al.'s pairwise update, in row order
    (recorded). A row of count 0 adds nothing."""
    channels = (rows.shape[1] - 1) // 2
    counts = mx.nd.slice_axis(rows, axis=1, begin=0, end=1)                        # (R, 1)
    row_sums = mx.nd.slice_axis(rows, axis=1, begin=1, end=channels + 1)           # (R, C)
    row_squares = mx.nd.slice_axis(rows, axis=1, begin=channels + 1, end=None)     # (R, C)
    total = counts.sum(axis=0)                                                     # (1,)
    sums = row_sums.sum(axis=0)
    mean = mx.nd.broadcast_div(sums, total)
    row_means = mx.nd.broadcast_div(row_sums, mx.nd.maximum(counts, 1))           # an empty row's: 0
    spread = mx.nd.broadcast_mul(counts, mx.nd.square(mx.nd.broadcast_sub(row_means, mean.reshape((1, -1)))))
    return total, sums, row_squares.sum(axis=0) + spread.sum(axis=0)


def _moments(gathered, num_workers, channels):
    """The mean and variance of the whole batch from every worker's slot (count, sums, squared deviations from its
    own mean) in ``gathered`` (``pooled``), in the same order on every worker (recorded)."""
    total, sums, squares = pooled(gathered.reshape((num_workers, 2 * channels + 1)))
    return mx.nd.broadcast_div(sums, total), mx.nd.broadcast_div(squares, total)


def idle(job, where, channels, dtype):
    """What a worker without an example makes at a BatchNorm in a forward: its empty slot in the forward's gather,
    then a zero gradient in the backward's: owed to the ``Gathers`` collecting (``Gathers.settle``), else made at
    once. In a recomputation (``Gathers.reusing``) nothing: what the first run gathered is taken again. Returns the
    mean and variance of the other workers' batch, as ``combine`` (unrecorded), or None when no worker had an
    example (an empty micro-batch everywhere: nothing to normalise, and no backward round, which every worker
    knows from the forward's). Blocks until the forward's round is summed.

    The backward's round is made only then: the last round of its key, a step before, may be this worker's own
    backward, made by MXNet's custom-operator thread once its engine reaches it, and a round made here first
    would leave first (``Job.after_last_round`` orders it after rounds already made). Once the forward's round is
    summed, it has: another worker's example in this round was computed with the parameters that this worker's
    last backward pass updated."""
    gathers, reuse = gathering()
    width = job.num_workers * (2 * channels + 1)
    kept = gathers.take(where) if gathers is not None and reuse else None
    if kept is None:
        zeros = mx.nd.zeros((width,), dtype=dtype)
        keys = _keys(job, where, zeros)
        job.after_last_round(keys[0], zeros)   # zeros are ready at once; the last round may still wait for its slot
        gathered = job.allsum(keys[0], zeros, PRIORITY)
        if gathers is not None:
            gathers.keep(where, (gathered, keys))
    else:
        gathered = kept[0]
    counts = gathered.reshape((job.num_workers, 2 * channels + 1))[:, 0]
    if not counts.sum().asscalar():
        return None
    if kept is None:
        if gathers is None:
            _zero_round(job, keys[1], width, dtype)
        else:
            gathers.owe(job, keys[1], width, dtype)
    return _moments(gathered, job.num_workers, channels)
